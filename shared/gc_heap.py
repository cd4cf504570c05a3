"""Python's garbage collector in a serving process: the start-up heap frozen, and every pause counted.

A P, RLD or MD process tracks about 390,000 objects once torch, transformers and its model are
loaded, and a full collection walks all of them: 0.19-0.37 s in a service serving SmolLM2 on a
2-core EPYC, with the GIL held, so the event loop, the engine thread and every token stream stop
for it. (Requests leave few objects behind, so full collections come rarely, but each is a
stall.) Nothing start-up made (modules, the model, the tokenizer's tables) ever becomes garbage,
so once a service is up `freeze_startup_heap` collects once and moves what is left out of the
collector's sight (`gc.freeze`, as vLLM does after its warm-up); what requests allocate later is
still collected.

`GCPauses` times every collection the process makes, by generation (a `gc.callbacks` hook that
only adds numbers: it takes no lock, since a collection can start inside any code holding one),
and `GCPauses.collector()` reports them to a Prometheus registry when it is scraped.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

GENERATIONS = (0, 1, 2)


@dataclass(frozen=True)
class FrozenHeap:
    objects: int  # frozen, in all
    full_collection_s: float  # what a full collection took just before the freeze
    full_collection_after_s: float  # and just after it


def freeze_startup_heap() -> FrozenHeap:
    """Collect every generation, then freeze what survives; times a full collection either side.

    Collecting first matters: `gc.freeze` takes the heap as it is, so garbage in a reference cycle
    frozen now would never be reclaimed. The collections made here are not counted by `shared()`'s
    pauses, which count from the service's start of serving."""
    t0 = time.perf_counter()
    gc.collect()
    t1 = time.perf_counter()
    gc.freeze()
    t2 = time.perf_counter()
    gc.collect()
    t3 = time.perf_counter()
    _SHARED.reset()
    return FrozenHeap(gc.get_freeze_count(), t1 - t0, t3 - t2)


class GCPauses:
    """Every collection's duration, by generation, since `install` (or `reset`). One per process
    (`shared()`, which a service's metrics install and its start-up's freeze resets)."""

    def __init__(self) -> None:
        self.reset()
        self._began: float | None = None  # when the collection under way began (one at a time per process)
        self._installed = False

    def reset(self) -> None:
        """Count from now."""
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.max_seconds = [0.0, 0.0, 0.0]
        self.collected = [0, 0, 0]  # unreachable objects freed: garbage in reference cycles

    def install(self) -> GCPauses:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        began, self._began = self._began, None
        if began is None:  # installed mid-collection
            return
        generation, took = info["generation"], time.perf_counter() - began
        self.collections[generation] += 1
        self.seconds[generation] += took
        self.max_seconds[generation] = max(self.max_seconds[generation], took)
        self.collected[generation] += info["collected"]

    def collector(self) -> Collector:
        """A Prometheus collector of these pauses and of the frozen heap's size."""
        return _GCCollector(self)


class _GCCollector(Collector):
    def __init__(self, pauses: GCPauses) -> None:
        self.pauses = pauses

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        pauses = self.pauses
        count = CounterMetricFamily("pdd_gc_collections", "Python garbage collections since the service was "
                                    "ready, by generation (2: full)", labels=["generation"])
        seconds = CounterMetricFamily("pdd_gc_pause_seconds", "Time spent in Python garbage collections, "
                                      "by generation: every thread of the process waits meanwhile",
                                      labels=["generation"])
        longest = GaugeMetricFamily("pdd_gc_pause_max_seconds", "The longest Python garbage collection "
                                    "since the service was ready, by generation", labels=["generation"])
        collected = CounterMetricFamily("pdd_gc_collected_objects", "Objects Python's garbage collections "
                                        "freed, by generation: garbage in reference cycles, which only a "
                                        "collection frees (with what they hold, tensors included)",
                                        labels=["generation"])
        for generation in GENERATIONS:
            label = [str(generation)]
            count.add_metric(label, pauses.collections[generation])
            seconds.add_metric(label, pauses.seconds[generation])
            longest.add_metric(label, pauses.max_seconds[generation])
            collected.add_metric(label, pauses.collected[generation])
        yield count
        yield seconds
        yield longest
        yield collected
        yield GaugeMetricFamily("pdd_gc_frozen_objects", "Objects moved out of the collector's sight at "
                                "start-up (--gc-freeze)", value=gc.get_freeze_count())


_SHARED = GCPauses()


def shared() -> GCPauses:
    """The process' GCPauses, installed."""
    return _SHARED.install()
