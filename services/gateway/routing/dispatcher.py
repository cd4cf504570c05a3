"""Dispatches a request: the instances and pipeline its Planner (routing/planner.py) picks, the
decoders assigned, P started; and hosts the request's run while it is in flight.

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
import time
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.gateway.routing.answer_warming import warm_due
from services.gateway.routing.cache_index import CacheIndex
from services.gateway.routing.cost_model import CostModel
from services.gateway.routing.planner import Planner, predictions
from services.gateway.routing.policy import (
    RelayWatch,
)
from services.gateway.routing.registry import Instance, InstanceRegistry, NoLiveInstance
from services.gateway.run.attempt import Attempt, GenerationRequest
from services.gateway.run.outcome import CloseReason, LossKind
from services.gateway.run.recovery import Action
from services.gateway.run.request_run import RequestRun
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
from shared.names import AbortReason, Pipeline, Role
from shared.request_ids import EVENT_SHARD, new_request_id

log = logging.getLogger(__name__)
Accepted = TypeVar("Accepted", PrefillAccepted, DecodeAccepted)

ASSIGN_TIMEOUT_S = 5.0
BUSY_ANSWERED_S = 1.0  # an instance that answered a ping this recently is alive, however slow its reply


class Dispatcher:
    def __init__(self, nc: NATS, registry: InstanceRegistry, config: GatewayConfig, cache_index: CacheIndex,
                 metrics: GatewayMetrics | None = None) -> None:
        self.nc = nc
        self.metrics = metrics or GatewayMetrics()
        self.registry = registry
        self.config = config
        self.cache_index = cache_index
        self.costs = CostModel()
        self.planner = Planner(registry, config, cache_index, self.costs, self.metrics)
        self.tracer = tracing.tracer("pdd.gateway")
        # the attempts in flight, by attempt id, with the run their events go to (see listen, abort_orphans)
        self.active: dict[str, tuple[Attempt, RequestRun]] = {}

    async def listen(self) -> None:
        """Hear this gateway's requests' events (those whose ids carry its EVENT_SHARD) through one
        subscription, made before any request is dispatched. Not every gateway's: with G gateways
        each would receive and drop G-1 of every G events (docs/scale.md).

        A subscription per request, made just before its DecodeAssign, loses a race across the NATS
        gateway link: its interest reaches datacenter B on another connection than the assign, and
        an MD that decodes at once (its DRC holds the whole prompt) publishes before B knows that
        anyone listens, so NATS drops its tokens without a word (issue 16)."""
        await self.nc.subscribe(subjects.request_events_of_shard(EVENT_SHARD), cb=self._on_request_event)
        await self.nc.flush()

    async def _on_request_event(self, msg: Msg) -> None:
        request_id = subjects.request_id_of_events(msg.subject)
        entry = self.active.get(request_id)
        if entry is None:  # a late event of an attempt let go
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
                       avoid: set[str], exclude: frozenset[str] = frozenset()) -> Attempt:
        """One attempt, preferring instances not in `avoid` (those the request failed on), and never on
        one in `exclude` (the one it just failed on: with no other MD, RLD serves alone). An
        instance that fails to accept is avoided and the dispatch tried once more: one that
        nobody answers for, or that answers no ping either, is also skipped by other requests for
        a while; one that still answers pings is busy, and may be tried again. A role with no live
        instance at all (one restarting, a NATS reconnect) is waited for, once, up to
        `instance_wait_s`."""
        avoid = set(avoid)
        tries, waited = 0, False
        while True:
            try:
                return await self._dispatch_once(run, req, output_offset, avoid, exclude)
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

    async def _dispatch_once(self, run: RequestRun, req: GenerationRequest, output_offset: int,
                             avoid: set[str], exclude: frozenset[str]) -> Attempt:
        if req.prefill_only:
            return await self._dispatch_prefill_only(run, req, avoid, exclude)
        policy_started_ns = time.time_ns()
        decision, watch, chosen = self.planner.plan(req, avoid, exclude)
        try:
            req = fit_kv_budget(req, [chosen[role] for role in (Role.MAIN, Role.RELAY) if role in chosen])
        except BadRequest:
            for instance in chosen.values():
                self.registry.done(instance.heartbeat.instance_id)
            raise
        pipeline = decision.pipeline
        self.planner.record_policy(req, chosen, decision, policy_started_ns)
        instances = {role: instance.heartbeat.instance_id for role, instance in chosen.items()}
        attempt = Attempt(req, output_offset, pipeline, decision, instances, relay_watch=watch)
        self.active[req.request_id] = (attempt, run)
        try:
            with self.tracer.start_as_current_span("gateway.dispatch") as span:
                span.set_attributes({
                    "pdd.request_id": req.request_id, "pdd.pipeline": pipeline, "pdd.policy_reason": decision.reason,
                    "pdd.prompt_tokens": len(req.prompt_ids), "pdd.output_offset": output_offset,
                    **predictions(decision),
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

    async def _dispatch_prefill_only(self, run: RequestRun, req: GenerationRequest, avoid: set[str],
                                     exclude: frozenset[str]) -> Attempt:
        """P alone (max_tokens 0): no decoder, no KV path; P's PrefillDone ends the request. The least
        loaded P: its cache would not help, since P computes the whole prompt for its logprobs."""
        prefill = self.registry.pick(Role.PREFILL, avoid=avoid, exclude=exclude)
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
        abort = Abort(attempt.request_id, abort_reason, backfill_bytes_per_s)
        for instance_id in dict.fromkeys(attempt.instances.values()):  # one per instance, even colocated roles
            try:
                await bus.publish(self.nc, subjects.abort(instance_id), abort)
            except Exception as exc:  # its heartbeat's `held` brings the Abort again (abort_orphans)
                log.warning("%s: abort not sent to %s: %s", attempt.request_id, instance_id, exc)

    def _backfill_bytes_per_s(self, attempt: Attempt) -> float:
        """The pace of MD's KV for a request RLD finished alone: a share of the link rate the
        pipeline choice assumed (0: no backfill)."""
        share = self.config.backfill_link_share
        if share <= 0 or not attempt.main_backfill:
            return 0.0
        link = (attempt.decision.link_bytes_per_s if attempt.decision is not None else 0.0) \
            or self.planner.policy.default_link_bytes_per_s
        return share * link

    async def abort_orphans(self, heartbeat: Heartbeat) -> None:
        """Abort again what an instance still holds for this gateway but the gateway let go.

        An Abort is a NATS message to each of the request's instances; one sent while the WAN link was
        down never reached MD, which would hold the request (its KV, its inbox) until its own deadline.
        Its heartbeats list what it holds, per owner, so the next one after the link heals brings the
        Abort again; so does one for a request an instance registered after the gateway let it go (a
        DecodeAssign handled after a failed dispatch's Abort). An Abort is idempotent: one for a
        request that is ending anyway changes nothing.
        """
        orphans = [rid for rid in heartbeat.held.get(self.config.common.instance_id, ()) if rid not in self.active]
        for request_id in orphans:
            log.warning("%s still holds %s, which this gateway let go: aborting it again",
                        heartbeat.instance_id, request_id)
            await bus.publish(self.nc, subjects.abort(heartbeat.instance_id), Abort(request_id, "orphaned"))

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
    budgets = [d.heartbeat.kv_budget_tokens for d in decoders]
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
