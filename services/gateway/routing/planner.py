"""Which instances and pipeline serve an attempt: cache-aware picks from the registry, weighed against
load, and the policy's choice (services/gateway/routing/policy.py) from what the cost model
measured (routing/cost_model.py). Plain logic over the registry, no NATS: the dispatcher sends
what it decides.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

from opentelemetry import trace

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
from services.gateway.routing.registry import Instance, InstanceRegistry
from services.gateway.run.attempt import GenerationRequest
from shared import tracing
from shared.config import GatewayConfig
from shared.errors import PeerGone
from shared.messages import Heartbeat
from shared.metrics import GatewayMetrics
from shared.names import AUTO, Pipeline, Role

NO_MAIN_REASON = "no main decode reachable: RLD serves alone"


@dataclasses.dataclass
class Planner:
    """Plans an attempt (`plan`) and records the choice (`record_policy`: the gateway.policy span and
    the decision counter). What it picks is counted on the registry; the caller frees it (done)."""

    registry: InstanceRegistry
    config: GatewayConfig
    cache_index: CacheIndex
    costs: CostModel
    metrics: GatewayMetrics
    tracer: trace.Tracer = dataclasses.field(default_factory=lambda: tracing.tracer("pdd.gateway"))

    @functools.cached_property
    def policy(self) -> PolicyConfig:
        config = self.config
        return PolicyConfig(config.ttft_slo_s * config.relay_min_gain_fraction, config.wan_mbps_guess * 1e6 / 8,
                            config.prefill_tokens_per_s_guess)

    def choose_main(self, prompt_ids: list[int], avoid: set[str],
                    exclude: frozenset[str] = frozenset()) -> tuple[Instance, int] | None:
        """Cache-aware: the MD holding the longest prefix of the prompt, weighed against its load;
        None when no MD is reachable."""
        try:
            return self.pick_cached(Role.MAIN, prompt_ids, avoid, exclude)
        except PeerGone:
            return None

    def pick_cached(self, role: Role, prompt_ids: list[int], avoid: set[str],
                    exclude: frozenset[str] = frozenset()) -> tuple[Instance, int]:
        """The instance of `role` whose cache holds the longest prefix of the prompt's KV, weighed
        against its load, and that prefix's length."""
        hits: dict[str, int] = {}

        def score(instance: Instance) -> float:
            hit = self.cache_index.hit_tokens(instance.heartbeat.instance_id, prompt_ids[:-1])
            hits[instance.heartbeat.instance_id] = hit
            return hit - self.config.route_load_penalty_tokens * instance.load

        chosen = self.registry.pick(role, score, avoid, exclude)
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
            link_bytes_per_s=self.link_bytes_per_s(prefill.heartbeat, md),
            prefill_tokens_per_s=prefill_model.tokens_per_s if prefill_model else None,
            main_queue_s=self._queue_s(main, Role.MAIN),
            relay_queue_s=self._queue_s(relay, Role.RELAY) if relay is not None else NO_RELAY_S,
            prefill_fixed_s=prefill_model.fixed_s if prefill_model else 0.0,
            round_trip_s=path_round_trip_s(prefill_ping, round_trips.get(md.instance_id, 0.0)),
            relay_round_trip_s=(path_round_trip_s(prefill_ping, round_trips.get(relay.heartbeat.instance_id, 0.0))
                                if relay is not None else 0.0),
            relay_step_s=self.costs.step_s(Role.RELAY) or self.config.decode_step_s_guess,
            prefill_chunk_tokens=prefill.heartbeat.chunk_tokens or Estimate.prefill_chunk_tokens)
        kv_bytes_per_token = prefill.heartbeat.kv_bytes_per_token
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

    def link_bytes_per_s(self, prefill: Heartbeat, main: Heartbeat) -> float | None:
        """P to MD: the rate MD saw KV arrive at; before any, the rate P saw its writes complete at
        (which buffers along the way inflate)."""
        return (self.costs.link_bytes_per_s.get((prefill.instance_id, main.instance_id))
                or prefill.link_bytes_per_s.get(f"{main.kv_host}:{main.kv_port}"))

    def plan(self, req: GenerationRequest, avoid: set[str],
             exclude: frozenset[str]) -> tuple[PipelineDecision, RelayWatch | None, dict[Role, Instance]]:
        """The pipeline and an instance per role in it. With no MD reachable (all dead, or the WAN
        cut), RLD serves alone (P-RLD), counted as its own decision, rather than nobody."""
        prefill, prefill_hit = self.pick_cached(Role.PREFILL, req.prompt_ids, avoid, exclude)
        chosen = self.choose_main(req.prompt_ids, avoid, exclude)
        if chosen is None:
            decision = PipelineDecision(Pipeline.P_RLD, NO_MAIN_REASON, 0, 0, 0.0, 0.0, 0.0, prefill_hit)
            return decision, None, {Role.PREFILL: prefill,
                                    Role.RELAY: self._pick_or_release(Role.RELAY, avoid, exclude, [prefill])}
        main, main_hit = chosen
        try:  # RLD's start is half of the prediction; none reachable: P-MD, or whatever the request names
            relay: Instance | None = self.pick_cached(Role.RELAY, req.prompt_ids, avoid, exclude)[0]  # RLD caches too
        except PeerGone:
            relay = None
        decision, watch = self._decide(req, prefill, prefill_hit, main, main_hit, relay)
        instances = {Role.PREFILL: prefill, Role.MAIN: main}
        if decision.pipeline.uses_relay:
            instances[Role.RELAY] = relay or self._pick_or_release(Role.RELAY, avoid, exclude, [prefill, main])
        elif relay is not None:
            self.registry.done(relay.heartbeat.instance_id)
        if not decision.pipeline.uses_main:
            self.registry.done(instances.pop(Role.MAIN).heartbeat.instance_id)
        return decision, watch, instances

    def _pick_or_release(self, role: Role, avoid: set[str], exclude: frozenset[str],
                         picked: list[Instance]) -> Instance:
        try:
            return self.registry.pick(role, avoid=avoid, exclude=exclude)
        except PeerGone:
            for instance in picked:
                self.registry.done(instance.heartbeat.instance_id)
            raise

    def record_policy(self, req: GenerationRequest, chosen: dict[Role, Instance], decision: PipelineDecision,
                       started_ns: int) -> None:
        """The `gateway.policy` span (the routing and pipeline choice, with what it was based on) and
        the decision counter."""
        self.metrics.pipeline_decisions.labels(decision.pipeline, decision.reason).inc()
        prefill = chosen[Role.PREFILL].heartbeat
        main = chosen.get(Role.MAIN)
        link = self.link_bytes_per_s(prefill, main.heartbeat) if main is not None else None
        tracing.record_span(self.tracer, "gateway.policy", started_ns, time.time_ns(), {
            "pdd.request_id": req.request_id, "pdd.pipeline": decision.pipeline, "pdd.policy_reason": decision.reason,
            "pdd.pipeline_requested": req.pipeline or self.config.default_pipeline,
            "pdd.prompt_tokens": len(req.prompt_ids), "pdd.max_tokens": req.sampling.max_tokens,
            **predictions(decision),
            "pdd.instance.prefill": prefill.instance_id,
            **({"pdd.main_load": main.load, "pdd.instance.main": main.heartbeat.instance_id} if main else {}),
            **({"pdd.link_bytes_per_s": link} if link is not None else {}),
            **{f"pdd.{tier}_step_s": step for tier in (Role.RELAY, Role.MAIN)
               if (step := self.costs.step_s(tier)) is not None},
            **({"pdd.prefill_tokens_per_s": self.costs.prefill.tokens_per_s,
                "pdd.prefill_fixed_s": self.costs.prefill.fixed_s} if self.costs.prefill else {}),
            **({"pdd.main_round_trip_s": self.costs.round_trip_s[main.heartbeat.instance_id]}
               if main is not None and main.heartbeat.instance_id in self.costs.round_trip_s else {})})



def predictions(decision: PipelineDecision) -> dict[str, float | int]:
    """What the pipeline choice was based on, as span attributes (both decoders' predicted starts)."""
    relay = decision.predicted_relay_ready_s
    return {"pdd.prefill_hit_predicted": decision.prefill_hit_tokens,
            "pdd.main_hit_predicted": decision.main_hit_tokens, "pdd.wan_bytes_predicted": decision.wan_bytes,
            "pdd.main_ready_predicted_s": decision.predicted_main_ready_s,
            **({"pdd.relay_ready_predicted_s": relay, "pdd.main_ready_budget_s": decision.budget_s}
               if math.isfinite(relay) else {})}
