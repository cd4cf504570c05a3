"""Main Decode (MD) service: decodes from the first token (P-MD) or takes over from RLD (P-RLD-MD).

Taking over is extend-decode: MD feeds the last prompt token and RLD's eager token IDs in one
forward pass, which rebuilds their KV, and samples the next token from its logits.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from nats.aio.msg import Msg

from shared import bus, messages, subjects
from services.decoder.service import DecodeRequest, DecoderService
from shared.errors import DeadlineExceeded, PddError, ProtocolError
from shared.kv_transfer import TransferState
from shared.messages import Handoff, HandoffStats, KVReady
from shared.model_runner import DecodeSequence

log = logging.getLogger(__name__)


class MainService(DecoderService):
    role = "main"

    async def subscribe_role(self) -> None:
        await self.nc.subscribe(subjects.handoff(self.instance_id), cb=self._on_handoff)

    async def _on_handoff(self, msg: Msg) -> None:
        try:
            handoff = messages.decode_as(msg.data, Handoff)
        except PddError:
            return
        request = self.requests.get(handoff.request_id)
        if request is None:
            return
        if handoff.finished and request.inbox.state is not TransferState.DONE and request.task is not None:
            # RLD finished before our KV arrived: drop the transfer now, not at the gateway's abort
            request.task.cancel()
            return
        request.handoffs.put_nowait(handoff)

    async def decode(self, request: DecodeRequest, seq: DecodeSequence) -> None:
        assign = request.assign
        feed = [assign.prompt_ids[-1]]
        stats: HandoffStats | None = None
        if assign.pipeline == "p-rld-md":
            taken = await self._take_over(request, seq)
            if taken is None:
                return
            feed, stats = taken
        with self.tracer.start_as_current_span("main.decode") as span:
            first = len(seq.output_ids)
            span.set_attribute("pdd.first_index", first)
            t0 = time.monotonic()
            if stats is not None:
                with self.tracer.start_as_current_span("main.extend_decode") as extend_span:
                    extend_span.set_attributes({"pdd.extend_tokens": len(feed), "pdd.handoff_mode": stats.mode})
                    finish_reason = await self.forward(seq, feed)
            else:
                finish_reason = await self.forward(seq, feed)
            if stats is not None:
                # the first step after the cut is the extend-decode pass over the last eager tokens;
                # its stats go out before its token, so the gateway can mark the cut
                stats = dataclasses.replace(stats, extend_s=time.monotonic() - t0)
                self.metrics.handoffs.labels(stats.mode).inc()
                self.metrics.handoff_extend.labels(stats.mode).observe(stats.extend_s)
                await bus.publish(self.nc, request.events_subject, stats)
            await self.publish_token(request, seq, finish_reason)
            while finish_reason is None:
                finish_reason = await self.step(request, seq, [seq.output_ids[-1]])
            span.set_attribute("pdd.tokens", len(seq.output_ids) - first)

    async def _take_over(self, request: DecodeRequest, seq: DecodeSequence) -> tuple[list[int], HandoffStats] | None:
        """Adopt RLD's eager tokens chunk by chunk until the cut.

        Returns the tokens still to feed (the cut's chunk, after the last token whose KV MD holds)
        and the handoff's stats; None if RLD finished the request itself.
        """
        assign = request.assign
        kv_wait_s = time.monotonic() - request.assigned_at
        t0 = time.monotonic()
        pending = [assign.prompt_ids[-1]]  # fed tokens lag one behind, so the cut always has logits
        chunks = 0
        with self.tracer.start_as_current_span("main.handoff") as span:
            await self._report_progress(request, 0)
            while True:
                handoff = await self._next_handoff(request)
                if handoff.finished:
                    span.set_attribute("pdd.relay_finished", True)
                    return None
                if handoff.start > len(seq.output_ids):
                    raise ProtocolError(f"handoff chunk starts at {handoff.start}, MD holds {len(seq.output_ids)}")
                # a recovery handoff from the gateway repeats what MD already adopted: skip that part
                new_ids = handoff.eager_ids[len(seq.output_ids) - handoff.start:]
                chunks += 1
                seq.output_ids.extend(new_ids)
                pending += new_ids
                if handoff.final:
                    break
                with self.tracer.start_as_current_span("main.catch_up_chunk") as chunk_span:
                    chunk_span.set_attributes({"pdd.start": handoff.start, "pdd.tokens": len(handoff.eager_ids)})
                    await self.extend(seq, pending[:-1])
                pending = pending[-1:]
                await self._report_progress(request, len(seq.output_ids))
            span.set_attributes({"pdd.eager_tokens": len(seq.output_ids), "pdd.handoff_mode": handoff.mode,
                                 "pdd.chunks": chunks})
        return pending, HandoffStats(request.request_id, len(seq.output_ids), kv_wait_s, time.monotonic() - t0,
                                     0.0, handoff.mode, chunks)

    async def _report_progress(self, request: DecodeRequest, adopted_tokens: int) -> None:
        await bus.publish(self.nc, subjects.kv_ready(request.assign.relay_instance),
                          KVReady(request.request_id, self.instance_id, time.time(), adopted_tokens))

    async def _next_handoff(self, request: DecodeRequest) -> Handoff:
        remaining = request.assign.deadline_s - (time.monotonic() - request.assigned_at)
        try:
            async with asyncio.timeout(max(0.0, remaining)):
                return await request.handoffs.get()
        except TimeoutError as exc:
            raise DeadlineExceeded(f"RLD never handed off {request.request_id}") from exc
