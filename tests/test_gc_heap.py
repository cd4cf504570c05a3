"""shared.gc_heap: the start-up heap frozen without freezing its garbage, and every collection timed.

Freezing is process-wide, so those checks run in a child interpreter, not in pytest's own."""
from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from shared import gc_heap

ROOT = Path(__file__).resolve().parents[1]

FREEZE_CHILD = """
import gc, weakref
from shared import gc_heap

pauses = gc_heap.shared()  # a service installs it with its metrics, before its start-up ends
gc.collect()
assert pauses.collections[2] == 1

class Node:
    pass

garbage = Node(); garbage.me = garbage  # a reference cycle nobody holds: only a collection frees it
gone = weakref.ref(garbage)
del garbage
kept = [Node() for _ in range(1000)]
heap = gc_heap.freeze_startup_heap()
frozen = heap.objects
assert gone() is None, "the cycle was frozen instead of collected"
assert frozen == gc.get_freeze_count() >= 1000, frozen
assert not any(len(gc.get_objects(g)) > 1000 for g in range(3)), [len(gc.get_objects(g)) for g in range(3)]
assert heap.full_collection_s > 0 and heap.full_collection_after_s > 0
assert pauses.collections[2] == 0, "the freeze's own collections are start-up's, not serving's"
print("ok", frozen)
"""


def test_freezing_collects_the_garbage_first_and_leaves_no_start_up_object_to_the_collector() -> None:
    done = subprocess.run([sys.executable, "-c", FREEZE_CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_every_collection_is_counted_and_timed_by_generation() -> None:
    pauses = gc_heap.GCPauses().install()
    try:
        _Cycle()  # garbage only a collection frees
        gc.collect(1)
        gc.collect(2)
        gc.collect(2)
    finally:
        pauses.uninstall()
    assert pauses.collections[1] >= 1 and pauses.collections[2] >= 2
    assert pauses.seconds[2] >= pauses.max_seconds[2] > 0
    assert pauses.collected[1] >= 1
    gc.collect(2)  # uninstalled: no longer counted
    assert pauses.collections[2] == 2


def test_the_collector_reports_pauses_and_the_frozen_heap() -> None:
    pauses = gc_heap.GCPauses().install()
    try:
        gc.collect(0)
    finally:
        pauses.uninstall()
    registry = CollectorRegistry()
    registry.register(pauses.collector())
    text = generate_latest(registry).decode()
    assert 'pdd_gc_collections_total{generation="0"} ' in text
    count = next(line for line in text.splitlines() if line.startswith('pdd_gc_collections_total{generation="0"}'))
    assert float(count.split()[-1]) == pauses.collections[0] >= 1
    assert "pdd_gc_pause_seconds_total" in text and "pdd_gc_pause_max_seconds" in text
    assert 'pdd_gc_collected_objects_total{generation="0"}' in text
    assert f"pdd_gc_frozen_objects {float(gc.get_freeze_count())}" in text
