"""Relay Decode (RLD) service: decodes eagerly next to P, then hands the request to MD.

RLD keeps no long-lived cache: a request's KV lives here only until the cut or the end.
"""
from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from shared import bus, messages, subjects
from services.decoder.service import DecodeRequest, DecoderService
from shared.errors import DeadlineExceeded, PddError, RequestAborted
from shared.messages import Handoff, KVReady, MainLost, RequestFailed
from shared.model_runner import DecodeSequence
from services.relay.handoff import HandoffMode, HandoffPlan, Step, choose_mode

log = logging.getLogger(__name__)


class RelayService(DecoderService):
    role = "relay"
    finished_without_main = 0  # requests RLD finished alone because MD was lost (P-RLD, counted)

    async def subscribe_role(self) -> None:
        await self.nc.subscribe(subjects.kv_ready(self.instance_id), cb=self._on_kv_ready)
        await self.nc.subscribe(subjects.main_lost(self.instance_id), cb=self._on_main_lost)

    def role_stats(self) -> dict[str, float]:
        return {"finished_without_main": self.finished_without_main}

    async def _on_main_lost(self, msg: Msg) -> None:
        try:
            lost = messages.decode_as(msg.data, MainLost)
        except PddError:
            return
        request = self.requests.get(lost.request_id)
        if request is None:
            # RLD let the request go (it made its final handoff); MD, now lost, had it alone.
            # Say so, or the gateway would wait for tokens nobody makes until the deadline.
            await bus.publish(self.nc, subjects.request_events(lost.request_id), RequestFailed(
                lost.request_id, self.role, RequestAborted.code, "RLD no longer holds the request: it had handed off"))
            return
        if not request.main_lost:
            log.warning("%s: MD lost (%s); RLD finishes the request", lost.request_id, lost.reason)
            request.main_lost = True
            self.finished_without_main += 1
            request.main_progress.set()  # wake a wait for MD

    async def _on_kv_ready(self, msg: Msg) -> None:
        try:
            ready = messages.decode_as(msg.data, KVReady)
        except PddError:
            return
        request = self.requests.get(ready.request_id)
        if request is not None:
            request.main_progress.set()

    def _plan(self, request: DecodeRequest) -> HandoffPlan:
        policy = self.config.handoff
        mode = (HandoffMode(request.assign.handoff_mode) if request.assign.handoff_mode
                else choose_mode(policy.mode, len(self.requests), policy.catch_up_max_running))
        return HandoffPlan(mode, policy.catch_up_threshold, request.assign.handoff_at)

    async def decode(self, request: DecodeRequest, seq: DecodeSequence) -> None:
        assign = request.assign
        plan = self._plan(request)
        feed = [assign.prompt_ids[-1]]
        with self.tracer.start_as_current_span("relay.eager_decode") as span:
            span.set_attribute("pdd.handoff_mode", plan.mode.value)
            t0 = time.monotonic()
            while True:
                if request.main_lost:
                    finish_reason = await self.step(request, seq, feed)
                    feed = [seq.output_ids[-1]]
                    if finish_reason is not None:
                        span.set_attribute("pdd.finished_without_main", True)
                        break
                    continue
                if request.main_progress.is_set():
                    request.main_progress.clear()
                    plan.on_main_progress()
                decision = plan.next(len(seq.output_ids))
                if decision.step is Step.WAIT_FOR_MAIN:
                    await self._wait_for_main(request)
                    continue
                if decision.step in (Step.SEND_CHUNK, Step.CUT):
                    await self._hand_off(request, seq, decision, plan)
                    if decision.step is Step.CUT:
                        break
                    continue
                finish_reason = await self.step(request, seq, feed)
                feed = [seq.output_ids[-1]]
                if finish_reason is not None:
                    # RLD finished first: MD drops the request and its WAN transfer (anomalous traffic)
                    span.set_attribute("pdd.finished_on_relay", True)
                    if assign.main_instance:
                        await bus.publish(self.nc, subjects.handoff(assign.main_instance),
                                          Handoff(request.request_id, [], finished=True, mode=plan.mode.value))
                    break
            span.set_attributes({"pdd.eager_tokens": len(seq.output_ids), "pdd.eager_s": time.monotonic() - t0,
                                 "pdd.handoff_rounds": plan.rounds, "pdd.catch_up_fell_back": plan.fell_back})
            self.metrics.eager_tokens.observe(len(seq.output_ids))

    async def _hand_off(self, request: DecodeRequest, seq: DecodeSequence, decision, plan: HandoffPlan) -> None:
        final = decision.step is Step.CUT
        with self.tracer.start_as_current_span("relay.handoff_chunk") as span:
            span.set_attributes({"pdd.start": decision.start, "pdd.end": decision.end, "pdd.final": final})
            if final:
                self.metrics.handoffs.labels("one-shot" if plan.fell_back else plan.mode.value).inc()
            await bus.publish(self.nc, subjects.handoff(request.assign.main_instance), Handoff(
                request.request_id, seq.output_ids[decision.start:decision.end], finished=False,
                start=decision.start, final=final, mode="one-shot" if plan.fell_back else plan.mode.value))

    async def _wait_for_main(self, request: DecodeRequest) -> None:
        remaining = request.assign.deadline_s - (time.monotonic() - request.assigned_at)
        try:
            async with asyncio.timeout(max(0.0, remaining)):
                await request.main_progress.wait()
        except TimeoutError as exc:
            raise DeadlineExceeded(f"MD never reported its KV for {request.request_id}") from exc
