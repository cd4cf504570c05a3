"""Relay Decode (RLD)'s role in the decoder shell: decode eagerly next to P, then hand the request to MD.

RLD keeps what it computed of a request (the prompt, its eager tokens) in its own prefix cache
once it has cut over or finished (services/decoder/decode_cache.py), so the session's next turn
crosses P's local link as what RLD lacks, not as the whole context. When to hand off is
services/relay/handoff.py's to decide; this module moves the messages.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import cast

from nats.aio.msg import Msg

from services.decoder.decode_cache import CachingRole
from services.decoder.request import DecodeRequest, Phase
from services.decoder.role import DecoderIO
from services.relay.handoff import Decision, HandoffPlan, Step, choose_mode
from shared import messages, subjects
from shared.config import CacheConfig, HandoffConfig
from shared.errors import PddError, RequestAborted
from shared.messages import Abort, CutComing, Handoff, KVReady, MainLost, RequestFailed
from shared.metrics import RelayMetrics
from shared.names import HandoffMode, Role

log = logging.getLogger(__name__)


class RelayRole(CachingRole):
    role = Role.RELAY

    def __init__(self, policy: HandoffConfig, cache: CacheConfig = CacheConfig(tokens=0)) -> None:
        super().__init__(cache)
        self.policy = policy
        self.finished_without_main = 0  # requests RLD finished alone because MD was lost (P-RLD, counted)
        self._stepping: dict[str, _RunningStep] = {}  # request id -> its step in flight, to announce a cut
        self.cuts_announced = 0  # CutComing sent to MD

    async def subscribe(self, io: DecoderIO) -> None:
        async def on_kv_ready(msg: Msg) -> None:
            await self._on_kv_ready(io, msg)

        async def on_main_lost(msg: Msg) -> None:
            await self._on_main_lost(io, msg)

        await io.subscribe(subjects.kv_ready(io.instance_id), on_kv_ready)
        await io.subscribe(subjects.main_lost(io.instance_id), on_main_lost)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "finished_without_main": self.finished_without_main,
                "cuts_announced": self.cuts_announced}

    async def settle(self, request: DecodeRequest, io: DecoderIO) -> None:
        """Cut over or finished: keep the KV computed here for the session's next turn."""
        await self.keep(request, io)

    def can_backfill(self) -> bool:
        return False

    def keeps_after_abort(self, request: DecodeRequest, abort: Abort) -> bool:
        return False

    async def _on_main_lost(self, io: DecoderIO, msg: Msg) -> None:
        try:
            lost = messages.decode_as(msg.data, MainLost)
        except PddError:
            return
        request = io.find(lost.request_id)
        if request is None or request.cut_sent:
            # RLD handed off (it may still hold the request while it keeps its KV); MD, now lost, had
            # it alone. Say so, or the gateway would wait for tokens nobody makes until the deadline.
            await io.publish(subjects.request_events(lost.request_id), RequestFailed(
                lost.request_id, self.role, RequestAborted.code, "RLD had handed the request off to MD"))
            return
        log.warning("%s: MD lost (%s); RLD finishes the request", lost.request_id, lost.reason)
        self.finished_without_main += 1
        request.peer_messages.put_nowait(lost)

    async def _on_kv_ready(self, io: DecoderIO, msg: Msg) -> None:
        try:
            ready = messages.decode_as(msg.data, KVReady)
        except PddError:
            return
        request = io.find(ready.request_id)
        if request is None:  # MD's KV was all cached there: it may report before RLD registered the request
            io.keep_early(ready.request_id, lambda: self._on_kv_ready(io, msg))
            return
        request.peer_messages.put_nowait(ready)
        running = self._stepping.get(ready.request_id)
        if running is not None:
            await self._announce_cut(request, io, running, ready.adopted_tokens)

    async def _announce_cut(self, request: DecodeRequest, io: DecoderIO, running: _RunningStep,
                            adopted_tokens: int | None = None) -> None:
        """If the step in flight makes the cut's last token, tell MD when the cut will come, so its
        engine can hold a step for it instead of starting one the cut must then wait out."""
        if (running.announced or not running.step_s
                or not running.plan.would_cut(len(request.sequence.output_ids) + 1, adopted_tokens)):
            return
        running.announced = True
        self.cuts_announced += 1
        in_s = max(0.0, running.started + running.step_s - time.monotonic())
        io.mark(request, "cut_announced", in_s=in_s)
        await io.publish(subjects.handoff(request.assign.main_instance), CutComing(request.request_id, in_s))

    def _plan(self, request: DecodeRequest, running: int) -> HandoffPlan:
        mode = (HandoffMode(request.assign.handoff_mode) if request.assign.handoff_mode
                else choose_mode(self.policy.mode, running, self.policy.catch_up_max_running))
        return HandoffPlan(mode, self.policy.catch_up_threshold, request.assign.handoff_at)

    async def decode(self, request: DecodeRequest, io: DecoderIO) -> Phase:
        assign, seq = request.assign, request.sequence
        plan = self._plan(request, io.running)
        feed = [assign.prompt_ids[-1]]
        step_s = 0.0  # this request's recent step time, once it has made its first token
        with io.tracer.start_as_current_span("relay.eager_decode") as span:
            span.set_attribute("pdd.handoff_mode", plan.mode.value)
            t0 = time.monotonic()
            while True:
                while not request.peer_messages.empty():
                    _note(plan, request.peer_messages.get_nowait())
                decision = plan.next(len(seq.output_ids))
                if decision.step is Step.WAIT_FOR_MAIN:
                    _note(plan, await request.next_peer_message(f"MD never reported its KV for {request.request_id}"))
                    continue
                if decision.step in (Step.SEND_CHUNK, Step.CUT):
                    await self._hand_off(request, io, decision, plan)
                    if decision.step is Step.CUT:
                        outcome = Phase.HANDED_OFF
                        break
                    continue
                running = self._stepping[request.request_id] = _RunningStep(plan, time.monotonic(), step_s)
                if plan.main_ready:  # a pinned cut (handoff_at) may end with this step
                    await self._announce_cut(request, io, running)
                try:
                    finish_reason = await io.step(request, feed)
                finally:
                    del self._stepping[request.request_id]
                took = time.monotonic() - running.started
                step_s = took if not step_s else 0.7 * step_s + 0.3 * took
                feed = [seq.output_ids[-1]]
                if finish_reason is not None:
                    outcome = Phase.FINISHED
                    if plan.main_lost:
                        span.set_attribute("pdd.finished_without_main", True)
                        break
                    # RLD finished first: MD drops the request and its WAN transfer (anomalous traffic)
                    span.set_attribute("pdd.finished_on_relay", True)
                    if assign.main_instance:
                        await io.publish(subjects.handoff(assign.main_instance),
                                         Handoff(request.request_id, [], finished=True, mode=plan.mode))
                    break
            span.set_attributes({"pdd.eager_tokens": len(seq.output_ids), "pdd.eager_s": time.monotonic() - t0,
                                 "pdd.handoff_rounds": plan.rounds})
            cast(RelayMetrics, io.metrics).eager_tokens.observe(len(seq.output_ids))  # decoder_metrics(RLD)
        return outcome

    async def _hand_off(self, request: DecodeRequest, io: DecoderIO, decision: Decision, plan: HandoffPlan) -> None:
        final = decision.step is Step.CUT
        with io.tracer.start_as_current_span("relay.handoff_chunk") as span:
            span.set_attributes({"pdd.start": decision.start, "pdd.end": decision.end, "pdd.final": final})
            if final:
                request.cut_sent = True  # before the publish yields: a MainLost from now on finds it
                io.metrics.handoffs.labels(plan.mode.value).inc()
                io.mark(request, "cut_sent", eager_tokens=decision.end)
            await io.publish(subjects.handoff(request.assign.main_instance), Handoff(
                request.request_id, request.sequence.output_ids[decision.start:decision.end], finished=False,
                start=decision.start, final=final, mode=plan.mode))


@dataclass
class _RunningStep:
    """A request's step in flight on RLD: when it began and how long its steps take."""

    plan: HandoffPlan
    started: float  # time.monotonic()
    step_s: float  # 0 until a first step was timed (the first one, after the prompt, is no guide)
    announced: bool = False  # CutComing sent for this step


def _note(plan: HandoffPlan, message: object) -> None:
    """What a peer's message means for the handoff: MD made progress, or MD is gone."""
    if isinstance(message, MainLost):
        plan.on_main_lost()
    elif isinstance(message, KVReady):
        plan.on_main_progress(message.adopted_tokens)
