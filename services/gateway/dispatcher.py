"""Runs one request through its pipeline (P-MD or P-RLD-MD) and yields its tokens in order.

The dispatcher assigns the decoders first (so they expect the KV), then starts P, then merges
TokenChunks from RLD and MD by absolute index, each exactly once. Every exit path ends with an
Abort broadcast, so no tier keeps state for a request the gateway has let go.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared import bus, messages, subjects, tracing
from shared.config import GatewayConfig
from shared.errors import DeadlineExceeded, PddError, ProtocolError
from shared.messages import (Abort, DecodeAccepted, DecodeAssign, HandoffStats, KVReceived, KVTarget, PrefillAccepted,
                             PrefillDone, PrefillRequest, RequestFailed, TokenChunk)
from shared.sampling import SamplingParams
from services.gateway.registry import InstanceRegistry

log = logging.getLogger(__name__)

ASSIGN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    pipeline: str | None
    handoff_at: int | None
    md_kv_delay_s: float
    handoff_mode: str | None = None


@dataclass(frozen=True)
class TokenEvent:
    index: int
    token_id: int
    tier: str
    finish_reason: str | None


_FAILED_BY_CODE = {cls.code: cls for cls in (DeadlineExceeded, ProtocolError)}


class RequestRun:
    """One request in flight: its event subscription, merge state and outcome."""

    def __init__(self, nc: NATS, req: GenerationRequest, pipeline: str, config: GatewayConfig) -> None:
        self.nc = nc
        self.request = req
        self.request_id = req.request_id
        self.pipeline = pipeline
        self.config = config
        self.cached_tokens = 0  # P's prefix-cache hit: prompt tokens not computed again
        self.main_cached_tokens = 0  # MD's DRC hit: prompt tokens whose KV did not cross the WAN
        self.handoff: HandoffStats | None = None
        self.prefill: PrefillDone | None = None
        self.kv_received: dict[str, KVReceived] = {}
        self.first_token_at: float | None = None
        self.started_at = time.monotonic()
        self.finished = False
        self._closed = False
        self._events: asyncio.Queue = asyncio.Queue()
        self._sub = None

    async def subscribe(self) -> None:
        self._sub = await self.nc.subscribe(subjects.request_events(self.request_id), cb=self._on_event)

    async def _on_event(self, msg: Msg) -> None:
        try:
            self._events.put_nowait(messages.decode(msg.data))
        except PddError as exc:
            log.warning("%s: dropped a malformed event: %s", self.request_id, exc)

    async def tokens(self) -> AsyncIterator[TokenEvent]:
        """Tokens in index order, each once; raises the failure of any tier."""
        pending: dict[int, TokenEvent] = {}
        next_index = 0
        deadline = self.started_at + self.config.request_timeout_s
        while not self.finished:
            timeout = min(self.config.token_timeout_s, deadline - time.monotonic())
            try:
                async with asyncio.timeout(max(0.0, timeout)):
                    event = await self._events.get()
            except TimeoutError as exc:
                raise DeadlineExceeded(f"{self.request_id}: no token for {timeout:.1f}s") from exc
            if isinstance(event, TokenChunk):
                for offset, token in enumerate(event.token_ids):
                    index = event.start + offset
                    last = offset == len(event.token_ids) - 1
                    if index >= next_index and index not in pending:
                        pending[index] = TokenEvent(index, token, event.tier, event.finish_reason if last else None)
                while next_index in pending:
                    if self.first_token_at is None:
                        self.first_token_at = time.monotonic()
                    token_event = pending.pop(next_index)
                    next_index += 1
                    if token_event.finish_reason is not None:
                        self.finished = True
                    yield token_event
                    if self.finished:
                        break
            elif isinstance(event, KVReceived):
                self.kv_received[event.tier] = event
            elif isinstance(event, HandoffStats):
                self.handoff = event
            elif isinstance(event, PrefillDone):
                self.prefill = event
            elif isinstance(event, RequestFailed):
                raise _FAILED_BY_CODE.get(event.code, PddError)(f"{event.tier}: {event.message}")

    def summary(self) -> dict:
        """What the client may want to know of how the request was served (the response's `pdd` field)."""
        return {
            "pipeline": self.pipeline,
            "cached_tokens": {"prefill": self.cached_tokens, "main": self.main_cached_tokens},
            "kv": {tier: {"cached_tokens": kv.cached_tokens, "kv_tokens": kv.kv_tokens, "kv_bytes": kv.kv_bytes,
                          "kv_wait_s": round(kv.kv_wait_s, 6)} for tier, kv in self.kv_received.items()},
            "ttft_s": None if self.first_token_at is None else round(self.first_token_at - self.started_at, 6),
        }

    async def close(self, reason: str) -> None:
        """Idempotent: stop listening and tell every tier to drop the request."""
        if self._closed:
            return
        self._closed = True
        if self._sub is not None:
            await self._sub.unsubscribe()
        try:
            await bus.publish(self.nc, subjects.abort(), Abort(self.request_id, "finished" if self.finished else reason))
        except Exception as exc:  # the tiers' own deadlines still free the request
            log.warning("%s: abort not broadcast: %s", self.request_id, exc)


class Dispatcher:
    def __init__(self, nc: NATS, registry: InstanceRegistry, config: GatewayConfig) -> None:
        self.nc = nc
        self.registry = registry
        self.config = config
        self.tracer = tracing.tracer("pdd.gateway")

    async def start(self, req: GenerationRequest) -> RequestRun:
        pipeline = req.pipeline or self.config.default_pipeline
        prefill = self.registry.pick("prefill")
        main = self.registry.pick("main")
        relay = self.registry.pick("relay") if pipeline == "p-rld-md" else None
        run = RequestRun(self.nc, req, pipeline, self.config)
        await run.subscribe()
        try:
            with self.tracer.start_as_current_span("gateway.dispatch") as span:
                span.set_attributes({"pdd.request_id": req.request_id, "pdd.pipeline": pipeline,
                                     "pdd.prompt_tokens": len(req.prompt_ids)})
                headers = tracing.inject()
                assign = DecodeAssign(
                    req.request_id, pipeline, req.prompt_ids, req.sampling,
                    relay.heartbeat.instance_id if relay else None, main.heartbeat.instance_id,
                    self.config.request_timeout_s, req.handoff_at, handoff_mode=req.handoff_mode)
                decoders = [("main", main)] + ([("relay", relay)] if relay else [])
                accepted = await asyncio.gather(*(
                    bus.request(self.nc, subjects.decode_assign(role, inst.heartbeat.instance_id), assign,
                                DecodeAccepted, ASSIGN_TIMEOUT_S, headers)
                    for role, inst in decoders))
                targets = [KVTarget(role, acc.kv_host, acc.kv_port, acc.cached_tokens,
                                    req.md_kv_delay_s if role == "main" else 0.0)
                           for (role, _), acc in zip(decoders, accepted)]
                prefill_accepted = await bus.request(
                    self.nc, subjects.prefill(prefill.heartbeat.instance_id),
                    PrefillRequest(req.request_id, req.prompt_ids, targets, self.config.request_timeout_s),
                    PrefillAccepted, ASSIGN_TIMEOUT_S, headers)
                run.cached_tokens = prefill_accepted.cached_tokens
                run.main_cached_tokens = accepted[0].cached_tokens
                span.set_attributes({"pdd.prefill_cached_tokens": run.cached_tokens,
                                     "pdd.main_cached_tokens": run.main_cached_tokens})
        except BaseException:
            await run.close("dispatch failed")
            raise
        return run
