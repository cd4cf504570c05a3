"""Runs one request through its pipeline (P-MD or P-RLD-MD) and yields its tokens in order.

The dispatcher assigns the decoders first (so they expect the KV), then starts P, then merges
TokenChunks from RLD and MD by absolute index, each exactly once. Every exit path ends with an
Abort broadcast, so no tier keeps state for a request the gateway has let go.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared import bus, messages, subjects, tracing
from shared.config import GatewayConfig
from shared.errors import DeadlineExceeded, PddError, PeerGone, ProtocolError
from shared.metrics import GatewayMetrics
from shared.messages import (Abort, DecodeAccepted, DecodeAssign, Handoff, HandoffStats, KVReceived, KVTarget, MainLost,
                             PrefillAccepted,
                             PrefillDone, PrefillRequest, RequestFailed, TokenChunk)
from shared.sampling import SamplingParams
from services.gateway.cache_index import MainCacheIndex
from services.gateway.recovery import Action, RunState, on_tier_lost
from services.gateway.policy import LinkEstimate, PipelineDecision, PolicyConfig, choose_pipeline
from services.gateway.registry import Instance, InstanceRegistry

log = logging.getLogger(__name__)

ASSIGN_TIMEOUT_S = 5.0
WATCHDOG_S = 0.5  # how often a waiting request checks that its instances are still alive


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    pipeline: str | None
    handoff_at: int | None
    md_kv_delay_s: float
    handoff_mode: str | None = None
    failure_policy: str | None = None  # "fail" | "recover" | None: the gateway's --failure-policy


@dataclass(frozen=True)
class TokenEvent:
    index: int
    token_id: int
    tier: str
    finish_reason: str | None


_FAILED_BY_CODE = {cls.code: cls for cls in (DeadlineExceeded, ProtocolError)}


class RequestRun:
    """One request in flight: its event subscription, merge state and outcome."""

    def __init__(self, nc: NATS, req: GenerationRequest, pipeline: str, config: GatewayConfig,
                 telemetry: Telemetry | None = None, on_close: Callable[[RequestRun], None] | None = None,
                 is_alive: Callable[[str], bool] | None = None) -> None:
        self.nc = nc
        self.is_alive = is_alive
        self.failure_policy = req.failure_policy or config.failure_policy
        self.token_ids: list[int] = []  # what the client has, in order
        self.cut_done = False
        self.lost: set[str] = set()
        self.recovered = False
        self.recovery: str | None = None
        self._on_close = on_close
        self.telemetry = telemetry
        self.decision: PipelineDecision | None = None
        self.instances: dict[str, str] = {}
        self.request = req
        self.request_id = req.request_id
        self.pipeline = pipeline
        self.config = config
        self.cached_tokens = 0  # P's prefix-cache hit: prompt tokens not computed again
        self.main_cached_tokens = 0  # MD's DRC hit: prompt tokens whose KV did not cross the WAN
        self.handoff: HandoffStats | None = None
        self.prefill: PrefillDone | None = None
        self.kv_received: dict[str, KVReceived] = {}
        self.first_token_at: float | None = None
        self.started_at = time.monotonic()
        self.trace_id = tracing.current_trace_id()  # the response names it, to find the trace on /dashboard
        self.finished = False
        self._closed = False
        self._events: asyncio.Queue = asyncio.Queue()
        self._sub = None

    async def subscribe(self) -> None:
        self._sub = await self.nc.subscribe(subjects.request_events(self.request_id), cb=self._on_event)

    async def _on_event(self, msg: Msg) -> None:
        try:
            self._events.put_nowait(messages.decode(msg.data))
        except PddError as exc:
            log.warning("%s: dropped a malformed event: %s", self.request_id, exc)

    async def tokens(self) -> AsyncIterator[TokenEvent]:
        """Tokens in index order, each once; raises the failure of any tier it cannot recover from."""
        pending: dict[int, TokenEvent] = {}
        deadline = self.started_at + self.config.request_timeout_s
        last_event_at = time.monotonic()
        while not self.finished:
            now = time.monotonic()
            if now - last_event_at >= self.config.token_timeout_s or now >= deadline:
                raise DeadlineExceeded(f"{self.request_id}: no token for {now - last_event_at:.1f}s")
            try:
                async with asyncio.timeout(min(WATCHDOG_S, deadline - now)):
                    event = await self._events.get()
            except TimeoutError:
                await self._check_instances()
                continue
            last_event_at = time.monotonic()
            if isinstance(event, TokenChunk):
                if event.tier == "main":
                    self.cut_done = True
                for offset, token in enumerate(event.token_ids):
                    index = event.start + offset
                    last = offset == len(event.token_ids) - 1
                    if index >= len(self.token_ids) and index not in pending:
                        pending[index] = TokenEvent(index, token, event.tier, event.finish_reason if last else None)
                while len(self.token_ids) in pending:
                    if self.first_token_at is None:
                        self.first_token_at = time.monotonic()
                    token_event = pending.pop(len(self.token_ids))
                    self.token_ids.append(token_event.token_id)
                    if token_event.finish_reason is not None:
                        self.finished = True
                    yield token_event
                    if self.finished:
                        break
            elif isinstance(event, KVReceived):
                self.kv_received[event.tier] = event
            elif isinstance(event, HandoffStats):
                self.handoff = event
                self.cut_done = True
            elif isinstance(event, PrefillDone):
                self.prefill = event
                if self.telemetry is not None:
                    self.telemetry.observe_prefill(event)
            elif isinstance(event, RequestFailed):
                await self._on_tier_lost(event.path or event.tier, f"{event.tier}: {event.message}", event.code)

    async def _check_instances(self) -> None:
        """Notice a tier whose instance stopped sending heartbeats, before any deadline would."""
        for role, instance_id in self.instances.items():
            if role not in self.lost and self.is_alive is not None and not self.is_alive(instance_id):
                await self._on_tier_lost(role, f"{role} instance {instance_id} stopped answering", PeerGone.code)

    async def _on_tier_lost(self, tier: str, message: str, code: str) -> None:
        if tier in self.lost:
            return
        self.lost.add(tier)
        state = RunState(self.pipeline, self.cut_done, self.recovered, self.failure_policy)
        action = on_tier_lost(state, tier)
        log.warning("%s: %s lost (%s): %s", self.request_id, tier, message, action.value)
        if action is Action.IGNORE:
            return
        if action is Action.FAIL:
            raise _FAILED_BY_CODE.get(code, PddError)(message)
        self.recovered = True
        self.recovery = action.value
        if action is Action.FINISH_ON_RELAY:
            await bus.publish(self.nc, subjects.main_lost(self.instances["relay"]), MainLost(self.request_id, message))
        else:  # MD takes over from what the client already has
            await bus.publish(self.nc, subjects.handoff(self.instances["main"]), Handoff(
                self.request_id, list(self.token_ids), finished=False, start=0, final=True, mode="recovery"))

    def summary(self) -> dict:
        """What the client may want to know of how the request was served (the response's `pdd` field)."""
        return {
            "pipeline": self.pipeline,
            "trace_id": self.trace_id,
            "cached_tokens": {"prefill": self.cached_tokens, "main": self.main_cached_tokens},
            "kv": {tier: {"cached_tokens": kv.cached_tokens, "kv_tokens": kv.kv_tokens, "kv_bytes": kv.kv_bytes,
                          "kv_wait_s": round(kv.kv_wait_s, 6)} for tier, kv in self.kv_received.items()},
            "ttft_s": None if self.first_token_at is None else round(self.first_token_at - self.started_at, 6),
            "instances": dict(self.instances),
            "recovery": self.recovery,
            "policy": None if self.decision is None else self._policy_summary(),
        }

    def _policy_summary(self) -> dict:
        decision = self.decision
        main_kv = self.kv_received.get("main")
        return {"reason": decision.reason, "main_hit_predicted": decision.main_hit_tokens,
                "wan_bytes_predicted": decision.wan_bytes,
                "main_ready_predicted_s": round(decision.predicted_main_ready_s, 6),
                "main_ready_actual_s": None if main_kv is None else round(main_kv.kv_wait_s, 6),
                "ttft_budget_s": decision.budget_s}

    async def close(self, reason: str) -> None:
        """Idempotent: stop listening and tell every tier to drop the request."""
        if self._closed:
            return
        self._closed = True
        if self._on_close is not None:
            self._on_close(self)
        if self._sub is not None:
            await self._sub.unsubscribe()
        try:
            await bus.publish(self.nc, subjects.abort(), Abort(self.request_id, "finished" if self.finished else reason))
        except Exception as exc:  # the tiers' own deadlines still free the request
            log.warning("%s: abort not broadcast: %s", self.request_id, exc)


class Telemetry:
    """What the gateway has measured about the stack, for the policy's predictions."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.prefill_tokens_per_s: float | None = None

    def observe_prefill(self, done: PrefillDone) -> None:
        if done.computed_tokens < 16 or done.prefill_s <= 0:
            return  # tiny prefills measure overheads, not throughput
        rate = done.computed_tokens / done.prefill_s
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else old + self.alpha * (rate - old)


class Dispatcher:
    def __init__(self, nc: NATS, registry: InstanceRegistry, config: GatewayConfig, cache_index: MainCacheIndex,
                 counters: Counter[str] | None = None, metrics: GatewayMetrics | None = None) -> None:
        self.nc = nc
        self.metrics = metrics or GatewayMetrics()
        self.registry = registry
        self.config = config
        self.cache_index = cache_index
        self.telemetry = Telemetry()
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self.policy = PolicyConfig(config.ttft_slo_s, config.ttft_budget_fraction, config.skip_wan_max_tokens,
                                   config.wan_mbps_guess * 1e6 / 8, config.prefill_tokens_per_s_guess)
        self.tracer = tracing.tracer("pdd.gateway")

    async def start(self, req: GenerationRequest) -> RequestRun:
        """Dispatch; an instance that fails to accept is skipped and the next one tried, once per role."""
        for attempt in range(2):
            try:
                return await self._start_once(req)
            except (PeerGone, DeadlineExceeded) as exc:
                failed = getattr(exc, "instance_id", None)
                if failed is None or attempt == 1:
                    raise
                log.warning("%s: %s did not accept (%s); trying another instance", req.request_id, failed, exc)
                self.registry.suspect(failed)
        raise AssertionError("unreachable")

    def _choose_main(self, prompt_ids: list[int]) -> tuple[Instance, int]:
        """Cache-aware: the MD holding the longest prefix of the prompt, weighed against its load."""
        hits: dict[str, int] = {}

        def score(instance: Instance) -> float:
            hit = self.cache_index.hit_tokens(instance.heartbeat.instance_id, prompt_ids[:-1])
            hits[instance.heartbeat.instance_id] = hit
            return hit - self.config.route_load_penalty_tokens * instance.load

        main = self.registry.pick("main", score)
        return main, hits.get(main.heartbeat.instance_id, 0)

    def _decide(self, req: GenerationRequest, main: Instance, main_hit: int, prefill: Instance) -> PipelineDecision:
        md = main.heartbeat
        estimate = LinkEstimate(
            link_bytes_per_s=prefill.heartbeat.link_bytes_per_s.get(f"{md.kv_host}:{md.kv_port}"),
            prefill_tokens_per_s=self.telemetry.prefill_tokens_per_s,
            main_queue_s=max(0, main.load - 1) * self.config.decode_step_s_guess)  # load counts this request
        kv_bytes_per_token = int(prefill.heartbeat.stats.get("kv_bytes_per_token", 0))
        decision = choose_pipeline(self.policy, len(req.prompt_ids), req.sampling.max_tokens, main_hit,
                                   kv_bytes_per_token, estimate)
        forced = req.pipeline or (None if self.config.default_pipeline == "auto" else self.config.default_pipeline)
        if forced is not None and forced != decision.pipeline:
            decision = dataclasses.replace(decision, pipeline=forced, reason="named by the request or gateway flag")
        return decision

    async def _start_once(self, req: GenerationRequest) -> RequestRun:
        policy_started_ns = time.time_ns()
        prefill = self.registry.pick("prefill")
        main, main_hit = self._choose_main(req.prompt_ids)
        decision = self._decide(req, main, main_hit, prefill)
        self._record_policy(req, main, prefill, decision, policy_started_ns)
        pipeline = decision.pipeline
        relay = self.registry.pick("relay") if pipeline in ("p-rld-md", "p-rld") else None
        self.counters[f"pipeline.{pipeline}"] += 1
        run = RequestRun(self.nc, req, pipeline, self.config, self.telemetry, on_close=self._release,
                         is_alive=self.registry.is_alive)
        run.decision = decision
        run.instances = {"prefill": prefill.heartbeat.instance_id, "main": main.heartbeat.instance_id,
                         **({"relay": relay.heartbeat.instance_id} if relay else {})}
        if pipeline == "p-rld":
            del run.instances["main"]
            self.registry.done(main.heartbeat.instance_id)
        await run.subscribe()
        try:
            with self.tracer.start_as_current_span("gateway.dispatch") as span:
                span.set_attributes({
                    "pdd.request_id": req.request_id, "pdd.pipeline": pipeline, "pdd.policy_reason": decision.reason,
                    "pdd.prompt_tokens": len(req.prompt_ids), "pdd.main_hit_predicted": main_hit,
                    "pdd.wan_bytes_predicted": decision.wan_bytes,
                    "pdd.main_ready_predicted_s": decision.predicted_main_ready_s, "pdd.ttft_budget_s": decision.budget_s,
                    **{f"pdd.instance.{role}": iid for role, iid in run.instances.items()}})
                headers = tracing.inject()
                main_id = main.heartbeat.instance_id if pipeline != "p-rld" else ""
                assign = DecodeAssign(
                    req.request_id, pipeline, req.prompt_ids, req.sampling,
                    relay.heartbeat.instance_id if relay else None, main_id,
                    self.config.request_timeout_s, req.handoff_at, handoff_mode=req.handoff_mode)
                decoders = ([("main", main)] if pipeline != "p-rld" else []) + ([("relay", relay)] if relay else [])
                accepted = await asyncio.gather(*(self._call(role, inst, assign, headers) for role, inst in decoders))
                targets = [KVTarget(role, acc.kv_host, acc.kv_port, acc.cached_tokens,
                                    req.md_kv_delay_s if role == "main" else 0.0)
                           for (role, _), acc in zip(decoders, accepted)]
                prefill_accepted = await self._call("prefill", prefill, PrefillRequest(
                    req.request_id, req.prompt_ids, targets, self.config.request_timeout_s), headers)
                run.cached_tokens = prefill_accepted.cached_tokens
                run.main_cached_tokens = accepted[0].cached_tokens if pipeline != "p-rld" else 0
                span.set_attributes({"pdd.prefill_cached_tokens": run.cached_tokens,
                                     "pdd.main_cached_tokens": run.main_cached_tokens})
        except BaseException:
            await run.close("dispatch failed")
            raise
        return run

    def _record_policy(self, req: GenerationRequest, main: Instance, prefill: Instance, decision: PipelineDecision,
                       started_ns: int) -> None:
        """The `gateway.policy` span (the routing and pipeline choice, with what it was based on) and
        the decision counter."""
        self.metrics.pipeline_decisions.labels(decision.pipeline, decision.reason).inc()
        md = main.heartbeat
        link = prefill.heartbeat.link_bytes_per_s.get(f"{md.kv_host}:{md.kv_port}")
        tracing.record_span(self.tracer, "gateway.policy", started_ns, time.time_ns(), {
            "pdd.request_id": req.request_id, "pdd.pipeline": decision.pipeline, "pdd.policy_reason": decision.reason,
            "pdd.pipeline_requested": req.pipeline or self.config.default_pipeline,
            "pdd.prompt_tokens": len(req.prompt_ids), "pdd.max_tokens": req.sampling.max_tokens,
            "pdd.main_hit_predicted": decision.main_hit_tokens, "pdd.wan_bytes_predicted": decision.wan_bytes,
            "pdd.main_ready_predicted_s": decision.predicted_main_ready_s, "pdd.ttft_budget_s": decision.budget_s,
            "pdd.main_load": main.load, "pdd.instance.main": md.instance_id,
            "pdd.instance.prefill": prefill.heartbeat.instance_id,
            **({"pdd.link_bytes_per_s": link} if link is not None else {}),
            **({"pdd.prefill_tokens_per_s": self.telemetry.prefill_tokens_per_s}
               if self.telemetry.prefill_tokens_per_s is not None else {})})

    def _release(self, run: RequestRun) -> None:
        for instance_id in run.instances.values():
            self.registry.done(instance_id)

    async def _call(self, role: str, instance: Instance, msg: object, headers: dict[str, str]) -> object:
        instance_id = instance.heartbeat.instance_id
        subject = subjects.prefill(instance_id) if role == "prefill" else subjects.decode_assign(role, instance_id)
        reply_type = PrefillAccepted if role == "prefill" else DecodeAccepted
        try:
            return await bus.request(self.nc, subject, msg, reply_type, ASSIGN_TIMEOUT_S, headers)
        except (PeerGone, DeadlineExceeded) as exc:
            exc.instance_id = instance_id
            raise
