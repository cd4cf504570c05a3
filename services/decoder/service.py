"""The async shell Relay Decode and Main Decode share, given a role (services/decoder/role.py).

It owns the KV socket, the DecodeAssign and Abort subscriptions, the engine thread, heartbeats and
the request registry, moves each request through its phases (services/decoder/request.py) and
publishes tokens and failures. What happens once a request's KV is in is the role's `decode`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
from nats.aio.msg import Msg

from services.decoder.early_messages import EarlyMessages
from services.decoder.request import DecodeRequest, Phase
from services.decoder.role import DecoderRole
from shared import bus, messages, subjects, tracing
from shared.batch_engine import BatchEngine
from shared.config import DecoderConfig, read_secret
from shared.errors import DeadlineExceeded, PddError
from shared.grammar_masks import GrammarCompiler
from shared.kv_receiver import KVReceiver
from shared.kv_wire import DTYPE_NAMES
from shared.messages import (
    Abort,
    DecodeAccepted,
    DecodeAssign,
    Heartbeat,
    KVReceived,
    Message,
    RequestFailed,
    TokenChunk,
)
from shared.metrics import decoder_metrics
from shared.metrics import serve as serve_metrics
from shared.model_runner import DecodeSequence, ModelRunner
from shared.models import kv_layout, load_tokenizer, resolve_model
from shared.service_runtime import ServiceFailure, heartbeat_loop, now
from shared.sim_runner import build_runner

log = logging.getLogger(__name__)


def grammar_compiler(path: Path, runner: ModelRunner) -> GrammarCompiler:
    """The model's vocabulary for constrained decoding (about 0.5 s, once): its EOS ends a finished grammar."""
    tokenizer = load_tokenizer(path)
    eos = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
    return GrammarCompiler.from_hf(tokenizer, runner.config.vocab_size, eos)


class DecoderService:
    def __init__(self, config: DecoderConfig, role: DecoderRole) -> None:
        self.config = config
        self.role = role
        self.name = role.role
        self.instance_id = config.common.instance_id
        path = resolve_model(config.model.model)
        self.layout = kv_layout(path)
        self.runner = build_runner(config.model, path)
        self.engine = BatchEngine(self.runner, config.engine, self.name, grammar_compiler(path, self.runner))
        self.failure = ServiceFailure()  # run_service stops the decoder, exit status 1, if the engine thread dies
        self.engine.on_death = lambda exc: self.failure.fail(f"the engine thread died: {exc!r}")
        self.receiver = KVReceiver(self.layout, DTYPE_NAMES[config.model.dtype], read_secret(config.kv_secret_file),
                                   limits=config.kv_limits)
        self.tracer = tracing.tracer(f"pdd.{self.name}")
        self.requests: dict[str, DecodeRequest] = {}
        self.early = EarlyMessages()  # peers' messages about requests not registered here yet
        self._tasks: set[asyncio.Task] = set()
        self.metrics = decoder_metrics(self.name)
        self.metrics.track_load(lambda: len(self.requests), lambda: self.engine.queued)

    async def start(self) -> None:
        self.loop_lag = self.metrics.loop_lag_monitor().start()
        self.metrics_server = serve_metrics(self.metrics.registry, self.config.common.metrics_host,
                                            self.config.common.metrics_port)
        self.kv_port = await self.receiver.start(self.config.kv_host, self.config.kv_port)
        self.advertise_port = self.config.advertise_port or self.kv_port
        log.info("KV socket on %s:%d (advertised as %s:%d)", self.config.kv_host, self.kv_port,
                 self.config.advertise_host, self.advertise_port)
        self.nc = await bus.connect(self.config.common.nats_url, self.instance_id, self.config.common.nats_auth)
        await self.nc.subscribe(subjects.decode_assign(self.name, self.instance_id), cb=self._on_assign)
        await self.nc.subscribe(subjects.abort(self.instance_id), cb=self._on_abort)
        await self.role.subscribe(self)
        self._tasks.add(asyncio.create_task(
            heartbeat_loop(self.nc, self.name, self.config.common.heartbeat_s, self._describe,
                           self.failure)))

    async def stop(self) -> None:
        self.loop_lag.stop()
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
                 "early_messages": len(self.early), "early_replayed": self.early.replayed,
                 "early_expired": self.early.expired,
                 "kv_refused_connections": self.receiver.refused_connections,
                 "kv_idle_closes": self.receiver.idle_closes, "kv_slow_closes": self.receiver.slow_closes,
                 "frames_dropped": self.receiver.frames_dropped, **self.engine.stats(), **self.role.stats()}
        held: dict[str, list[str]] = {}
        for request in self.requests.values():
            if request.assign.owner and not request.backfill:  # a backfill is no longer the gateway's
                held.setdefault(request.assign.owner, []).append(request.request_id)
        return Heartbeat(self.name, self.instance_id, self.config.advertise_host, self.advertise_port,
                         self.layout.model_id, len(self.requests), self.engine.waiting, now(), {}, stats, held,
                         kv_budget_tokens=self.engine.config.kv_budget_tokens)

    async def _on_assign(self, msg: Msg) -> None:
        try:
            assign = messages.decode_as(msg.data, DecodeAssign)
            if assign.request_id in self.requests:
                raise PddError(f"{assign.request_id} is already assigned here")
        except PddError as exc:
            await bus.reply_error(msg, exc)
            return
        cached = await self.role.hold_prefix(assign)
        self.metrics.cache_hit_tokens.inc(cached)
        inbox = self.receiver.expect(assign.request_id, cached, assign.kv_tokens)
        request = DecodeRequest(assign, inbox, tracing.extract(msg.headers))
        self.requests[assign.request_id] = request
        request.task = asyncio.create_task(self._serve(request), name=f"{self.name}-{assign.request_id}")
        for replay in self.early.take(assign.request_id):  # before anything newer: they came first
            await replay()
        await msg.respond(messages.encode(DecodeAccepted(
            assign.request_id, self.instance_id, self.config.advertise_host, self.advertise_port, cached,
            backfill=assign.backfill and self.role.can_backfill())))

    async def _on_abort(self, msg: Msg) -> None:
        try:
            abort = messages.decode_as(msg.data, Abort)
        except PddError:
            return
        request = self.requests.get(abort.request_id)
        if request is not None and request.task is not None and request.phase.cancellable:
            if self.role.keeps_after_abort(request, abort):
                log.info("%s: RLD finished it; waiting for its KV in the background, for the cache", abort.request_id)
                return
            self.metrics.aborts.labels(abort.reason).inc()
            if request.span is not None:
                tracing.mark_aborted(request.span, abort.reason)
            request.task.cancel()

    async def _serve(self, request: DecodeRequest) -> None:
        try:
            with self.tracer.start_as_current_span(f"{self.name}.request", context=request.trace_context) as span:
                span.set_attributes({"pdd.request_id": request.request_id,
                                     "pdd.cached_tokens": request.inbox.token_start})
                request.span = span
                inbox = request.inbox
                # in the engine now, its held prefix copied in while P computes and sends the rest
                # (a slice between two steps): when that arrives, only its own positions are left
                submitted_ns = time.time_ns()
                try:
                    request.seq = await self._admit(request, inbox.token_end)
                    for piece in await self.role.prefix_kv(request):
                        await self.engine.fill(request.request_id, piece)
                finally:
                    self.role.unlock_prefix(request)
                tracing.record_span(self.tracer, f"{self.name}.queue", submitted_ns, time.time_ns(),
                                    {"pdd.engine_queued": self.engine.queued, "pdd.prefix_tokens": inbox.token_start})
                request.move(Phase.KV_WAIT)
                with self.tracer.start_as_current_span(f"{self.name}.kv_wait") as wait_span:
                    kv = await inbox.wait(request.time_left_s(), self.config.kv_stall_timeout_s)
                    wait_span.set_attributes({"pdd.kv_bytes": inbox.bytes_received,
                                              "pdd.kv_tokens": inbox.token_end - inbox.token_start})
                self.metrics.kv_received_bytes.inc(inbox.bytes_received)
                self.metrics.kv_wait.observe(time.monotonic() - request.assigned_at)
                await bus.publish(self.nc, request.events_subject, KVReceived(
                    request.request_id, self.name, inbox.token_start, inbox.token_end - inbox.token_start,
                    inbox.bytes_received, time.monotonic() - request.assigned_at, inbox.link_bytes_per_s))
                await self.engine.fill(request.request_id, kv)
                request.move(Phase.DECODING)
                request.move(await self.role.decode(request, self))
                await self.role.settle(request, self)
        except asyncio.CancelledError:
            request.move(Phase.ABORTED)
            raise
        except PddError as exc:
            request.move(Phase.FAILED)
            log.warning("%s failed on %s: %s", request.request_id, self.name, exc)
            await self._publish_failure(request, exc.code, str(exc))
        except Exception as exc:
            request.move(Phase.FAILED)
            log.exception("%s failed on %s", request.request_id, self.name)
            await self._publish_failure(request, "internal_error", str(exc))
        finally:
            self.role.release(request)
            self.receiver.release(request.request_id)
            self.engine.release(request.request_id)  # its KV, on every path, once
            self.requests.pop(request.request_id, None)
            request.move(Phase.RELEASED)

    async def _admit(self, request: DecodeRequest, prompt_kv_tokens: int) -> DecodeSequence:
        """Reserve the request's KV in the batch engine, waiting while its budget is full, with room
        for the `prompt_kv_tokens` that `fill` brings in."""
        assign = request.assign
        seq = DecodeSequence(assign.request_id, assign.prompt_ids, assign.sampling, self.runner.max_context_tokens,
                             first_index=assign.output_offset)
        try:
            async with asyncio.timeout(request.time_left_s()):
                await self.engine.open(seq.request_id, (), seq.kv_tokens_needed, seq, prompt_kv_tokens)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"no KV budget for {assign.request_id} before its deadline") from exc
        return seq

    async def _publish_failure(self, request: DecodeRequest, code: str, message: str) -> None:
        try:
            code, message = self.failure.reported(code, message)
            await bus.publish(self.nc, request.events_subject,
                              RequestFailed(request.request_id, self.name, code, message))
        except Exception as exc:  # the gateway's own deadline still ends the request
            log.warning("could not report failure of %s: %s", request.request_id, exc)

    # --- DecoderIO: what a role may use ---------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self.requests)

    def find(self, request_id: str) -> DecodeRequest | None:
        return self.requests.get(request_id)

    def keep_early(self, request_id: str, replay: Callable[[], Awaitable[None]]) -> None:
        self.early.keep(request_id, replay)

    async def subscribe(self, subject: str, handler: Callable[[Msg], Awaitable[None]]) -> None:
        await self.nc.subscribe(subject, cb=handler)

    async def publish(self, subject: str, message: Message) -> None:
        await bus.publish(self.nc, subject, message)

    async def forward(self, request: DecodeRequest, feed_ids: list[int]) -> str | None:
        _, finish_reason = await self.engine.step(request.sequence, feed_ids)
        return finish_reason

    async def forward_timed(self, request: DecodeRequest, feed_ids: list[int],
                            unfeed: int = 0) -> tuple[str | None, float]:
        (_, finish_reason), submitted_ns, started_ns = await self.engine.submit_timed(
            request.request_id, feed_ids, sample=True, unfeed=unfeed)
        return finish_reason, (started_ns - submitted_ns) / 1e9

    async def step(self, request: DecodeRequest, feed_ids: list[int]) -> str | None:
        finish_reason = await self.forward(request, feed_ids)
        await self.publish_token(request, finish_reason)
        return finish_reason

    def extend(self, request: DecodeRequest, feed_ids: list[int]) -> asyncio.Future:
        return self.engine.submit(request.request_id, feed_ids, sample=False)

    async def export(self, request: DecodeRequest, start: int, end: int) -> torch.Tensor:
        return await self.engine.export(request.request_id, start, end)

    def expect(self, request: DecodeRequest, in_s: float) -> None:
        self.engine.expect(request.request_id, in_s)

    def mark(self, request: DecodeRequest, what: str, **fields: object) -> None:
        self.engine.mark(request.request_id, what, **fields)

    async def publish_token(self, request: DecodeRequest, finish_reason: str | None) -> None:
        seq = request.sequence
        self.metrics.output_tokens.inc()
        logprobs = None if seq.last_logprob is None else [seq.last_logprob]
        await bus.publish(self.nc, request.events_subject, TokenChunk(
            request.request_id, len(seq.output_ids) - 1, [seq.output_ids[-1]], self.name, finish_reason, logprobs))
