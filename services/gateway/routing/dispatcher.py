"""Dispatches a request: picks its instances and pipeline, assigns the decoders, starts P; and
hosts the request's run while it is in flight.

The decoders are assigned first (so they expect the KV), then P is started. What happens after
that, the merge of tokens and recovery from lost tiers, is the RequestRun's
(services/gateway/run/request_run.py), which reaches the gateway through the RunHost this class
is: it comes back here for each migration, with the instances it must avoid. Each attempt in
flight has one entry in `active`, made by dispatch and dropped by stop; every event is decoded
here once, observed for the policy (its state kept on the attempt) and delivered to the run.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.gateway.routing.answer_warming import warm_due
from services.gateway.routing.cache_index import CacheIndex
from services.gateway.routing.cost_model import CostModel
from services.gateway.routing.policy import (
    NO_RELAY_S,
    Estimate,
    PipelineDecision,
    PolicyConfig,
    RelayWatch,
    choose_pipeline,
    path_round_trip_s,
)
from services.gateway.routing.registry import Instance, InstanceRegistry, NoLiveInstance
from services.gateway.run.attempt import Attempt, GenerationRequest
from services.gateway.run.outcome import CloseReason, LossKind
from services.gateway.run.recovery import Action
from services.gateway.run.request_run import RequestRun, new_request_id
from shared import bus, messages, subjects, tracing
from shared.config import GatewayConfig
from shared.errors import BadRequest, DeadlineExceeded, InvalidParam, PddError, PeerGone
from shared.messages import (
    Abort,
    DecodeAccepted,
    DecodeAssign,
    HandoffStats,
    Heartbeat,
    KVReceived,
    KVTarget,
    Message,
    PrefillAccepted,
    PrefillDone,
    PrefillRequest,
    ReleaseKV,
    TokenChunk,
)
from shared.metrics import GatewayMetrics
from shared.names import AUTO, AbortReason, Pipeline, Role

log = logging.getLogger(__name__)
Accepted = TypeVar("Accepted", PrefillAccepted, DecodeAccepted)

ASSIGN_TIMEOUT_S = 5.0
BUSY_ANSWERED_S = 1.0  # an instance that answered a ping this recently is alive, however slow its reply
NO_MAIN_REASON = "no main decode reachable: RLD serves alone"


class Dispatcher:
    def __init__(self, nc: NATS, registry: InstanceRegistry, config: GatewayConfig, cache_index: CacheIndex,
                 metrics: GatewayMetrics | None = None) -> None:
        self.nc = nc
        self.metrics = metrics or GatewayMetrics()
        self.registry = registry
        self.config = config
        self.cache_index = cache_index
        self.costs = CostModel()
        self.policy = PolicyConfig(config.ttft_slo_s * config.relay_min_gain_fraction, config.wan_mbps_guess * 1e6 / 8,
                                   config.prefill_tokens_per_s_guess)
        self.tracer = tracing.tracer("pdd.gateway")
        # the attempts in flight, by attempt id, with the run their events go to (see listen, abort_orphans)
        self.active: dict[str, tuple[Attempt, RequestRun]] = {}

    async def listen(self) -> None:
        """Hear every request's events through one subscription, made before any request is dispatched.

        A subscription per request, made just before its DecodeAssign, loses a race across the NATS
        gateway link: its interest reaches datacenter B on another connection than the assign, and
        an MD that decodes at once (its DRC holds the whole prompt) publishes before B knows that
        anyone listens, so NATS drops its tokens without a word (issue 16)."""
        await self.nc.subscribe(subjects.request_events_all(), cb=self._on_request_event)
        await self.nc.flush()

    async def _on_request_event(self, msg: Msg) -> None:
        request_id = subjects.request_id_of_events(msg.subject)
        entry = self.active.get(request_id)
        if entry is None:  # a late event of an attempt let go, or another gateway's request
            return
        attempt, run = entry
        try:
            event = messages.decode(msg.data)
        except PddError as exc:
            log.warning("%s: dropped a malformed event: %s", request_id, exc)
            return
        await self._observe(attempt, event)
        run.deliver(event)

    async def _observe(self, attempt: Attempt, event: Message) -> None:
        """What the policy learns from an event as it arrives: each tier's decode step, the KV link,
        P's prefill time; and whether to release MD's held KV."""
        if isinstance(event, TokenChunk):
            now = time.monotonic()
            self.costs.observe_tokens(event.tier, len(event.token_ids), attempt.chunk_gap_s(event.tier, now))
            if event.tier == Role.MAIN:
                attempt.main_started = True
            elif attempt.relay_watch is not None:
                await self._watch_relay(attempt, attempt.relay_watch, event.start + len(event.token_ids), now)
        elif isinstance(event, HandoffStats):
            attempt.main_started = True
        elif isinstance(event, PrefillDone):
            self.costs.observe_prefill(event.computed_tokens, event.prefill_s)
        elif isinstance(event, KVReceived) and event.link_bytes_per_s and event.tier == Role.MAIN:
            instances = attempt.instances
            if Role.PREFILL in instances and Role.MAIN in instances:
                self.costs.observe_link(instances[Role.PREFILL], instances[Role.MAIN], event.link_bytes_per_s)

    async def _warm_prefill(self, attempt: Attempt, answer: list[int]) -> None:
        """Ask P to cache the prompt and the answer so far (a PrefillRequest with no KV path, published:
        nobody waits for it)."""
        prefill = attempt.instances.get(Role.PREFILL)
        if prefill is None:
            return
        warm = PrefillRequest(f"{attempt.request_id}.warm{len(answer)}", [*attempt.request.prompt_ids, *answer], [],
                              self.config.request_timeout_s)
        try:
            await bus.publish(self.nc, subjects.prefill(prefill), warm)
        except PddError as exc:  # the next turn computes what is missing
            log.warning("%s: warm-up not sent: %s", attempt.request_id, exc)

    async def _watch_relay(self, attempt: Attempt, watch: RelayWatch, relay_tokens: int, now: float) -> None:
        """P holds MD's KV back: release it once RLD no longer looks like finishing first."""
        if not watch.should_release(relay_tokens, now):
            return
        attempt.relay_watch = None
        request_id = attempt.request_id
        self.metrics.main_kv_releases.inc()
        log.info("%s: RLD will not finish first (%d of %d tokens): P sends MD's KV", request_id, relay_tokens,
                 watch.max_tokens)
        try:
            await bus.publish(self.nc, subjects.release_kv(attempt.instances[Role.PREFILL]),
                              ReleaseKV(request_id, "relay too slow"))
        except PddError as exc:  # MD keeps waiting; RLD finishes the request
            log.warning("%s: release not sent: %s", request_id, exc)

    async def start(self, req: GenerationRequest) -> RequestRun:
        """Dispatch a new request: the one place its RequestRun is made; it comes back here for each
        migration, and is let go with its last attempt (stop)."""
        run = RequestRun(req, self.config, self)
        await run.start()
        return run

    # --- the RunHost a run talks through ----------------------------------------------------------

    def is_alive(self, instance_id: str) -> bool:
        return self.registry.is_alive(instance_id)

    def instance_gone(self, instance_id: str) -> None:
        self.registry.mark_gone(instance_id)

    async def publish(self, subject: str, message: Message) -> None:
        await bus.publish(self.nc, subject, message)

    def count_loss(self, tier: Role, how: LossKind) -> None:
        self.metrics.tier_losses.labels(tier, how).inc()

    def count_recovery(self, action: Action) -> None:
        self.metrics.recoveries.labels(action).inc()

    async def answer_grew(self, attempt: Attempt, token_ids: list[int]) -> None:
        """Ask P to cache the answer so far, a whole step of it at a time (routing/answer_warming.py)."""
        due = warm_due(self.config.warm_prefill_tokens, attempt.warmed_tokens, len(token_ids) - attempt.output_offset)
        if due:
            attempt.warmed_tokens = due
            await self._warm_prefill(attempt, token_ids[attempt.output_offset:attempt.output_offset + due])

    async def dispatch(self, run: RequestRun, req: GenerationRequest, output_offset: int,
                       avoid: set[str]) -> Attempt:
        """One attempt, preferring instances not in `avoid` (those the request failed on). An
        instance that fails to accept is avoided and the dispatch tried once more: one that
        nobody answers for, or that answers no ping either, is also skipped by other requests for
        a while; one that still answers pings is busy, and may be tried again. A role with no live
        instance at all (one restarting, a NATS reconnect) is waited for, once, up to
        `instance_wait_s`."""
        avoid = set(avoid)
        tries, waited = 0, False
        while True:
            try:
                return await self._dispatch_once(run, req, output_offset, avoid)
            except NoLiveInstance as exc:
                if waited or not await self._wait_for_instance(req, exc.role):
                    raise
                waited = True
            except (PeerGone, DeadlineExceeded) as exc:
                failed = getattr(exc, "instance_id", None)
                tries += 1
                if failed is None or tries == 2:
                    raise
                busy = isinstance(exc, DeadlineExceeded) and self.registry.answered_within(failed, BUSY_ANSWERED_S)
                log.warning("%s: %s did not accept (%s); trying %s", req.request_id, failed, exc,
                            "again, another instance first: it answers pings, so it is busy" if busy
                            else "another instance")
                if not busy:
                    self.registry.suspect(failed)
                avoid.add(failed)
                # the first try's instances that accepted let it go asynchronously (an Abort): under
                # its id the retry could find one still holding it ("already assigned here")
                req = dataclasses.replace(req, request_id=new_request_id())

    async def _wait_for_instance(self, req: GenerationRequest, role: Role) -> bool:
        wait_s = self.config.instance_wait_s
        if wait_s <= 0:
            return False
        log.warning("%s: no live %s instance; waiting up to %.1f s for one", req.request_id, role, wait_s)
        started = time.monotonic()
        alive = await self.registry.wait_alive(role, wait_s)
        self.metrics.instance_waits.labels(str(role), "found" if alive else "none").inc()
        log.log(logging.INFO if alive else logging.WARNING, "%s: %s %s after %.2f s", req.request_id,
                "found a live" if alive else "still no live", role, time.monotonic() - started)
        return alive

    def _choose_main(self, prompt_ids: list[int], avoid: set[str]) -> tuple[Instance, int] | None:
        """Cache-aware: the MD holding the longest prefix of the prompt, weighed against its load;
        None when no MD is reachable."""
        try:
            return self._pick_cached(Role.MAIN, prompt_ids, avoid)
        except PeerGone:
            return None

    def _pick_cached(self, role: Role, prompt_ids: list[int], avoid: set[str]) -> tuple[Instance, int]:
        """The instance of `role` whose cache holds the longest prefix of the prompt's KV, weighed
        against its load, and that prefix's length."""
        hits: dict[str, int] = {}

        def score(instance: Instance) -> float:
            hit = self.cache_index.hit_tokens(instance.heartbeat.instance_id, prompt_ids[:-1])
            hits[instance.heartbeat.instance_id] = hit
            return hit - self.config.route_load_penalty_tokens * instance.load

        chosen = self.registry.pick(role, score, avoid)
        return chosen, hits.get(chosen.heartbeat.instance_id, 0)

    def _queue_s(self, instance: Instance, tier: Role) -> float:
        """A decoder's wait before a new request's first token: what waits in its engine for room,
        then one step (running requests share a batched step; they do not queue)."""
        step = self.costs.step_s(tier) or self.config.decode_step_s_guess
        return (instance.heartbeat.waiting + 1) * step

    def _decide(self, req: GenerationRequest, prefill: Instance, prefill_hit: int, main: Instance, main_hit: int,
                relay: Instance | None) -> tuple[PipelineDecision, RelayWatch | None]:
        """The pipeline, and the watch on RLD when P is to hold MD's KV back."""
        md = main.heartbeat
        prefill_model = self.costs.prefill
        round_trips = self.costs.round_trip_s
        prefill_ping = round_trips.get(prefill.heartbeat.instance_id, 0.0)
        estimate = Estimate(
            link_bytes_per_s=self._link_bytes_per_s(prefill.heartbeat, md),
            prefill_tokens_per_s=prefill_model.tokens_per_s if prefill_model else None,
            main_queue_s=self._queue_s(main, Role.MAIN),
            relay_queue_s=self._queue_s(relay, Role.RELAY) if relay is not None else NO_RELAY_S,
            prefill_fixed_s=prefill_model.fixed_s if prefill_model else 0.0,
            round_trip_s=path_round_trip_s(prefill_ping, round_trips.get(md.instance_id, 0.0)),
            relay_round_trip_s=(path_round_trip_s(prefill_ping, round_trips.get(relay.heartbeat.instance_id, 0.0))
                                if relay is not None else 0.0),
            relay_step_s=self.costs.step_s(Role.RELAY) or self.config.decode_step_s_guess,
            prefill_chunk_tokens=int(prefill.heartbeat.stats.get("chunk_tokens", 0)) or Estimate.prefill_chunk_tokens)
        kv_bytes_per_token = int(prefill.heartbeat.stats.get("kv_bytes_per_token", 0))
        decision = choose_pipeline(self.policy, len(req.prompt_ids), req.sampling.max_tokens, main_hit,
                                   kv_bytes_per_token, estimate, prefill_hit)
        default = None if self.config.default_pipeline == AUTO else Pipeline(self.config.default_pipeline)
        forced = req.pipeline or default
        if forced is not None and forced != decision.pipeline:
            decision = dataclasses.replace(decision, pipeline=forced, reason="named by the request or gateway flag",
                                           hold_main_kv=False)
        if decision.hold_main_kv and (req.pipeline is not None or req.handoff_at is not None):
            # a request that names its pipeline or its cut asks for MD to take over: RLD would wait for
            # MD at the cut, and a held stream would reach MD only if RLD turned out slow
            decision = dataclasses.replace(decision, hold_main_kv=False)
        if not decision.hold_main_kv:
            return decision, None
        return decision, RelayWatch.of(decision, self.policy, estimate, req.sampling.max_tokens)

    def _link_bytes_per_s(self, prefill: Heartbeat, main: Heartbeat) -> float | None:
        """P to MD: the rate MD saw KV arrive at; before any, the rate P saw its writes complete at
        (which buffers along the way inflate)."""
        return (self.costs.link_bytes_per_s.get((prefill.instance_id, main.instance_id))
                or prefill.link_bytes_per_s.get(f"{main.kv_host}:{main.kv_port}"))

    def _plan(self, req: GenerationRequest,
              avoid: set[str]) -> tuple[PipelineDecision, RelayWatch | None, dict[Role, Instance]]:
        """The pipeline and an instance per role in it. With no MD reachable (all dead, or the WAN
        cut), RLD serves alone (P-RLD), counted as its own decision, rather than nobody."""
        prefill, prefill_hit = self._pick_cached(Role.PREFILL, req.prompt_ids, avoid)
        chosen = self._choose_main(req.prompt_ids, avoid)
        if chosen is None:
            decision = PipelineDecision(Pipeline.P_RLD, NO_MAIN_REASON, 0, 0, 0.0, 0.0, 0.0, prefill_hit)
            return decision, None, {Role.PREFILL: prefill,
                                    Role.RELAY: self._pick_or_release(Role.RELAY, avoid, [prefill])}
        main, main_hit = chosen
        try:  # RLD's start is half of the prediction; none reachable: P-MD, or whatever the request names
            relay: Instance | None = self._pick_cached(Role.RELAY, req.prompt_ids, avoid)[0]  # RLD caches too
        except PeerGone:
            relay = None
        decision, watch = self._decide(req, prefill, prefill_hit, main, main_hit, relay)
        instances = {Role.PREFILL: prefill, Role.MAIN: main}
        if decision.pipeline.uses_relay:
            instances[Role.RELAY] = relay or self._pick_or_release(Role.RELAY, avoid, [prefill, main])
        elif relay is not None:
            self.registry.done(relay.heartbeat.instance_id)
        if not decision.pipeline.uses_main:
            self.registry.done(instances.pop(Role.MAIN).heartbeat.instance_id)
        return decision, watch, instances

    def _pick_or_release(self, role: Role, avoid: set[str], picked: list[Instance]) -> Instance:
        try:
            return self.registry.pick(role, avoid=avoid)
        except PeerGone:
            for instance in picked:
                self.registry.done(instance.heartbeat.instance_id)
            raise

    async def _dispatch_once(self, run: RequestRun, req: GenerationRequest, output_offset: int,
                             avoid: set[str]) -> Attempt:
        if req.prefill_only:
            return await self._dispatch_prefill_only(run, req, avoid)
        policy_started_ns = time.time_ns()
        decision, watch, chosen = self._plan(req, avoid)
        try:
            req = fit_kv_budget(req, [chosen[role] for role in (Role.MAIN, Role.RELAY) if role in chosen])
        except BadRequest:
            for instance in chosen.values():
                self.registry.done(instance.heartbeat.instance_id)
            raise
        pipeline = decision.pipeline
        self._record_policy(req, chosen, decision, policy_started_ns)
        instances = {role: instance.heartbeat.instance_id for role, instance in chosen.items()}
        attempt = Attempt(req, output_offset, pipeline, decision, instances, relay_watch=watch)
        self.active[req.request_id] = (attempt, run)
        try:
            with self.tracer.start_as_current_span("gateway.dispatch") as span:
                span.set_attributes({
                    "pdd.request_id": req.request_id, "pdd.pipeline": pipeline, "pdd.policy_reason": decision.reason,
                    "pdd.prompt_tokens": len(req.prompt_ids), "pdd.output_offset": output_offset,
                    **_predictions(decision),
                    **{f"pdd.instance.{role}": iid for role, iid in attempt.instances.items()}})
                headers = tracing.inject()
                assign = DecodeAssign(
                    req.request_id, pipeline, req.prompt_ids, req.sampling, attempt.instances.get(Role.RELAY),
                    attempt.instances.get(Role.MAIN, ""), self.config.request_timeout_s, req.handoff_at,
                    handoff_mode=req.handoff_mode, owner=self.config.common.instance_id, output_offset=output_offset,
                    backfill=self.config.backfill_link_share > 0)
                decoders = [(role, chosen[role]) for role in (Role.MAIN, Role.RELAY) if role in chosen]
                accepted = await asyncio.gather(*(self._call(role, inst, assign, DecodeAccepted, headers)
                                                  for role, inst in decoders))
                targets = [KVTarget(role, acc.kv_host, acc.kv_port, acc.cached_tokens,
                                    req.md_kv_delay_s if role is Role.MAIN else 0.0,
                                    held=role is Role.MAIN and decision.hold_main_kv)
                           for (role, _), acc in zip(decoders, accepted)]
                prefill_accepted = await self._call(Role.PREFILL, chosen[Role.PREFILL], PrefillRequest(
                    req.request_id, req.prompt_ids, targets, self.config.request_timeout_s,
                    prompt_logprobs=req.prompt_logprobs), PrefillAccepted, headers)
                attempt.cached_tokens = prefill_accepted.cached_tokens
                attempt.main_cached_tokens = accepted[0].cached_tokens if Role.MAIN in chosen else 0
                attempt.main_backfill = Role.MAIN in chosen and accepted[0].backfill
                span.set_attributes({"pdd.prefill_cached_tokens": attempt.cached_tokens,
                                     "pdd.main_cached_tokens": attempt.main_cached_tokens})
        except BaseException:
            await self.stop(attempt, CloseReason.DISPATCH_FAILED)  # whoever accepted drops it
            raise
        return attempt

    async def _dispatch_prefill_only(self, run: RequestRun, req: GenerationRequest, avoid: set[str]) -> Attempt:
        """P alone (max_tokens 0): no decoder, no KV path; P's PrefillDone ends the request. The least
        loaded P: its cache would not help, since P computes the whole prompt for its logprobs."""
        prefill = self.registry.pick(Role.PREFILL, avoid=avoid)
        attempt = Attempt(req, 0, Pipeline.P, None, {Role.PREFILL: prefill.heartbeat.instance_id})
        self.active[req.request_id] = (attempt, run)
        try:
            with self.tracer.start_as_current_span("gateway.dispatch") as span:
                span.set_attributes({"pdd.request_id": req.request_id, "pdd.pipeline": Pipeline.P,
                                     "pdd.prompt_tokens": len(req.prompt_ids),
                                     "pdd.instance.prefill": prefill.heartbeat.instance_id})
                await self._call(Role.PREFILL, prefill, PrefillRequest(
                    req.request_id, req.prompt_ids, [], self.config.request_timeout_s,
                    prompt_logprobs=req.prompt_logprobs), PrefillAccepted, tracing.inject())
        except BaseException:
            await self.stop(attempt, CloseReason.DISPATCH_FAILED)
            raise
        return attempt

    async def stop(self, attempt: Attempt, reason: CloseReason) -> None:
        """Idempotent per attempt: stop listening (the one place an entry is dropped; everything of
        the attempt goes with it), free its instances, tell every tier to drop it."""
        if self.active.get(attempt.request_id, (None,))[0] is not attempt:
            return
        del self.active[attempt.request_id]
        backfill_bytes_per_s, abort_reason = 0.0, str(reason)
        if reason is CloseReason.FINISHED and Role.MAIN in attempt.instances and not attempt.main_started:
            abort_reason = AbortReason.FINISHED_ON_RELAY  # P counts what its MD path sent for nothing
            self.metrics.finished_on_relay.inc()
            backfill_bytes_per_s = self._backfill_bytes_per_s(attempt)
        for instance_id in attempt.instances.values():
            self.registry.done(instance_id)
        try:
            await bus.publish(self.nc, subjects.abort(), Abort(attempt.request_id, abort_reason, backfill_bytes_per_s))
        except Exception as exc:  # the tiers' own deadlines still free the attempt
            log.warning("%s: abort not broadcast: %s", attempt.request_id, exc)

    def _backfill_bytes_per_s(self, attempt: Attempt) -> float:
        """The pace of MD's KV for a request RLD finished alone: a share of the link rate the
        pipeline choice assumed (0: no backfill)."""
        share = self.config.backfill_link_share
        if share <= 0 or not attempt.main_backfill:
            return 0.0
        link = (attempt.decision.link_bytes_per_s if attempt.decision is not None else 0.0) \
            or self.policy.default_link_bytes_per_s
        return share * link

    async def abort_orphans(self, heartbeat: Heartbeat) -> None:
        """Abort again what an instance still holds for this gateway but the gateway let go.

        An Abort is a NATS broadcast; one sent while the WAN link was down never reached MD, which
        would hold the request (its KV, its inbox) until its own deadline. Its heartbeats list what
        it holds, per owner, so the next one after the link heals brings the Abort again. An Abort
        is idempotent: one for a request that is ending anyway changes nothing.
        """
        orphans = [rid for rid in heartbeat.held.get(self.config.common.instance_id, ()) if rid not in self.active]
        for request_id in orphans:
            log.warning("%s still holds %s, which this gateway let go: aborting it again",
                        heartbeat.instance_id, request_id)
            await bus.publish(self.nc, subjects.abort(), Abort(request_id, "orphaned"))

    def _record_policy(self, req: GenerationRequest, chosen: dict[Role, Instance], decision: PipelineDecision,
                       started_ns: int) -> None:
        """The `gateway.policy` span (the routing and pipeline choice, with what it was based on) and
        the decision counter."""
        self.metrics.pipeline_decisions.labels(decision.pipeline, decision.reason).inc()
        prefill = chosen[Role.PREFILL].heartbeat
        main = chosen.get(Role.MAIN)
        link = self._link_bytes_per_s(prefill, main.heartbeat) if main is not None else None
        tracing.record_span(self.tracer, "gateway.policy", started_ns, time.time_ns(), {
            "pdd.request_id": req.request_id, "pdd.pipeline": decision.pipeline, "pdd.policy_reason": decision.reason,
            "pdd.pipeline_requested": req.pipeline or self.config.default_pipeline,
            "pdd.prompt_tokens": len(req.prompt_ids), "pdd.max_tokens": req.sampling.max_tokens,
            **_predictions(decision),
            "pdd.instance.prefill": prefill.instance_id,
            **({"pdd.main_load": main.load, "pdd.instance.main": main.heartbeat.instance_id} if main else {}),
            **({"pdd.link_bytes_per_s": link} if link is not None else {}),
            **{f"pdd.{tier}_step_s": step for tier in (Role.RELAY, Role.MAIN)
               if (step := self.costs.step_s(tier)) is not None},
            **({"pdd.prefill_tokens_per_s": self.costs.prefill.tokens_per_s,
                "pdd.prefill_fixed_s": self.costs.prefill.fixed_s} if self.costs.prefill else {}),
            **({"pdd.main_round_trip_s": self.costs.round_trip_s[main.heartbeat.instance_id]}
               if main is not None and main.heartbeat.instance_id in self.costs.round_trip_s else {})})

    async def _call(self, role: Role, instance: Instance, msg: PrefillRequest | DecodeAssign,
                    reply_type: type[Accepted], headers: dict[str, str]) -> Accepted:
        """P's PrefillAccepted or a decoder's DecodeAccepted (`reply_type`), naming the instance in a failure."""
        instance_id = instance.heartbeat.instance_id
        subject = subjects.prefill(instance_id) if role is Role.PREFILL else subjects.decode_assign(role, instance_id)
        try:
            return await bus.request(self.nc, subject, msg, reply_type, ASSIGN_TIMEOUT_S, headers)
        except (PeerGone, DeadlineExceeded) as exc:
            exc.instance_id = instance_id
            raise


def fit_kv_budget(req: GenerationRequest, decoders: list[Instance]) -> GenerationRequest:
    """The request as the decoders can hold it: each allocates a position per fed token (the prompt's
    and all outputs but the last), within its `--kv-budget-tokens` (0: none), and refuses a request
    that could outgrow it. The gateway's default max_tokens (the rest of the context) is lowered to
    fit; a prompt, or a max_tokens the client set, that cannot fit is the client's 400, not a
    decoder's failure to retry."""
    budgets = [int(d.heartbeat.stats.get("kv_budget_tokens", 0)) for d in decoders]
    limit = min((b for b in budgets if b > 0), default=0)
    prompt_tokens, max_tokens = len(req.prompt_ids), req.sampling.max_tokens
    if not limit or prompt_tokens + max_tokens - 1 <= limit:
        return req
    if prompt_tokens > limit:
        raise BadRequest(f"the prompt's {prompt_tokens} tokens do not fit the decoders' KV budget of {limit} "
                         "positions (--kv-budget-tokens)")
    room = limit + 1 - prompt_tokens
    if req.max_tokens_param is not None:
        raise InvalidParam(req.max_tokens_param, f"{req.max_tokens_param}={max_tokens} plus the prompt's "
                                                 f"{prompt_tokens} tokens does not fit the decoders' KV budget of "
                                                 f"{limit} positions (--kv-budget-tokens): at most {room}")
    return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, max_tokens=room))


def _predictions(decision: PipelineDecision) -> dict[str, float | int]:
    """What the pipeline choice was based on, as span attributes (both decoders' predicted starts)."""
    relay = decision.predicted_relay_ready_s
    return {"pdd.prefill_hit_predicted": decision.prefill_hit_tokens,
            "pdd.main_hit_predicted": decision.main_hit_tokens, "pdd.wan_bytes_predicted": decision.wan_bytes,
            "pdd.main_ready_predicted_s": decision.predicted_main_ready_s,
            **({"pdd.relay_ready_predicted_s": relay, "pdd.main_ready_budget_s": decision.budget_s}
               if math.isfinite(relay) else {})}
