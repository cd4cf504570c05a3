"""The engine's KV budget (nano-vllm's block manager): a budget of KV positions, admission in arrival
order while it has room, a decoding request's growth as it decodes, preemption of the newest
requests when a step's growth does not fit, and exactly one free per request.

Runs on the engine thread (shared/batch_engine.py); it decides nothing about which work runs.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shared.config import EngineConfig
from shared.engine_futures import notify
from shared.errors import BadRequest, KVPreempted, PddError
from shared.model_runner import DecodeSequence, ModelRunner, SequenceKV
from shared.scheduler import Row

log = logging.getLogger(__name__)


class KVBudgetExceeded(BadRequest):
    """The request needs more KV than the whole budget: it could never be admitted."""


@dataclass
class Admission:
    key: str
    parts: Sequence[torch.Tensor]
    kv_tokens: int  # the most positions it will hold
    first_tokens: int  # what admission allocates (and the budget must have room for)
    seq: DecodeSequence | None
    future: asyncio.Future
    background: bool = False


@dataclass
class Slot:
    kv: SequenceKV  # kv.capacity positions allocated: what the budget counts
    kv_tokens: int  # the most it may grow to
    seq: DecodeSequence | None
    background: bool = False  # its long work goes after everyone else's (P's warm-ups)

    @property
    def kv_length(self) -> int:
        return self.kv.length


class KVBudget:
    def __init__(self, runner: ModelRunner, config: EngineConfig, prepare: Callable[[Admission], None],
                 on_free: Callable[[str, PddError | None], None], record: Callable[..., None]) -> None:
        """`prepare`: what the engine readies before an admission's KV is allocated (its grammar); an
        error fails the admission. `on_free(key, exc)`: a request was freed, its queued work fails
        with exc (None: is cancelled). `record`: the engine's timeline."""
        self.runner = runner
        self.budget_tokens = config.kv_budget_tokens  # 0: no limit
        self.grow_tokens = config.kv_grow_tokens
        self.prepare = prepare
        self.on_free = on_free
        self.record = record
        self.waiting: deque[Admission] = deque()
        self.slots: dict[str, Slot] = {}  # in admission order: the newest, last, is preempted first
        self.used_tokens = 0
        self.frees = 0
        self.grows = 0
        self.preemptions = 0
        self.preempted: set[str] = set()  # keys whose KV was taken back, until they are released

    def admission(self, key: str, parts: Sequence[torch.Tensor], kv_tokens: int, seq: DecodeSequence | None,
                  pending_tokens: int, background: bool, future: asyncio.Future) -> Admission:
        """What `BatchEngine.open` asks for: a decoding request (`seq`) first gets its parts, the
        pending tokens and `kv_grow_tokens` more, any other all `kv_tokens` at once."""
        if self.budget_tokens and kv_tokens > self.budget_tokens:
            raise KVBudgetExceeded(f"{key} needs {kv_tokens} KV tokens, more than the budget of {self.budget_tokens}")
        filled = sum(part.shape[3] for part in parts) + pending_tokens
        first = min(kv_tokens, filled + self.grow_tokens) if seq is not None and self.grow_tokens else kv_tokens
        return Admission(key, parts, kv_tokens, first, seq, future, background)

    def admit(self) -> None:
        """Admit waiting requests in arrival order while the budget has room."""
        while self.waiting:
            admission = self.waiting[0]
            if self.budget_tokens and self.used_tokens + admission.first_tokens > self.budget_tokens:
                return  # in arrival order: a big request is not overtaken forever by small ones
            self.waiting.popleft()
            try:
                self.prepare(admission)
                kv = self.runner.new_kv(admission.first_tokens, admission.parts)
            except Exception as exc:
                notify(admission.future, exc=exc)
                continue
            self.slots[admission.key] = Slot(kv, admission.kv_tokens, admission.seq, admission.background)
            self.used_tokens += admission.first_tokens
            self.record("admitted", t_ns=time.time_ns(), key=admission.key, tokens=admission.first_tokens)
            if admission.seq is not None:
                admission.seq.kv = kv
            notify(admission.future, kv)  # a caller that gave up meanwhile still releases the key

    def release(self, key: str) -> None:
        """The request is done: free its KV (or withdraw its wait), and admit who fits now."""
        self.preempted.discard(key)
        self.free(key, None)
        self.admit()

    def free(self, key: str, exc: PddError | None) -> None:
        """Drop a request's KV and its wait; its pending work fails with `exc`, or is cancelled."""
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.used_tokens -= slot.kv.capacity
            self.frees += 1
            slot.kv.data = torch.empty(0)  # the storage goes now, whoever still holds the SequenceKV
        withdrawn = [a.future for a in self.waiting if a.key == key]
        self.waiting = deque(a for a in self.waiting if a.key != key)
        for future in withdrawn:
            notify(future, exc=exc, cancel=exc is None)
        self.on_free(key, exc)

    def make_room(self, rows: list[Row]) -> list[Row]:
        """Grow the KV of each row that would overflow it, preempting the newest requests while the
        budget cannot give the growth (a row that is itself the newest gives way): the rows left."""
        for work, take in rows:
            slot = self.slots.get(work.key)
            if slot is None or slot.kv.length + take <= slot.kv.capacity:
                continue
            needed = slot.kv.length + take
            more_room = max(self.grow_tokens, slot.kv.length // 4)  # long answers copy rarely
            capacity = min(max(slot.kv_tokens, needed), needed + more_room)
            more = capacity - slot.kv.capacity
            while self.budget_tokens and self.used_tokens + more > self.budget_tokens:
                victim = next(reversed(self.slots))  # the newest admitted loses the least work
                self.preempt(victim)
                if victim == work.key:
                    break
            if work.key in self.slots:
                started_ns = time.time_ns()
                slot.kv.data = self.runner.grown(slot.kv.data, slot.kv.length, capacity)
                self.record("command", t_ns=started_ns, end_ns=time.time_ns(), label="grow", key=work.key)
                self.used_tokens += more
                self.grows += 1
        return [(work, take) for work, take in rows if work.key in self.slots]

    def preempt(self, key: str) -> None:
        log.info("preempting %s: the KV budget of %d tokens is full", key, self.budget_tokens)
        self.preemptions += 1
        self.preempted.add(key)
        self.free(key, KVPreempted(f"{key} was preempted: the decoder's KV budget "
                                   f"({self.budget_tokens} tokens) is full"))

    def filled_tokens(self) -> int:
        """What admitted requests hold (readable from any thread)."""
        while True:
            try:
                return sum(slot.kv.length for slot in tuple(self.slots.values()))
            except RuntimeError:  # the engine thread changed the dict under us: read again
                continue
