"""Relay Decode (RLD) service: decodes eagerly next to P, then hands the request to MD.

RLD keeps no long-lived cache: a request's KV lives here only until the handoff or the end.
"""
from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from shared import bus, messages, subjects
from shared.decoder_service import DecodeRequest, DecoderService
from shared.errors import DeadlineExceeded, PddError
from shared.messages import Handoff, KVReady
from shared.model_runner import DecodeSequence
from services.relay.handoff import RelayAction, next_action

log = logging.getLogger(__name__)


class RelayService(DecoderService):
    role = "relay"

    async def subscribe_role(self) -> None:
        await self.nc.subscribe(subjects.kv_ready(self.instance_id), cb=self._on_kv_ready)

    async def _on_kv_ready(self, msg: Msg) -> None:
        try:
            ready = messages.decode_as(msg.data, KVReady)
        except PddError:
            return
        request = self.requests.get(ready.request_id)
        if request is not None:
            request.kv_ready.set()

    async def decode(self, request: DecodeRequest, seq: DecodeSequence) -> None:
        assign = request.assign
        feed = [assign.prompt_ids[-1]]
        with self.tracer.start_as_current_span("relay.eager_decode") as span:
            t0 = time.monotonic()
            while True:
                action = next_action(len(seq.output_ids), request.kv_ready.is_set(), assign.handoff_at)
                if action is RelayAction.HAND_OFF:
                    break
                if action is RelayAction.WAIT_FOR_MAIN:
                    await self._wait_for_main(request)
                    continue
                finish_reason = await self.step(request, seq, feed)
                feed = [seq.output_ids[-1]]
                if finish_reason is not None:
                    # RLD finished before MD had the KV: MD drops the request (anomalous traffic)
                    span.set_attributes({"pdd.eager_tokens": len(seq.output_ids), "pdd.finished_on_relay": True})
                    await bus.publish(self.nc, subjects.handoff(assign.main_instance),
                                      Handoff(request.request_id, [], finished=True))
                    return
            span.set_attributes({"pdd.eager_tokens": len(seq.output_ids), "pdd.eager_s": time.monotonic() - t0})
        with self.tracer.start_as_current_span("relay.handoff") as span:
            span.set_attribute("pdd.eager_tokens", len(seq.output_ids))
            await bus.publish(self.nc, subjects.handoff(assign.main_instance),
                              Handoff(request.request_id, list(seq.output_ids), finished=False))

    async def _wait_for_main(self, request: DecodeRequest) -> None:
        remaining = request.assign.deadline_s - (time.monotonic() - request.assigned_at)
        try:
            async with asyncio.timeout(max(0.0, remaining)):
                await request.kv_ready.wait()
        except TimeoutError as exc:
            raise DeadlineExceeded(f"MD never reported its KV for {request.request_id}") from exc
