"""Prefill (P) service shell: takes PrefillRequests over NATS and streams KV to the decoders.

Each request is a `PrefillJob` (job.py: its lifecycle); its KV goes to every target (RLD and MD) in
parallel, chunk by chunk as P computes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from contextlib import aclosing

import torch
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from opentelemetry import trace

from services.prefill.job import Phase, PrefillJob
from services.prefill.prefiller import ComputedChunk, Prefiller
from shared import bus, messages, subjects, tracing
from shared.batch_engine import BatchEngine
from shared.cache_worker import CacheWorker
from shared.config import PrefillConfig, read_secret
from shared.errors import PddError
from shared.kv_sender import KVSender, OutgoingTransfer, TransferResult
from shared.kv_transfer_state import TransferState
from shared.kv_wire import DTYPE_NAMES
from shared.messages import (
    Abort,
    CacheEvents,
    Heartbeat,
    PrefillAccepted,
    PrefillDone,
    PrefillRequest,
    PromptLogprobs,
    ReleaseKV,
    RequestFailed,
)
from shared.metrics import PrefillMetrics
from shared.metrics import serve as serve_metrics
from shared.models import kv_layout, resolve_model
from shared.names import AbortReason, Role
from shared.radix_cache import INDEX_BLOCK_TOKENS, CacheEvent, RadixCache
from shared.service_runtime import ServiceFailure, heartbeat_loop, now
from shared.sim_runner import build_runner

log = logging.getLogger(__name__)
ROLE = Role.PREFILL
ENDED_PATHS_KEPT = 4096  # the gateway's Abort follows a job's end within a request's last tokens


class PrefillService:
    def __init__(self, config: PrefillConfig) -> None:
        self.config = config
        self.instance_id = config.common.instance_id
        path = resolve_model(config.model.model)
        self.layout = kv_layout(path)
        self.runner = build_runner(config.model, path, row_invariant=False)
        self.engine = BatchEngine(self.runner, config.engine, ROLE)  # chunks of many prompts share forwards
        self.failure = ServiceFailure()  # run_service stops P, exit status 1, if the engine thread dies
        self.engine.on_death = lambda exc: self.failure.fail(f"the engine thread died: {exc!r}")
        self.prefiller = Prefiller(self.engine, config.chunk_tokens)
        wire = DTYPE_NAMES[config.kv_wire_dtype]
        self.sender = KVSender(self.layout, wire, config.kv_connect_timeout_s, config.kv_connections,
                               config.kv_stall_timeout_s, read_secret(config.kv_secret_file))
        self.tracer = tracing.tracer("pdd.prefill")
        self._cache_events: list[CacheEvent] = []  # appended and drained on the cache's worker only
        self.cache = (CacheWorker(RadixCache(config.cache.tokens, config.cache.kv_bytes, self._cache_events.append,
                                             event_block_tokens=INDEX_BLOCK_TOKENS), "prefix-cache")
                      if config.cache.enabled else None)  # every tree operation on its own thread, off the loop
        self.jobs: dict[str, PrefillJob] = {}
        self.aborted_transfers = 0
        self.kv_bytes_per_token = (self.layout.num_layers * 2 * self.layout.kv_heads * self.layout.head_dim
                                   * wire.itemsize)
        self.kv_bytes_saved_by_abort = 0  # KV that never crossed because the request ended first
        self.relay_finished_wan_bytes = 0  # sent toward MD for requests RLD finished alone
        self.relay_finished_kv_bytes = 0  # the KV MD lacked of those requests
        self.backfill_wan_bytes = 0  # sent to MD in the background after RLD finished (`_backfill`)
        self.backfills_started = 0
        self.backfills = {"done": 0, "failed": 0, "aborted": 0}  # by how they ended
        # the MD path of jobs that ended, (bytes sent, KV owed), until the gateway's Abort says who finished
        self._ended_main_paths: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self.metrics = PrefillMetrics()
        self.metrics.track_load(lambda: len(self.jobs), lambda: self.engine.queued)

    async def start(self) -> None:
        self.loop_lag = self.metrics.loop_lag_monitor().start()
        self.metrics_server = serve_metrics(self.metrics.registry, self.config.common.metrics_host,
                                            self.config.common.metrics_port)
        self.nc = await bus.connect(self.config.common.nats_url, self.instance_id, self.config.common.nats_auth)
        await self.nc.subscribe(subjects.prefill(self.instance_id), cb=self._on_prefill)
        await self.nc.subscribe(subjects.abort(self.instance_id), cb=self._on_abort)
        await self.nc.subscribe(subjects.release_kv(self.instance_id), cb=self._on_release)
        self._tasks.add(asyncio.create_task(
            heartbeat_loop(self.nc, ROLE, self.config.common.heartbeat_s, self._describe,
                           self.failure)))

    async def stop(self) -> None:
        self.loop_lag.stop()
        await self.nc.drain()
        job_tasks = [job.task for job in self.jobs.values() if job.task is not None]
        for task in [*self._tasks, *job_tasks]:
            task.cancel()
        await asyncio.gather(*self._tasks, *job_tasks, return_exceptions=True)
        await self.sender.close()  # after the jobs: their ABORT frames go out first
        self.engine.shutdown()
        if self.metrics_server is not None:
            self.metrics_server.close()

    def _describe(self) -> Heartbeat:
        stats = {"open_transfers": sum(len(job.transfers) for job in self.jobs.values()),
                 "kv_connections": self.sender.open_connections,
                 "aborted_transfers": self.aborted_transfers, "kv_bytes_saved_by_abort": self.kv_bytes_saved_by_abort,
                 "relay_finished_wan_bytes": self.relay_finished_wan_bytes,
                 "relay_finished_kv_bytes": self.relay_finished_kv_bytes,
                 "backfill_wan_bytes": self.backfill_wan_bytes,
                 "backfills_started": self.backfills_started,
                 **{f"backfills_{outcome}": n for outcome, n in self.backfills.items()},
                 **(self.cache.gauges() if self.cache is not None else {}), **self.runner.stats()}
        return Heartbeat(ROLE, self.instance_id, "", 0, self.layout.model_id, len(self.jobs), 0, now(),
                         dict(self.sender.throughput.bytes_per_s), stats,
                         chunk_tokens=self.config.chunk_tokens, kv_bytes_per_token=self.kv_bytes_per_token)

    @property
    def _prefix_cache(self) -> CacheWorker:
        """P's prefix cache, on the paths only a P with one takes (a hit, a warm-up, keeping computed KV)."""
        assert self.cache is not None
        return self.cache

    async def _on_prefill(self, msg: Msg) -> None:
        try:
            req = messages.decode_as(msg.data, PrefillRequest)
            if req.request_id in self.jobs:
                raise PddError(f"{req.request_id} is already running here")
        except PddError as exc:
            await bus.reply_error(msg, exc)
            return
        if not req.targets and req.prompt_logprobs is None:  # a warm-up: nobody waits for an answer
            if self.cache is not None:
                await self._start_warm(req)
            return
        # the prompt's logprobs need the logits of every position: a cache hit would skip them
        cache = self.cache if req.prompt_logprobs is None else None
        prefix = await cache.call(cache.tree.lock, req.prompt_ids[:-1]) if cache is not None else None
        job = PrefillJob(req, prefix, tracing.extract(msg.headers))
        self.metrics.prompt_tokens.inc(job.prompt_kv_tokens)
        self.metrics.cache_hit_tokens.inc(job.cached_tokens)
        self.jobs[req.request_id] = job
        job.task = asyncio.create_task(self._run(job), name=f"prefill-{req.request_id}")
        await msg.respond(messages.encode(PrefillAccepted(req.request_id, self.instance_id, job.cached_tokens)))

    async def _start_warm(self, req: PrefillRequest) -> None:
        cache = self._prefix_cache
        prefix = await cache.call(cache.tree.lock, req.prompt_ids[:-1])
        job = PrefillJob(req, prefix)
        self.jobs[req.request_id] = job
        job.task = asyncio.create_task(self._warm(job), name=f"warm-{req.request_id}")

    async def _warm(self, job: PrefillJob) -> None:
        """Extend P's prefix cache with what it lacks of a running answer (no KV path, no report), so
        the session's next turn finds it here as it finds it in MD's DRC."""
        req = job.request
        kv_ids = req.prompt_ids[:-1]
        hit = job.cached_tokens
        try:
            job.move(Phase.COMPUTING)
            cache = self._prefix_cache
            prefix_kv = await cache.call(cache.tree.pieces, job.prefix) if hit else []
            await self.prefiller.open(req.request_id, len(kv_ids), prefix_kv, background=True)
            async with aclosing(self.prefiller.chunks(req.request_id, req.prompt_ids, hit)) as chunks:
                computed = [chunk.kv async for chunk in chunks]
            job.move(Phase.SENDING)
            self.prefiller.release(req.request_id)
            if computed:
                await self._keep_computed(job, computed)
                self.metrics.warmed_tokens.inc(len(kv_ids) - hit)
            job.move(Phase.DONE)
        except asyncio.CancelledError:
            if not job.ended:
                job.move(Phase.ABORTED)
            raise
        except PddError as exc:  # the next turn computes what is missing
            log.warning("%s: warm-up failed: %s", req.request_id, exc)
            job.move(Phase.FAILED)
        finally:
            self.prefiller.release(req.request_id)
            assert job.prefix is not None  # _start_warm locked it
            self._prefix_cache.post(job.prefix.release)
            self.jobs.pop(req.request_id, None)

    async def _on_abort(self, msg: Msg) -> None:
        try:
            abort = messages.decode_as(msg.data, Abort)
        except PddError:
            return
        if abort.reason == AbortReason.FINISHED_ON_RELAY:
            self._count_relay_finished(abort.request_id)
        job = self.jobs.get(abort.request_id)
        if job is None or job.ended or job.task is None:
            return
        if abort.reason == AbortReason.FINISHED and job.phase is Phase.SENDING and not job.open_transfers():
            # every path has its KV; what is left is the copy into P's prefix cache, which a short
            # answer can finish before: the session's next turn needs it, so it is not cut short
            return
        if abort.reason == AbortReason.FINISHED_ON_RELAY and abort.backfill_bytes_per_s > 0 and self._backfill(
                job, abort.backfill_bytes_per_s):
            return
        self.metrics.aborts.labels(abort.reason).inc()
        if job.span is not None:
            tracing.mark_aborted(job.span, abort.reason)
        for transfer in job.open_transfers():
            unsent = job.unsent_kv_bytes(transfer, self.kv_bytes_per_token)
            if unsent:  # one whose bytes were all written (its decoder finishing) is not cut short
                self.aborted_transfers += 1
                self.kv_bytes_saved_by_abort += unsent
            transfer.abort(abort.reason)
        job.task.cancel()

    def _backfill(self, job: PrefillJob, bytes_per_s: float) -> bool:
        """RLD finished the job's request before MD had its KV: send MD the rest anyway, in the
        background, for its DRC (the job ends when it is sent). False: no MD path left to send."""
        main = [t for t in job.open_transfers() if t.target.role == Role.MAIN]
        if not main:
            return False
        for transfer in job.open_transfers():
            if transfer.target.role != Role.MAIN:
                transfer.abort(AbortReason.FINISHED_ON_RELAY)
        if main[0].held:
            self.metrics.kv_held_paths.labels("backfilled").inc()
        main[0].background(bytes_per_s)
        self.backfills_started += 1
        log.info("%s: RLD finished first; MD's KV follows in the background at %.1f MB/s",
                 job.request_id, bytes_per_s / 1e6)
        return True

    def _count_backfill(self, transfer: OutgoingTransfer) -> None:
        outcome = {TransferState.DONE: "done", TransferState.FAILED: "failed"}.get(transfer.state, "aborted")
        self.backfills[outcome] += 1
        self.backfill_wan_bytes += transfer.background_bytes
        self.metrics.backfills.labels(outcome).inc()
        self.metrics.backfill_bytes.inc(transfer.background_bytes)

    async def _on_release(self, msg: Msg) -> None:
        try:
            release = messages.decode_as(msg.data, ReleaseKV)
        except PddError:
            return
        job = self.jobs.get(release.request_id)
        if job is None:
            return
        for transfer in job.open_transfers():
            if transfer.held:
                log.info("%s: %s path released: %s", release.request_id, transfer.target.role, release.reason)
                self.metrics.kv_held_paths.labels("released").inc()
                transfer.release()

    def _main_path(self, job: PrefillJob) -> tuple[int, int] | None:
        """What the job's MD path sent so far and the KV it owed MD; None without one."""
        for transfer in job.transfers:
            if transfer.target.role == Role.MAIN:
                owed = (job.prompt_kv_tokens - transfer.target.token_start) * self.kv_bytes_per_token
                return transfer.kv_bytes, max(0, owed)
        return None

    def _count_relay_finished(self, request_id: str) -> None:
        """RLD made every token of the request: count the WAN bytes its MD path paid for nothing."""
        job = self.jobs.get(request_id)
        path = self._main_path(job) if job is not None else self._ended_main_paths.pop(request_id, None)
        if path is not None:
            sent, owed = path
            self.relay_finished_wan_bytes += sent
            self.relay_finished_kv_bytes += owed
            self.metrics.relay_finished_wan_bytes.inc(sent)
            self.metrics.relay_finished_kv_bytes.inc(owed)

    def _remember_main_path(self, job: PrefillJob) -> None:
        path = self._main_path(job)
        if path is None:
            return
        self._ended_main_paths[job.request_id] = path
        while len(self._ended_main_paths) > ENDED_PATHS_KEPT:
            self._ended_main_paths.popitem(last=False)

    async def _run(self, job: PrefillJob) -> None:
        """The job's task: compute the prompt's KV while every path sends it, then report."""
        req = job.request
        job.transfers = [OutgoingTransfer(self.sender, target, req.request_id, self.config.kv_queue_chunks,
                                          req.deadline_s) for target in req.targets]
        try:
            with self.tracer.start_as_current_span("prefill", context=job.trace_context) as span:
                span.set_attributes({"pdd.request_id": req.request_id, "pdd.prompt_tokens": len(req.prompt_ids),
                                     "pdd.cached_tokens": job.cached_tokens,
                                     "pdd.targets": [t.role for t in req.targets]})
                job.span = span
                for transfer in job.transfers:
                    self._start_transfer_span(job, transfer)
                prefill_s, computed = await self._compute(job)
                results = await self._send(job, computed, span)
            await self._report(job, prefill_s, results)
        except asyncio.CancelledError:
            for transfer in job.transfers:
                transfer.abort("cancelled")
            if not job.ended:  # an Abort, or P shutting down
                job.move(Phase.ABORTED)
            raise
        except Exception as exc:
            log.exception("prefill of %s failed", req.request_id)
            await self._report_failure(job, exc)
        finally:
            await self._end(job)

    async def _compute(self, job: PrefillJob) -> tuple[float, list[torch.Tensor]]:
        """Queue the cached prefix on every path, then each chunk as P's engine computes it; returns
        the compute's seconds and the computed chunks' KV (for P's prefix cache)."""
        req = job.request
        t0 = time.monotonic()
        job.move(Phase.COMPUTING)
        await self._open_prompt(job)
        computed: list[torch.Tensor] = []
        async with aclosing(self.prefiller.chunks(req.request_id, req.prompt_ids, job.cached_tokens,
                                                  req.prompt_logprobs)) as chunks:
            async for chunk in chunks:
                await self._take_chunk(job, chunk)
                computed.append(chunk.kv)
        prefill_s = time.monotonic() - t0
        self.metrics.prefill_time.observe(prefill_s)
        self.metrics.computed_tokens.inc(job.prompt_kv_tokens - job.cached_tokens)
        return prefill_s, computed

    async def _open_prompt(self, job: PrefillJob) -> None:
        """Give the prompt room in P's engine, after the cached prefix (queued on every path first)."""
        req = job.request
        if not job.cached_tokens:
            await self.prefiller.open(req.request_id, job.prompt_kv_tokens)
            return
        # the prefix stays locked until the computed rest is kept after it (_end releases it)
        # views of the cache's pieces: the engine's copy and the sends read them directly
        cache = self._prefix_cache
        prefix_kv = await cache.call(cache.tree.pieces, job.prefix)
        await self.prefiller.open(req.request_id, job.prompt_kv_tokens, prefix_kv)
        start = 0
        for piece in prefix_kv:
            await job.queue_kv((start, start + piece.shape[3]), piece)
            start += piece.shape[3]

    async def _take_chunk(self, job: PrefillJob, chunk: ComputedChunk) -> None:
        """One computed chunk: its spans, its prompt logprobs to the gateway, its KV on every path."""
        start, end = chunk.span
        tracing.record_span(self.tracer, "prefill.chunk", chunk.ready_ns, time.time_ns(), {
            "pdd.token_start": start, "pdd.token_end": end,
            "pdd.queue_s": (chunk.started_ns - chunk.ready_ns) / 1e9})
        if start == job.cached_tokens:  # the first chunk's wait for the engine is the request's queueing
            tracing.record_span(self.tracer, "prefill.queue", chunk.ready_ns, chunk.started_ns,
                                {"pdd.engine_queued": self.engine.queued})
        if chunk.logprobs is not None:
            await bus.publish(self.nc, subjects.request_events(job.request_id),
                              PromptLogprobs(job.request_id, start + 1, chunk.logprobs))
        await job.queue_kv(chunk.span, chunk.kv)

    async def _send(self, job: PrefillJob, computed: list[torch.Tensor], span: trace.Span) -> list[TransferResult]:
        """Every chunk is computed: keep it in P's prefix cache while each path writes what it queued.
        The two run side by side: a transfer ends (its span, `send_s`, P's link-rate sample) when its
        last byte is out, not after the copy into the cache (seconds for a long prompt's KV)."""
        job.move(Phase.SENDING)
        self.prefiller.release(job.request_id)
        finishing = asyncio.gather(*(self._finish_transfer(job, t) for t in job.transfers))
        if self.cache is not None and computed:
            await asyncio.gather(finishing, self._keep_computed(job, computed))
        results = await finishing
        for result in results:
            span.add_event("kv_transfer", {"pdd.role": result.target.role, "pdd.kv_bytes": result.kv_bytes,
                                           "pdd.send_s": result.send_s, "pdd.state": result.state.value})
        return results

    async def _report(self, job: PrefillJob, prefill_s: float, results: list[TransferResult]) -> None:
        """PrefillDone, then a RequestFailed naming each path that did not deliver."""
        req = job.request
        events = subjects.request_events(req.request_id)
        failed = [result for result in results if result.state is not TransferState.DONE]
        job.move(Phase.FAILED if failed else Phase.DONE)
        await bus.publish(self.nc, events, PrefillDone(
            req.request_id, self.instance_id, job.prompt_kv_tokens - job.cached_tokens, prefill_s,
            {r.target.role: r.kv_bytes for r in results}, {r.target.role: r.send_s for r in results}))
        for result in failed:
            await bus.publish(self.nc, events, RequestFailed(
                req.request_id, ROLE, result.code, result.error or "KV transfer failed", path=result.target.role))

    async def _report_failure(self, job: PrefillJob, exc: Exception) -> None:
        """The prefill itself failed: stop every path and tell the gateway, unless only the report failed."""
        for transfer in job.transfers:
            transfer.abort("prefill failed")
        if job.ended:  # only publishing the outcome failed
            return
        job.move(Phase.FAILED)
        code, message = self.failure.reported(exc.code if isinstance(exc, PddError) else "prefill_failed", str(exc))
        await bus.publish(self.nc, subjects.request_events(job.request_id),
                          RequestFailed(job.request_id, ROLE, code, message))

    async def _end(self, job: PrefillJob) -> None:
        """On every path out of the job: free its KV, unlock its prefix, count its paths, drop it."""
        self.prefiller.release(job.request_id)  # idempotent: frees the prompt's KV once on every path
        if job.prefix is not None and self.cache is not None:
            self.cache.post(job.prefix.release)  # after any gather of it still on the worker
        for transfer in job.transfers:  # those that ended early: aborted, or the prefill failed
            self._end_transfer_span(job, transfer, transfer.state, transfer.error)
            if transfer.held:
                self.metrics.kv_held_paths.labels("never_sent").inc()
            if transfer.background_bytes_per_s:
                self._count_backfill(transfer)
        self._remember_main_path(job)
        self.jobs.pop(job.request_id, None)
        await asyncio.gather(*(transfer.wait_closed() for transfer in job.transfers))  # pumps end with the job

    async def _keep_computed(self, job: PrefillJob, computed: list[torch.Tensor]) -> None:
        """The job's computed chunks, joined on the engine thread, into P's prefix cache."""
        await self._keep(job.request.prompt_ids[:-1], await self.engine.run(_concat_tokens, computed),
                         job.cached_tokens)

    async def _keep(self, token_ids: list[int], kv: torch.Tensor, kv_start: int) -> None:
        """Into P's prefix cache: `kv` is the KV of token_ids[kv_start:], after a prefix the caller
        holds locked. The cache's changes go to the gateway's index, which predicts P's compute from
        P's own hit."""
        events = await self._prefix_cache.call(self._insert, token_ids, kv, kv_start)
        if not events:
            return
        try:
            await bus.publish(self.nc, subjects.cache_events(self.instance_id), CacheEvents(self.instance_id, events))
        except (PddError, NatsError) as exc:  # too big, or NATS closing: the index catches up from the next batch
            log.warning("cache events not published: %s", exc)

    def _insert(self, token_ids: list[int], kv: torch.Tensor, kv_start: int) -> list[dict]:
        """On the cache's worker: insert, then the events it caused, drained."""
        self._prefix_cache.tree.insert(token_ids, kv, kv_start)
        events = [event.to_dict() for event in self._cache_events]
        self._cache_events.clear()
        return events

    def _start_transfer_span(self, job: PrefillJob, transfer: OutgoingTransfer) -> None:
        """One span per KV path, child of the prefill span: P's view of the local or WAN transfer."""
        target = transfer.target
        span = self.tracer.start_span("prefill.kv_transfer", attributes={
            "pdd.request_id": transfer.request_id, "pdd.target_role": target.role,
            "pdd.peer": f"{target.host}:{target.port}", "pdd.token_start": target.token_start,
            "pdd.delay_s": target.delay_s, "pdd.connections": self.sender.connections_per_peer})
        job.transfer_spans[transfer] = (span, time.monotonic())

    async def _finish_transfer(self, job: PrefillJob, transfer: OutgoingTransfer) -> TransferResult:
        result = await transfer.finish()
        self._end_transfer_span(job, transfer, result.state, result.error)
        return result

    def _end_transfer_span(self, job: PrefillJob, transfer: OutgoingTransfer, state: TransferState,
                           error: str | None) -> None:
        """Idempotent: the first call ends the span and counts the transfer."""
        entry = job.transfer_spans.pop(transfer, None)
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
        if transfer.background_bytes_per_s:  # RLD finished first: the rest went in the background, for MD's DRC
            span.set_attributes({"pdd.backfill_bytes_per_s": transfer.background_bytes_per_s,
                                 "pdd.backfill_bytes": transfer.background_bytes})
        if outcome == "failed":
            span.set_status(trace.Status(trace.StatusCode.ERROR, error or "KV transfer failed"))
        elif outcome == "aborted":
            tracing.mark_aborted(span, error or "aborted")
        span.end()


def _concat_tokens(kvs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(kvs, dim=3)
