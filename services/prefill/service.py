"""Prefill (P) service shell: takes PrefillRequests over NATS and streams KV to the decoders.

Each request's KV goes to every target (RLD and MD) in parallel, chunk by chunk as P computes.
"""
from __future__ import annotations

import asyncio
import logging
import time

import torch

from nats.aio.msg import Msg
from opentelemetry import trace

from shared import bus, messages, subjects, tracing
from shared.config import PrefillConfig, read_secret
from shared.batch_engine import BatchEngine
from shared.errors import PddError
from shared.kv_transfer import KVSender, OutgoingTransfer, TransferResult, TransferState
from shared.kv_wire import DTYPE_NAMES
from shared.metrics import PrefillMetrics, serve as serve_metrics
from shared.messages import Abort, Heartbeat, PrefillAccepted, PrefillDone, PrefillRequest, RequestFailed
from shared.model_runner import ModelRunner
from shared.models import kv_layout, load_model, resolve_model
from shared.radix_cache import PrefixHandle, RadixCache
from shared.service_runtime import heartbeat_loop, now
from services.prefill.prefiller import Prefiller, chunk_ranges, slice_for_target

log = logging.getLogger(__name__)
ROLE = "prefill"


class PrefillService:
    def __init__(self, config: PrefillConfig) -> None:
        self.config = config
        self.instance_id = config.common.instance_id
        path = resolve_model(config.model.model)
        self.layout = kv_layout(path)
        self.runner = ModelRunner(load_model(path, config.model.dtype, config.model.device))
        self.engine = BatchEngine(self.runner, config.engine, ROLE)  # chunks of many prompts share forwards
        self.prefiller = Prefiller(self.engine, config.chunk_tokens)
        self.sender = KVSender(self.layout, DTYPE_NAMES[config.kv_wire_dtype], config.kv_connect_timeout_s,
                               config.kv_connections, config.kv_stall_timeout_s, read_secret(config.kv_secret_file))
        self.tracer = tracing.tracer("pdd.prefill")
        self.cache = RadixCache(config.cache.tokens, config.cache.kv_bytes) if config.cache.enabled else None
        self.running: dict[str, asyncio.Task] = {}
        self.transfers: dict[str, list[OutgoingTransfer]] = {}
        self.prompt_kv_tokens: dict[str, int] = {}
        self.aborted_transfers = 0
        wire = DTYPE_NAMES[config.kv_wire_dtype]
        self.kv_bytes_per_token = self.layout.num_layers * 2 * self.layout.kv_heads * self.layout.head_dim * wire.itemsize
        self.kv_bytes_saved_by_abort = 0  # KV that never crossed because the request ended first
        self._tasks: set[asyncio.Task] = set()
        self.metrics = PrefillMetrics()
        self.metrics.track_load(lambda: len(self.running), lambda: self.engine.queued)
        self.spans: dict[str, trace.Span] = {}  # request id -> its prefill span, for an abort to mark
        self._transfer_spans: dict[int, tuple[trace.Span, float]] = {}  # id(transfer) -> (span, started)

    async def start(self) -> None:
        self.metrics_server = serve_metrics(self.metrics.registry, self.config.common.metrics_host,
                                            self.config.common.metrics_port)
        self.nc = await bus.connect(self.config.common.nats_url, self.instance_id, self.config.common.nats_auth)
        await self.nc.subscribe(subjects.prefill(self.instance_id), cb=self._on_prefill)
        await self.nc.subscribe(subjects.abort(), cb=self._on_abort)
        self._tasks.add(asyncio.create_task(
            heartbeat_loop(self.nc, ROLE, self.config.common.heartbeat_s, self._describe)))

    async def stop(self) -> None:
        await self.nc.drain()
        for task in [*self._tasks, *self.running.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self.running.values(), return_exceptions=True)
        await self.sender.close()
        self.engine.shutdown()
        if self.metrics_server is not None:
            self.metrics_server.close()

    def _describe(self) -> Heartbeat:
        stats = {"open_transfers": sum(len(t) for t in self.transfers.values()),
                 "kv_connections": self.sender.open_connections,
                 "aborted_transfers": self.aborted_transfers, "kv_bytes_saved_by_abort": self.kv_bytes_saved_by_abort,
                 "kv_bytes_per_token": self.kv_bytes_per_token,
                 **(self.cache.gauges() if self.cache is not None else {})}
        return Heartbeat(ROLE, self.instance_id, "", 0, self.layout.model_id, len(self.running), 0, now(),
                         dict(self.sender.throughput.bytes_per_s), stats)

    async def _on_prefill(self, msg: Msg) -> None:
        try:
            req = messages.decode_as(msg.data, PrefillRequest)
            if req.request_id in self.running:
                raise PddError(f"{req.request_id} is already running here")
        except PddError as exc:
            await bus.reply_error(msg, exc)
            return
        ctx = tracing.extract(msg.headers)
        handle = self.cache.lock(req.prompt_ids[:-1]) if self.cache is not None else None
        self.metrics.prompt_tokens.inc(len(req.prompt_ids) - 1)
        self.metrics.cache_hit_tokens.inc(handle.length if handle else 0)
        self.running[req.request_id] = asyncio.create_task(self._run(req, handle, ctx), name=f"prefill-{req.request_id}")
        await msg.respond(messages.encode(PrefillAccepted(req.request_id, self.instance_id,
                                                          handle.length if handle else 0)))

    @staticmethod
    async def _send(chunk: tuple[tuple[int, int], torch.Tensor], transfers: list[OutgoingTransfer]) -> None:
        """Queue the part of a chunk each decoder lacks (past its target's token_start)."""
        for transfer in transfers:
            part = slice_for_target(chunk[1], chunk[0], transfer.target.token_start)
            if part is not None:
                await transfer.put(*part)

    async def _on_abort(self, msg: Msg) -> None:
        try:
            abort = messages.decode_as(msg.data, Abort)
        except PddError:
            return
        task = self.running.get(abort.request_id)
        if task is not None:
            self.metrics.aborts.labels(abort.reason).inc()
            if abort.request_id in self.spans:
                tracing.mark_aborted(self.spans[abort.request_id], abort.reason)
            prompt_kv_tokens = self.prompt_kv_tokens.get(abort.request_id, 0)
            for transfer in self.transfers.get(abort.request_id, ()):
                if not transfer.ended:
                    self.aborted_transfers += 1
                    expected = (prompt_kv_tokens - transfer.target.token_start) * self.kv_bytes_per_token
                    self.kv_bytes_saved_by_abort += max(0, expected - transfer.kv_bytes)
                transfer.abort(abort.reason)
            task.cancel()

    async def _run(self, req: PrefillRequest, handle: PrefixHandle | None, ctx) -> None:
        events = subjects.request_events(req.request_id)
        transfers = [OutgoingTransfer(self.sender, target, req.request_id, self.config.kv_queue_chunks, req.deadline_s)
                     for target in req.targets]
        self.transfers[req.request_id] = transfers
        self.prompt_kv_tokens[req.request_id] = len(req.prompt_ids) - 1
        kv_ids = req.prompt_ids[:-1]
        hit = handle.length if handle else 0
        try:
            with self.tracer.start_as_current_span("prefill", context=ctx) as span:
                span.set_attributes({"pdd.request_id": req.request_id, "pdd.prompt_tokens": len(req.prompt_ids),
                                     "pdd.cached_tokens": hit, "pdd.targets": [t.role for t in req.targets]})
                self.spans[req.request_id] = span
                for transfer in transfers:
                    self._start_transfer_span(transfer)
                t0 = time.monotonic()
                chunks: list[tuple[tuple[int, int], torch.Tensor]] = []
                if hit:
                    chunks.append(((0, hit), self.cache.gather(handle)))
                    handle.release()  # the gathered copy is ours; the tree may evict now
                    await self.prefiller.open(req.request_id, len(kv_ids), chunks[0][1])
                    await self._send(chunks[0], transfers)
                else:
                    await self.prefiller.open(req.request_id, len(kv_ids))
                for chunk in chunk_ranges(len(kv_ids), self.config.chunk_tokens, start=hit):
                    with self.tracer.start_as_current_span("prefill.chunk") as chunk_span:
                        chunk_span.set_attributes({"pdd.token_start": chunk[0], "pdd.token_end": chunk[1]})
                        kv, submitted_ns, started_ns = await self.prefiller.compute_chunk(
                            req.request_id, kv_ids, chunk)
                        chunk_span.set_attribute("pdd.queue_s", (started_ns - submitted_ns) / 1e9)
                    if chunk[0] == hit:  # the first chunk's wait for the engine is the request's queueing
                        tracing.record_span(self.tracer, "prefill.queue", submitted_ns, started_ns,
                                            {"pdd.engine_queued": self.engine.queued})
                    chunks.append((chunk, kv))
                    await self._send(chunks[-1], transfers)
                prefill_s = time.monotonic() - t0
                self.metrics.prefill_time.observe(prefill_s)
                self.metrics.computed_tokens.inc(len(kv_ids) - hit)
                self.prefiller.release(req.request_id)
                if self.cache is not None and len(chunks) > (1 if hit else 0):
                    full_kv = await self.engine.run(_concat_tokens, [kv for _, kv in chunks])
                    self.cache.insert(kv_ids, full_kv)
                results = await asyncio.gather(*(self._finish_transfer(t, len(kv_ids)) for t in transfers))
                for result in results:
                    span.add_event("kv_transfer", {"pdd.role": result.target.role, "pdd.kv_bytes": result.kv_bytes,
                                                   "pdd.send_s": result.send_s, "pdd.state": result.state.value})
            await bus.publish(self.nc, events, PrefillDone(
                req.request_id, self.instance_id, len(kv_ids) - hit, prefill_s,
                {r.target.role: r.kv_bytes for r in results}, {r.target.role: r.send_s for r in results}))
            for result in results:
                if result.state is not TransferState.DONE:
                    await bus.publish(self.nc, events, RequestFailed(
                        req.request_id, ROLE, "kv_transfer_failed", result.error or "KV transfer failed",
                        path=result.target.role))
        except asyncio.CancelledError:
            for transfer in transfers:
                transfer.abort("cancelled")
            raise
        except Exception as exc:
            log.exception("prefill of %s failed", req.request_id)
            for transfer in transfers:
                transfer.abort("prefill failed")
            code = exc.code if isinstance(exc, PddError) else "prefill_failed"
            await bus.publish(self.nc, events, RequestFailed(req.request_id, ROLE, code, str(exc)))
        finally:
            self.prefiller.release(req.request_id)  # idempotent: frees the prompt's KV once on every path
            if handle is not None:
                handle.release()
            for transfer in transfers:  # those that ended early: aborted, or the prefill failed
                self._end_transfer_span(transfer, transfer.state, transfer.error)
            self.spans.pop(req.request_id, None)
            self.running.pop(req.request_id, None)
            self.transfers.pop(req.request_id, None)
            self.prompt_kv_tokens.pop(req.request_id, None)

    def _start_transfer_span(self, transfer: OutgoingTransfer) -> None:
        """One span per KV path, child of the prefill span: P's view of the local or WAN transfer."""
        target = transfer.target
        span = self.tracer.start_span("prefill.kv_transfer", attributes={
            "pdd.request_id": transfer.request_id, "pdd.target_role": target.role,
            "pdd.peer": f"{target.host}:{target.port}", "pdd.token_start": target.token_start,
            "pdd.delay_s": target.delay_s, "pdd.connections": self.sender.connections_per_peer})
        self._transfer_spans[id(transfer)] = (span, time.monotonic())

    async def _finish_transfer(self, transfer: OutgoingTransfer, token_end: int) -> TransferResult:
        result = await transfer.finish(token_end)
        self._end_transfer_span(transfer, result.state, result.error)
        return result

    def _end_transfer_span(self, transfer: OutgoingTransfer, state: TransferState, error: str | None) -> None:
        """Idempotent: the first call ends the span and counts the transfer."""
        entry = self._transfer_spans.pop(id(transfer), None)
        if entry is None:
            return
        span, started = entry
        send_s = time.monotonic() - started
        role = transfer.target.role
        outcome = state.value if state in (TransferState.DONE, TransferState.FAILED, TransferState.ABORTED) \
            else "aborted"  # never ended: the prefill itself was cancelled or failed
        self.metrics.kv_bytes.labels(role).inc(transfer.kv_bytes)
        self.metrics.kv_transfer_time.labels(role).observe(send_s)
        self.metrics.kv_transfers.labels(role, outcome).inc()
        span.set_attributes({"pdd.kv_bytes": transfer.kv_bytes, "pdd.send_s": send_s, "pdd.outcome": outcome,
                             "pdd.throughput_bytes_per_s": transfer.kv_bytes / send_s if send_s > 0 else 0.0})
        if outcome == "failed":
            span.set_status(trace.Status(trace.StatusCode.ERROR, error or "KV transfer failed"))
        elif outcome == "aborted":
            tracing.mark_aborted(span, error or "aborted")
        span.end()


def _concat_tokens(kvs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(kvs, dim=3)
