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
from shared.decoder_service import DecodeRequest, DecoderService
from shared.errors import DeadlineExceeded, PddError
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
        if request is not None and not request.handoff.done():
            request.handoff.set_result(handoff)

    async def decode(self, request: DecodeRequest, seq: DecodeSequence) -> None:
        assign = request.assign
        feed = [assign.prompt_ids[-1]]
        stats: HandoffStats | None = None
        if assign.pipeline == "p-rld-md":
            stats_or_none = await self._take_over(request, seq)
            if stats_or_none is None:
                return
            stats = stats_or_none
            feed += seq.output_ids
        with self.tracer.start_as_current_span("main.decode") as span:
            first = len(seq.output_ids)
            t0 = time.monotonic()
            finish_reason = await self.forward(seq, feed)
            if stats is not None:
                # the first step after a handoff is the extend-decode pass over the eager tokens;
                # its stats go out before its token, so the gateway can mark the cut
                stats = dataclasses.replace(stats, extend_s=time.monotonic() - t0)
                await bus.publish(self.nc, request.events_subject, stats)
            await self.publish_token(request, seq, finish_reason)
            while finish_reason is None:
                finish_reason = await self.step(request, seq, [seq.output_ids[-1]])
            span.set_attribute("pdd.tokens", len(seq.output_ids) - first)

    async def _take_over(self, request: DecodeRequest, seq: DecodeSequence) -> HandoffStats | None:
        """Tell RLD the KV is here and adopt its eager IDs; None if RLD already finished."""
        assign = request.assign
        kv_wait_s = time.monotonic() - request.assigned_at
        t0 = time.monotonic()
        with self.tracer.start_as_current_span("main.handoff") as span:
            await bus.publish(self.nc, subjects.kv_ready(assign.relay_instance),
                              KVReady(request.request_id, self.instance_id, time.time()))
            remaining = assign.deadline_s - (time.monotonic() - request.assigned_at)
            try:
                async with asyncio.timeout(max(0.0, remaining)):
                    handoff: Handoff = await request.handoff
            except TimeoutError as exc:
                raise DeadlineExceeded(f"RLD never handed off {request.request_id}") from exc
            span.set_attributes({"pdd.eager_tokens": len(handoff.eager_ids), "pdd.relay_finished": handoff.finished})
        if handoff.finished:
            return None
        seq.output_ids.extend(handoff.eager_ids)
        return HandoffStats(request.request_id, len(handoff.eager_ids), kv_wait_s, time.monotonic() - t0, 0.0)
