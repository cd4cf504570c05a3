"""The async shell shared by Relay Decode and Main Decode.

Both decoders receive KV on their own TCP port, accept DecodeAssigns over NATS, turn the KV
into a cache on the engine thread and publish tokens to the request's event subject. What each
does once the KV is there (RLD: decode eagerly, hand off; MD: take over) is the subclass's
`decode` method.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace

from shared import bus, messages, subjects, tracing
from shared.config import DecoderConfig, read_secret
from shared.batch_engine import BatchEngine
from shared.errors import DeadlineExceeded, PddError
from shared.kv_transfer import KVInbox, KVReceiver
from shared.kv_wire import DTYPE_NAMES
from shared.messages import (Abort, CacheEvents, DecodeAccepted, DecodeAssign, Heartbeat, KVReceived, RequestFailed,
                             TokenChunk)
from shared.metrics import decoder_metrics, serve as serve_metrics
from shared.model_runner import DecodeSequence, ModelRunner
from shared.models import kv_layout, load_model, resolve_model
from shared.radix_cache import CacheEvent, PrefixHandle, RadixCache
from shared.service_runtime import heartbeat_loop, now

log = logging.getLogger(__name__)

CACHE_EVENT_BLOCK_TOKENS = 16  # granularity of the gateway's view of the DRC


@dataclass
class DecodeRequest:
    """One request on a decoder, from assignment to release."""

    assign: DecodeAssign
    inbox: KVInbox
    trace_context: otel_context.Context
    prefix: PrefixHandle | None = None  # MD: the DRC prefix locked for this request
    assigned_at: float = field(default_factory=time.monotonic)
    decoding_done: bool = False  # set once the last token is out; an abort then no longer cancels
    remembered: bool = False  # its KV is in the DRC already
    main_progress: asyncio.Event = field(default_factory=asyncio.Event)  # RLD: a KVReady came
    main_lost: bool = False  # RLD: the gateway says MD is gone; finish alone
    handoffs: asyncio.Queue = field(default_factory=asyncio.Queue)  # MD: Handoff messages from RLD
    task: asyncio.Task | None = None
    span: trace.Span | None = None  # `<role>.request`, for an abort to mark

    @property
    def request_id(self) -> str:
        return self.assign.request_id

    @property
    def events_subject(self) -> str:
        return subjects.request_events(self.assign.request_id)


class DecoderService:
    role: str = ""

    def __init__(self, config: DecoderConfig) -> None:
        self.config = config
        self.instance_id = config.common.instance_id
        path = resolve_model(config.model.model)
        self.layout = kv_layout(path)
        self.runner = ModelRunner(load_model(path, config.model.dtype, config.model.device))
        self.engine = BatchEngine(self.runner, config.engine, self.role)
        self.receiver = KVReceiver(self.layout, DTYPE_NAMES[config.model.dtype], read_secret(config.kv_secret_file))
        self.tracer = tracing.tracer(f"pdd.{self.role}")
        self.requests: dict[str, DecodeRequest] = {}
        self._tasks: set[asyncio.Task] = set()
        self._cache_events: list[CacheEvent] = []
        self.prefix_cache = (RadixCache(config.cache.tokens, config.cache.kv_bytes, self._cache_events.append,
                                        event_block_tokens=CACHE_EVENT_BLOCK_TOKENS)
                             if config.cache.enabled else None)
        self.metrics = decoder_metrics(self.role)
        self.metrics.track_load(lambda: len(self.requests), lambda: self.engine.queued)

    async def start(self) -> None:
        self.metrics_server = serve_metrics(self.metrics.registry, self.config.common.metrics_host,
                                            self.config.common.metrics_port)
        self.kv_port = await self.receiver.start(self.config.kv_host, self.config.kv_port)
        self.advertise_port = self.config.advertise_port or self.kv_port
        log.info("KV socket on %s:%d (advertised as %s:%d)", self.config.kv_host, self.kv_port,
                 self.config.advertise_host, self.advertise_port)
        self.nc = await bus.connect(self.config.common.nats_url, self.instance_id, self.config.common.nats_auth)
        await self.nc.subscribe(subjects.decode_assign(self.role, self.instance_id), cb=self._on_assign)
        await self.nc.subscribe(subjects.abort(), cb=self._on_abort)
        await self.subscribe_role()
        self._tasks.add(asyncio.create_task(
            heartbeat_loop(self.nc, self.role, self.config.common.heartbeat_s, self._describe)))

    async def subscribe_role(self) -> None:
        """Subscriptions only this role has."""

    def role_stats(self) -> dict[str, float]:
        """Gauges only this role has, for its heartbeat."""
        return {}

    async def stop(self) -> None:
        await self.nc.drain()
        tasks = [*self._tasks, *(r.task for r in self.requests.values() if r.task)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.receiver.stop()
        self.engine.shutdown()
        if self.metrics_server is not None:
            self.metrics_server.close()

    def _describe(self) -> Heartbeat:
        stats = {"open_inboxes": len(self.receiver.inboxes), "kv_connections": self.receiver.open_connections,
                 "kv_refused_connections": self.receiver.refused_connections,
                 "frames_dropped": self.receiver.frames_dropped, **self.role_stats(), **self.engine.stats(),
                 **(self.prefix_cache.gauges() if self.prefix_cache is not None else {})}
        held: dict[str, list[str]] = {}
        for request in self.requests.values():
            if request.assign.owner:
                held.setdefault(request.assign.owner, []).append(request.request_id)
        return Heartbeat(self.role, self.instance_id, self.config.advertise_host, self.advertise_port,
                         self.layout.model_id, len(self.requests), self.engine.waiting, now(), {}, stats, held)

    async def _on_assign(self, msg: Msg) -> None:
        try:
            assign = messages.decode_as(msg.data, DecodeAssign)
            if assign.request_id in self.requests:
                raise PddError(f"{assign.request_id} is already assigned here")
        except PddError as exc:
            await bus.reply_error(msg, exc)
            return
        prefix = self.prefix_cache.lock(assign.prompt_ids[:-1]) if self.prefix_cache is not None else None
        cached = prefix.length if prefix else 0
        self.metrics.cache_hit_tokens.inc(cached)
        inbox = self.receiver.expect(assign.request_id, cached, assign.kv_tokens)
        request = DecodeRequest(assign, inbox, tracing.extract(msg.headers), prefix)
        self.requests[assign.request_id] = request
        request.task = asyncio.create_task(self._serve(request), name=f"{self.role}-{assign.request_id}")
        await msg.respond(messages.encode(DecodeAccepted(
            assign.request_id, self.instance_id, self.config.advertise_host, self.advertise_port, cached)))

    async def _on_abort(self, msg: Msg) -> None:
        try:
            abort = messages.decode_as(msg.data, Abort)
        except PddError:
            return
        request = self.requests.get(abort.request_id)
        if request is not None and request.task is not None and not request.decoding_done:
            self.metrics.aborts.labels(abort.reason).inc()
            if request.span is not None:
                tracing.mark_aborted(request.span, abort.reason)
            request.task.cancel()

    async def _serve(self, request: DecodeRequest) -> None:
        try:
            with self.tracer.start_as_current_span(f"{self.role}.request", context=request.trace_context) as span:
                span.set_attributes({"pdd.request_id": request.request_id, "pdd.cached_tokens": request.inbox.token_start})
                request.span = span
                with self.tracer.start_as_current_span(f"{self.role}.kv_wait") as wait_span:
                    kv = await request.inbox.wait(request.assign.deadline_s, self.config.kv_stall_timeout_s)
                    wait_span.set_attributes({"pdd.kv_bytes": request.inbox.bytes_received,
                                              "pdd.kv_tokens": request.inbox.token_end - request.inbox.token_start})
                self.metrics.kv_received_bytes.inc(request.inbox.bytes_received)
                self.metrics.kv_wait.observe(time.monotonic() - request.assigned_at)
                inbox = request.inbox
                await bus.publish(self.nc, request.events_subject, KVReceived(
                    request.request_id, self.role, inbox.token_start, inbox.token_end - inbox.token_start,
                    inbox.bytes_received, time.monotonic() - request.assigned_at))
                if request.prefix is not None and request.prefix.length:
                    kv = (self.prefix_cache.gather(request.prefix), kv)
                if request.prefix is not None:
                    request.prefix.release()
                submitted_ns = time.time_ns()
                seq = await self._admit(request, kv)
                started_ns = time.time_ns()
                tracing.record_span(self.tracer, f"{self.role}.queue", submitted_ns, started_ns,
                                    {"pdd.engine_queued": self.engine.queued})
                await self.decode(request, seq)
                request.decoding_done = True
                await self.remember(request, seq)
        except asyncio.CancelledError:
            raise
        except PddError as exc:
            log.warning("%s failed on %s: %s", request.request_id, self.role, exc)
            await self._publish_failure(request, exc.code, str(exc))
        except Exception as exc:
            log.exception("%s failed on %s", request.request_id, self.role)
            await self._publish_failure(request, "internal_error", str(exc))
        finally:
            if request.prefix is not None:
                request.prefix.release()
            self.receiver.release(request.request_id)
            self.engine.release(request.request_id)  # its KV, on every path, once
            self.requests.pop(request.request_id, None)

    async def _admit(self, request: DecodeRequest,
                     kv: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> DecodeSequence:
        """Reserve the request's KV in the batch engine, waiting while its budget is full, and fill it."""
        assign = request.assign
        seq = DecodeSequence(assign.request_id, assign.prompt_ids, assign.sampling, self.runner.max_context_tokens,
                             first_index=assign.output_offset)
        parts = kv if isinstance(kv, tuple) else (kv,)  # (cached prefix, received suffix) or the received KV
        remaining = assign.deadline_s - (time.monotonic() - request.assigned_at)
        try:
            async with asyncio.timeout(max(0.0, remaining)):
                await self.engine.open(seq.request_id, parts, seq.kv_tokens_needed, seq)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"no KV budget for {assign.request_id} before its deadline") from exc
        return seq

    async def remember(self, request: DecodeRequest, seq: DecodeSequence) -> None:
        """Keep the request's prompt and output KV in the DRC, so the session's next turn hits it."""
        if self.prefix_cache is None or request.remembered:
            return
        request.remembered = True
        cached = seq.kv.length
        tokens = (seq.prompt_ids + seq.output_ids)[:cached]
        kv = await self.engine.export(seq.request_id, 0, cached)
        self.prefix_cache.insert(tokens, kv)
        await self.publish_cache_events()

    async def publish_cache_events(self) -> None:
        if not self._cache_events:
            return
        events = [{**dataclasses.asdict(event), "block_hashes": [list(b) for b in event.block_hashes]}
                  for event in self._cache_events]
        self._cache_events.clear()
        try:
            await bus.publish(self.nc, subjects.cache_events(self.instance_id), CacheEvents(self.instance_id, events))
        except Exception as exc:  # the index catches up from the next batch
            log.warning("cache events not published: %s", exc)

    async def decode(self, request: DecodeRequest, seq: DecodeSequence) -> None:
        raise NotImplementedError

    async def step(self, request: DecodeRequest, seq: DecodeSequence, feed_ids: list[int]) -> str | None:
        """One forward pass on the engine thread; publishes the token it makes."""
        finish_reason = await self.forward(seq, feed_ids)
        await self.publish_token(request, seq, finish_reason)
        return finish_reason

    async def forward(self, seq: DecodeSequence, feed_ids: list[int]) -> str | None:
        """Feed tokens in the batch engine's next step(s) and sample the next one into seq.output_ids."""
        _, finish_reason = await self.engine.step(seq, feed_ids)
        return finish_reason

    async def extend(self, seq: DecodeSequence, feed_ids: list[int]) -> None:
        """Feed tokens without sampling (MD adopting a Catch-Up chunk)."""
        await self.engine.extend(seq.request_id, feed_ids)

    async def publish_token(self, request: DecodeRequest, seq: DecodeSequence, finish_reason: str | None) -> None:
        if finish_reason is not None:
            # into the DRC before the client sees the end, so a session's next turn always finds it
            await self.remember(request, seq)
        self.metrics.output_tokens.inc()
        await bus.publish(self.nc, request.events_subject, TokenChunk(
            request.request_id, len(seq.output_ids) - 1, [seq.output_ids[-1]], self.role, finish_reason))

    async def _publish_failure(self, request: DecodeRequest, code: str, message: str) -> None:
        try:
            await bus.publish(self.nc, request.events_subject, RequestFailed(request.request_id, self.role, code, message))
        except Exception as exc:  # the gateway's own deadline still ends the request
            log.warning("could not report failure of %s: %s", request.request_id, exc)
