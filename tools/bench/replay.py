"""Send a workload to a gateway and record what each request saw.

Open loop: each request leaves at its arrival time (a session's turn also waits for the turn
before it, whose answer it appends), at most `max_concurrency` in flight, each under its own
timeout; nothing is sent after `duration_s`. Knows nothing of stacks or modes.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from tools.api_client import ApiError, StreamResult, stream_completion
from tools.bench.config import LoadOptions
from tools.bench.workloads import PlannedRequest, Workload, token_ids


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, from the run's start or the send."""

    index: int
    session: int | None
    arrival_s: float  # planned
    sent_s: float | None = None  # None: never sent (duration or run ended first)
    sent_at: float | None = None  # when it was sent, wall clock (time.time()), to line up with server timelines
    response_id: str | None = None
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    planned_hit_tokens: int = 0
    max_tokens: int = 0
    completion_tokens: int = 0
    token_times_s: list[float] = field(default_factory=list)  # since sent
    tiers: list[str] = field(default_factory=list)
    e2e_s: float | None = None
    pipeline: str | None = None
    prefill_hit_tokens: int = 0
    main_hit_tokens: int = 0
    main_kv_tokens: int = 0
    main_kv_bytes: int = 0
    relay_kv_bytes: int = 0
    tokens_by_tier: dict[str, int] = field(default_factory=dict)
    handoff: dict[str, float] | None = None
    prefill_s: float | None = None  # P's own time, when the gateway reports it
    policy: dict[str, object] | None = None  # the gateway's pipeline choice: reason, predictions, held

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None


def _record_result(rec: RequestRecord, result: StreamResult, e2e_s: float) -> None:
    summary = result.summary or {}
    cached = summary.get("cached_tokens") or {}
    kv = summary.get("kv") or {}
    main_kv = kv.get("main") or {}
    prefill = summary.get("prefill")
    rec.ok = True
    rec.response_id = result.response_id
    rec.e2e_s = e2e_s
    rec.token_times_s = list(result.token_times_s)
    rec.tiers = list(result.tiers)
    rec.completion_tokens = int((result.usage or {}).get("completion_tokens", len(result.token_ids)))
    rec.pipeline = summary.get("pipeline")
    rec.prefill_hit_tokens = int(cached.get("prefill", 0))
    rec.main_hit_tokens = int(cached.get("main", 0))
    rec.main_kv_tokens = int(main_kv.get("kv_tokens", 0))
    rec.main_kv_bytes = int(main_kv.get("kv_bytes", 0))
    rec.relay_kv_bytes = int((kv.get("relay") or {}).get("kv_bytes", 0))
    rec.tokens_by_tier = {str(k): int(v) for k, v in (summary.get("tokens_by_tier") or {}).items()}
    rec.handoff = result.handoff
    rec.policy = summary.get("policy")
    if isinstance(prefill, dict) and prefill.get("prefill_s") is not None:
        rec.prefill_s = float(prefill["prefill_s"])


class Replayer:
    """Sends one workload; `histories` holds each session's prompt plus answers so far."""

    def __init__(self, session: aiohttp.ClientSession, api_url: str, pdd_fields: dict[str, object] | None,
                 load: LoadOptions, on_done: Callable[[RequestRecord], None] = lambda rec: None,
                 model: str | None = None) -> None:
        self.session = session
        self.api_url = api_url
        self.pdd_fields = pdd_fields  # None: a server that is not pdd; requests carry no `pdd` object
        self.model = model
        self.load = load
        self.on_done = on_done
        self.histories: dict[int, list[int]] = {}

    def _prompt(self, req: PlannedRequest) -> list[int]:
        if req.session is None:
            return list(req.new_ids)
        return self.histories.setdefault(req.session, []) + list(req.new_ids)

    async def send(self, req: PlannedRequest, t0: float) -> RequestRecord:
        """One request now; a session's history grows by the prompt and the answer either way."""
        prompt = self._prompt(req)
        rec = RequestRecord(req.index, req.session, req.arrival_s, sent_s=time.monotonic() - t0,
                            prompt_tokens=len(prompt), planned_hit_tokens=req.planned_hit_tokens,
                            max_tokens=req.max_tokens)
        body: dict[str, object] = {"prompt": prompt, "max_tokens": req.max_tokens, "temperature": 0,
                                   "ignore_eos": True}
        if self.pdd_fields is not None:
            body["pdd"] = dict(self.pdd_fields)
        if self.model is not None:
            body["model"] = self.model
        answer: list[int] = []
        sent = time.monotonic()
        rec.sent_at = time.time()
        try:
            async with asyncio.timeout(self.load.request_timeout_s):
                result = await stream_completion(self.session, self.api_url, body)
            _record_result(rec, result, time.monotonic() - sent)
            answer = result.token_ids
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            rec.error = f"timeout after {self.load.request_timeout_s:g} s"
        except (ApiError, aiohttp.ClientError, OSError, ValueError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        if req.session is not None:
            self.histories[req.session] = prompt + answer
        return rec

    async def warm_up(self, requests: tuple[PlannedRequest, ...]) -> list[RequestRecord]:
        """Unmeasured: the requests of no session one at a time (they wake the tiers), then the
        sessions' openings side by side, up to max_concurrency, as sessions already running (one at a
        time, a few hundred sessions of long answers took minutes)."""
        t0 = time.monotonic()
        records = [await self.send(req, t0) for req in requests if req.session is None]
        gate = asyncio.Semaphore(self.load.max_concurrency)

        async def opening(req: PlannedRequest) -> RequestRecord:
            async with gate:
                return await self.send(req, t0)

        async with asyncio.TaskGroup() as tasks:
            openings = [tasks.create_task(opening(req)) for req in requests if req.session is not None]
        return records + [task.result() for task in openings]

    async def run(self, requests: tuple[PlannedRequest, ...]) -> tuple[list[RequestRecord], float]:
        """Every request by its arrival time; returns the records (in plan order) and the run's seconds."""
        load = self.load
        requests = requests[:load.max_requests]
        gate = asyncio.Semaphore(load.max_concurrency)
        t0 = time.monotonic()
        last_turn: dict[int, asyncio.Event] = {}
        records = [RequestRecord(r.index, r.session, r.arrival_s, planned_hit_tokens=r.planned_hit_tokens,
                                 max_tokens=r.max_tokens) for r in requests]

        async def one(slot: int, req: PlannedRequest, before: asyncio.Event | None, done: asyncio.Event) -> None:
            try:
                await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
                if before is not None:
                    await before.wait()
                if time.monotonic() - t0 > load.duration_s:
                    return
                async with gate:
                    if time.monotonic() - t0 > load.duration_s:
                        return
                    records[slot] = await self.send(req, t0)
                self.on_done(records[slot])
            finally:
                done.set()

        async with asyncio.TaskGroup() as tasks:
            for slot, req in enumerate(requests):
                done = asyncio.Event()
                before = last_turn.get(req.session) if req.session is not None else None
                if req.session is not None:
                    last_turn[req.session] = done
                tasks.create_task(one(slot, req, before, done))
        return records, time.monotonic() - t0  # as `vllm bench serve`: from the start until all are done


def warmup_requests(workload: Workload, n: int) -> tuple[PlannedRequest, ...]:
    """n short unrelated requests (to wake every tier) followed by the workload's own warm-up."""
    wake = tuple(PlannedRequest(-1000 - i, 0.0, token_ids(f"wake:{workload.name}:{i}", 32), 4) for i in range(n))
    return wake + workload.warmup
