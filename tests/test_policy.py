"""The gateway's pipeline choice and its index of MD caches, as plain logic."""
from __future__ import annotations

import random

import torch

from services.gateway.routing.cache_index import CacheIndex
from services.gateway.routing.policy import Estimate, PolicyConfig, RelayWatch, choose_pipeline, path_round_trip_s
from shared.radix_cache import RadixCache

CONFIG = PolicyConfig(relay_min_gain_s=0.1, default_link_bytes_per_s=100e6 / 8, default_prefill_tokens_per_s=5000)
KV_BYTES_PER_TOKEN = 46_080  # SmolLM2, fp32
STEP_S = 0.05


def estimate(link_mbps: float, prefill_tokens_per_s: float = 5000.0, main_queue_s: float = STEP_S,
             relay_queue_s: float = STEP_S, round_trip_s: float = 0.0) -> Estimate:
    return Estimate(link_mbps * 1e6 / 8, prefill_tokens_per_s, main_queue_s, relay_queue_s,
                    round_trip_s=round_trip_s, relay_step_s=STEP_S)


def decide(link_mbps: float, prompt_tokens: int = 2000, hit: int = 0, max_tokens: int = 256,
           config: PolicyConfig = CONFIG, prefill_hit: int | None = None, **kw: float) -> str:
    prefill_hit = hit if prefill_hit is None else prefill_hit
    return choose_pipeline(config, prompt_tokens, max_tokens, hit, KV_BYTES_PER_TOKEN, estimate(link_mbps, **kw),
                           prefill_hit).pipeline


def test_one_datacenter_goes_p_md_unless_main_is_queued() -> None:
    # 2,000 uncached tokens: 0.4 s of P's compute, 0.009 s over a 100 Gbit/s local link
    assert decide(100_000, round_trip_s=0.001) == "p-md", "RLD could not start earlier: no handoff for nothing"
    assert decide(100_000, hit=1500) == "p-md"
    assert decide(100_000, main_queue_s=1.0) == "p-rld-md", "MD queued: RLD covers the wait"


def test_a_long_missing_suffix_over_a_slow_link_goes_through_relay() -> None:
    # 500 tokens MD lacks = 23 MB: 1.8 s at 100 Mbit/s against 0.1 s of compute
    assert decide(100, hit=1500) == "p-rld-md"
    assert decide(100, hit=0) == "p-rld-md"
    assert decide(100, hit=1990) == "p-md", "9 tokens cross in 33 ms"


def test_a_slow_prefill_with_a_fast_link_goes_p_md() -> None:
    # P computes 2,000 tokens at 500 tokens/s (4 s); the KV streams out as fast as it is made
    assert decide(10_000, prefill_tokens_per_s=500, round_trip_s=0.03) == "p-md"
    # P's own cache lags MD's: P computes 1,000 tokens (2 s), 10 MB cross a 1 Gbit/s link in 0.08 s
    assert decide(1_000, hit=1800, prefill_hit=1000, prefill_tokens_per_s=500) == "p-md"


def test_a_session_turns_suffix_crosses_after_p_computed_it() -> None:
    """A turn of the paper's sessions: P computes its 94 missing tokens (0.78 s at 120 tokens/s on
    a busy CPU), MD lacks 61 of them; their 2.8 MB leave as one chunk once P is done, 0.22 s at
    100 Mbit/s. Overlapping the crossing with the compute would have hidden that and picked P-MD."""
    decision = choose_pipeline(CONFIG, 1213, 128, 1151, KV_BYTES_PER_TOKEN, estimate(100, prefill_tokens_per_s=120),
                               prefill_hit_tokens=1118)
    assert decision.pipeline == "p-rld-md"
    crossing_s = 61 * KV_BYTES_PER_TOKEN / 12.5e6
    assert abs(decision.predicted_main_ready_s - decision.predicted_relay_ready_s - crossing_s) < 1e-9
    long_prompt = choose_pipeline(CONFIG, 2049, 128, 2048 - 600, KV_BYTES_PER_TOKEN, estimate(10_000, 500))
    assert long_prompt.pipeline == "p-md", "chunk by chunk, a fast link's crossing hides under the compute"


def test_the_prediction_counts_what_crosses_what_p_computes_and_the_queues() -> None:
    est = Estimate(10e6, 1000.0, main_queue_s=0.25, relay_queue_s=0.05, prefill_fixed_s=0.1, round_trip_s=0.02)
    decision = choose_pipeline(CONFIG, 1001, 64, 500, 1000, est, prefill_hit_tokens=800)
    assert decision.wan_bytes == 500 * 1000
    compute = 0.1 + 200 / 1000
    last_chunk_s = 200 * 1000 / 10e6  # the 200 computed tokens are one chunk: it crosses after P is done
    assert abs(decision.predicted_main_ready_s - (0.25 + 0.02 + max(compute + last_chunk_s, 0.05))) < 1e-9
    assert abs(decision.predicted_relay_ready_s - (0.05 + compute)) < 1e-9
    assert abs(decision.budget_s - (decision.predicted_relay_ready_s + 0.1)) < 1e-9
    assert decision.pipeline == "p-rld-md", "MD's queue makes it 0.22 s later"


def test_without_a_relay_the_choice_is_p_md() -> None:
    est = Estimate(1e6, 1000.0, main_queue_s=0.05)
    assert choose_pipeline(CONFIG, 2000, 64, 0, KV_BYTES_PER_TOKEN, est).pipeline == "p-md"


def test_a_short_answer_with_a_long_suffix_holds_mains_stream_back() -> None:
    # 1,999 tokens MD lacks = 92 MB: 7.4 s at 100 Mbit/s; 8 tokens at 50 ms take RLD 0.35 s
    est = estimate(100)
    short = choose_pipeline(CONFIG, 2000, 8, 0, KV_BYTES_PER_TOKEN, est)
    assert (short.pipeline, short.hold_main_kv) == ("p-rld-md", True)
    assert short.predicted_relay_finish_s < short.predicted_main_ready_s
    long = choose_pipeline(CONFIG, 2000, 256, 0, KV_BYTES_PER_TOKEN, est)
    assert (long.pipeline, long.hold_main_kv) == ("p-rld-md", False), "RLD would still decode when MD's KV is in"
    in_time = choose_pipeline(CONFIG, 2000, 8, 1990, KV_BYTES_PER_TOKEN, est)
    assert (in_time.pipeline, in_time.hold_main_kv) == ("p-md", False), "nothing to hold: MD starts in time"


def test_a_held_stream_is_released_once_relay_no_longer_finishes_first() -> None:
    est = estimate(100)
    # both caches hold 1,900 tokens: P computes 99 (20 ms), whose KV crosses in 0.36 s
    decision = choose_pipeline(CONFIG, 2000, 64, 1900, KV_BYTES_PER_TOKEN, est, prefill_hit_tokens=1900)
    assert (decision.pipeline, decision.hold_main_kv) == ("p-rld-md", False), "64 tokens outlast the crossing"
    decision = choose_pipeline(CONFIG, 2000, 6, 1900, KV_BYTES_PER_TOKEN, est, prefill_hit_tokens=1900)
    assert decision.hold_main_kv, "6 tokens at 50 ms: RLD is done in 0.32 s, MD's KV arrives at 0.42 s"
    watch = RelayWatch.of(decision, CONFIG, est, 6)
    assert not any(watch.should_release(n, 0.05 * n) for n in range(1, 7)), "RLD keeps its predicted pace"
    slow = RelayWatch.of(decision, CONFIG, est, 6)
    assert not slow.should_release(1, 0.0) and not slow.should_release(2, 0.4), "one gap proves nothing yet"
    assert slow.should_release(3, 0.8), "0.4 s a token, 0.225 s with the 50 ms step: the last 3 take 0.68 s; " \
        "MD could take over within 0.47 s"
    # two slow first gaps (the request joining RLD's batch beside P's prefill), then RLD's own pace
    noisy = RelayWatch.of(decision, CONFIG, est, 6)
    times = [0.0, 0.13, 0.26, 0.31, 0.36, 0.41]
    assert not any(noisy.should_release(n, t) for n, t in enumerate(times, start=1)), \
        "130 ms gaps twice: shrunk toward the 50 ms step, the last 3 take 0.27 s, within MD's 0.47 s"
    assert RelayWatch.of(decision, CONFIG, est, 6).should_release(3, 0.26) is False


def test_index_mirrors_the_main_cache_from_its_events() -> None:
    index = CacheIndex()
    cache = RadixCache(capacity_tokens=400, capacity_bytes=1 << 30, event_block_tokens=16,
                       listener=lambda event: index.apply("md-1", [event.__dict__]))
    rng = random.Random(0)
    base = [rng.randrange(1000) for _ in range(100)]
    cache.insert(base, torch.zeros(1, 2, 1, 100, 4))
    cache.insert(base[:60] + [7] * 40, torch.zeros(1, 2, 1, 100, 4))  # splits the first node at 60
    assert index.hit_tokens("md-1", base + [1, 2, 3]) == 100
    assert index.hit_tokens("md-1", base[:60] + [7] * 40) == 100
    assert index.hit_tokens("md-1", base[:70]) == 64, "inside a node: to the block below"
    assert index.hit_tokens("md-1", base[:63]) == 60
    assert index.hit_tokens("md-1", [5] + base) == 0
    assert index.hit_tokens("md-2", base) == 0
    for _ in range(5):  # push everything out
        cache.insert([rng.randrange(1000) for _ in range(100)], torch.zeros(1, 2, 1, 100, 4))
    assert index.hit_tokens("md-1", base) == 0


def _state(pipeline="p-rld-md", cut_done=False, lost=(), streamed=5, prefill_done=True, migrations_left=2,
           policy="recover", phase=None):
    from services.gateway.run.attempt import AttemptPhase
    from services.gateway.run.recovery import RunState
    phase = phase or (AttemptPhase.CUT if cut_done else AttemptPhase.DISPATCHED)
    return RunState(pipeline, phase, frozenset(lost), streamed, prefill_done, migrations_left, policy)


def test_recovery_before_the_cut_keeps_the_other_decoder() -> None:
    from services.gateway.run.recovery import Action, on_tier_lost

    assert on_tier_lost(_state(), "main") is Action.FINISH_ON_RELAY
    assert on_tier_lost(_state(), "relay") is Action.MAIN_TAKES_OVER
    assert on_tier_lost(_state(), "prefill") is Action.IGNORE, "P is done: its KV is out"
    # the other decoder is gone already: the request moves on
    assert on_tier_lost(_state(lost={"main"}), "relay") is Action.MIGRATE
    assert on_tier_lost(_state(lost={"relay"}), "main") is Action.MIGRATE


def test_a_lost_streaming_decoder_migrates_within_the_limit() -> None:
    from services.gateway.run.recovery import Action, on_tier_lost

    assert on_tier_lost(_state(cut_done=True), "main") is Action.MIGRATE
    assert on_tier_lost(_state(cut_done=True), "relay") is Action.IGNORE, "RLD was finished"
    assert on_tier_lost(_state("p-md"), "main") is Action.MIGRATE
    assert on_tier_lost(_state("p-rld"), "relay") is Action.MIGRATE
    assert on_tier_lost(_state("p-md", migrations_left=0), "main") is Action.FAIL


def test_a_lost_prefill_is_retried_only_before_any_token() -> None:
    from services.gateway.run.recovery import Action, on_tier_lost

    assert on_tier_lost(_state("p-md", streamed=0, prefill_done=False), "prefill") is Action.MIGRATE
    assert on_tier_lost(_state(streamed=0, prefill_done=False), "prefill") is Action.MIGRATE
    # RLD streams already, MD's KV may never come: RLD finishes
    assert on_tier_lost(_state(streamed=3, prefill_done=False), "prefill") is Action.FINISH_ON_RELAY
    # MD streams: it holds its KV
    assert on_tier_lost(_state("p-md", streamed=3, prefill_done=False), "prefill") is Action.IGNORE


def test_once_relay_finishes_alone_a_lost_main_changes_nothing() -> None:
    from services.gateway.run.attempt import AttemptPhase
    from services.gateway.run.recovery import Action, on_tier_lost

    alone = AttemptPhase.RELAY_ALONE  # P was lost before MD's KV was out: MD was let go, not lost
    assert on_tier_lost(_state(phase=alone, prefill_done=False), "main") is Action.IGNORE
    assert on_tier_lost(_state(phase=alone, prefill_done=False), "relay") is Action.MIGRATE


def test_the_fail_policy_fails_everything_but_what_needs_no_recovery() -> None:
    from services.gateway.run.recovery import Action, on_tier_lost

    assert on_tier_lost(_state(policy="fail"), "main") is Action.FAIL
    assert on_tier_lost(_state("p-md", policy="fail"), "main") is Action.FAIL
    assert on_tier_lost(_state("p-md", streamed=0, prefill_done=False, policy="fail"), "prefill") is Action.FAIL
    assert on_tier_lost(_state(policy="fail"), "prefill") is Action.IGNORE
    assert on_tier_lost(_state(cut_done=True, policy="fail"), "relay") is Action.IGNORE


def test_an_instance_whose_ping_finds_nobody_is_gone_until_it_beats_again() -> None:
    import time

    from services.gateway.routing.registry import InstanceRegistry
    from shared.messages import Heartbeat

    def beat(sent_at: float) -> Heartbeat:
        return Heartbeat("main", "md-1", "127.0.0.1", 1, "m", 0, 0, sent_at)

    registry = InstanceRegistry(stale_after_s=60)
    registry.observe(beat(time.time()))
    assert [i.heartbeat.instance_id for i in registry.watched()] == ["md-1"]
    late = beat(time.time())  # sent before the process died, delivered after the ping found nobody
    registry.mark_gone("md-1")
    assert not registry.is_alive("md-1") and registry.alive("main") == [] and registry.watched() == []
    registry.observe(late)
    assert not registry.is_alive("md-1"), "a heartbeat older than the death notice changes nothing"
    registry.observe(beat(time.time() + 1))  # restarted under the same id
    assert registry.is_alive("md-1") and len(registry.alive("main")) == 1


def test_the_prefill_model_separates_a_fixed_cost_from_a_per_token_cost() -> None:
    from services.gateway.routing.cost_model import CostModel, fit_prefill

    assert fit_prefill([(100, 0.2), (100, 0.21)]) is None, "one size says nothing of the slope"
    telemetry = CostModel()
    for n in (20, 50, 100, 400, 800):
        telemetry.observe_prefill(n, 0.1 + n / 1000)
    model = telemetry.prefill
    assert abs(model.fixed_s - 0.1) < 1e-9 and abs(model.tokens_per_s - 1000) < 1e-6
    assert abs(model.seconds(30) - 0.13) < 1e-9
    through_origin = fit_prefill([(100, 0.05), (200, 0.2), (300, 0.3)])  # noise puts the intercept below 0
    assert through_origin.fixed_s == 0.0 and through_origin.tokens_per_s > 0
    telemetry.observe_round_trip("md-1", 0.05)
    telemetry.observe_round_trip("md-1", 0.10)
    assert 0.05 < telemetry.round_trip_s["md-1"] < 0.10


def test_the_predicted_main_start_counts_the_fixed_costs() -> None:
    bare = Estimate(link_bytes_per_s=1e9, prefill_tokens_per_s=1e4, main_queue_s=0.0)
    costly = Estimate(link_bytes_per_s=1e9, prefill_tokens_per_s=1e4, main_queue_s=0.0, prefill_fixed_s=0.2,
                      round_trip_s=0.06)
    small = {"prompt_tokens": 100, "max_tokens": 64, "main_hit_tokens": 60, "kv_bytes_per_token": 46080}
    fast = choose_pipeline(CONFIG, estimate=bare, **small)
    slow = choose_pipeline(CONFIG, estimate=costly, **small)
    assert abs(slow.predicted_main_ready_s - fast.predicted_main_ready_s - 0.26) < 1e-9


def test_the_network_path_through_p_is_the_larger_ping_wherever_the_gateway_sits() -> None:
    rtt = 0.03
    # gateway in A, beside P and RLD: MD's path is the WAN's round trip, RLD's nothing
    assert path_round_trip_s(0.0, rtt) == rtt and path_round_trip_s(0.0, 0.0) == 0.0
    # gateway in B, beside MD: the request crosses to P and RLD's tokens cross back; MD's KV crosses once
    assert path_round_trip_s(rtt, 0.0) == rtt and path_round_trip_s(rtt, rtt) == rtt
    # so in B, RLD's gain is P's compute against MD's crossing alone: the WAN's round trip cancels
    crossing = {"prompt_tokens": 1200, "max_tokens": 128, "main_hit_tokens": 1100, "kv_bytes_per_token": 23_040}
    in_a = choose_pipeline(CONFIG, estimate=Estimate(12.5e6, 1000.0, STEP_S, STEP_S, round_trip_s=rtt,
                                                     relay_round_trip_s=0.0), prefill_hit_tokens=1100, **crossing)
    in_b = choose_pipeline(CONFIG, estimate=Estimate(12.5e6, 1000.0, STEP_S, STEP_S, round_trip_s=rtt,
                                                     relay_round_trip_s=rtt), prefill_hit_tokens=1100, **crossing)
    gain_a = in_a.predicted_main_ready_s - in_a.predicted_relay_ready_s
    gain_b = in_b.predicted_main_ready_s - in_b.predicted_relay_ready_s
    assert abs(gain_a - gain_b - rtt) < 1e-9


def test_each_tier_step_is_the_median_gap_between_its_tokens() -> None:
    from services.gateway.routing.cost_model import CostModel

    telemetry = CostModel()
    assert telemetry.step_s("relay") is None
    from services.gateway.run.attempt import Attempt, GenerationRequest
    from shared.sampling_params import SamplingParams

    def attempt() -> Attempt:  # each attempt keeps when its tiers' last tokens came
        req = GenerationRequest("req-" + "0" * 32, [1, 2], SamplingParams(max_tokens=8), None, None, 0.0)
        return Attempt(req, 0, "p-rld-md", None, {})

    first = attempt()
    for at in (0.0, 0.1, 0.2, 0.3, 1.3, 1.4):  # one 1 s stall (a handoff) among 0.1 s gaps
        telemetry.observe_tokens("relay", 1, first.chunk_gap_s("relay", at))
    telemetry.observe_tokens("main", 1, first.chunk_gap_s("main", 5.0))  # the first MD token is no gap
    telemetry.observe_tokens("main", 2, first.chunk_gap_s("main", 5.4))  # two tokens in one chunk
    assert abs(telemetry.step_s("relay") - 0.1) < 1e-9 and abs(telemetry.step_s("main") - 0.2) < 1e-9
    # a new attempt: no gap from the old one
    telemetry.observe_tokens("main", 1, attempt().chunk_gap_s("main", 50.0))
    assert abs(telemetry.step_s("main") - 0.2) < 1e-9


def test_routing_forgets_the_cache_of_a_main_found_dead() -> None:
    import time

    from services.gateway.routing.dispatcher import Dispatcher
    from services.gateway.routing.registry import InstanceRegistry
    from shared.config import CommonConfig, GatewayConfig
    from shared.messages import Heartbeat

    def beat(instance_id: str) -> Heartbeat:
        return Heartbeat("main", instance_id, "127.0.0.1", 1, "m", 0, 0, time.time())

    index = CacheIndex()
    registry = InstanceRegistry(stale_after_s=60, on_gone=index.forget)
    config = GatewayConfig(common=CommonConfig("nats://127.0.0.1:4222", "gw", "INFO", "", 1.0), model="tiny",
                           host="127.0.0.1", port=0, default_pipeline="auto", request_timeout_s=10.0,
                           token_timeout_s=5.0, max_body_bytes=1024, default_max_tokens=8)
    dispatcher = Dispatcher(None, registry, config, index)
    prompt = list(range(100, 164))
    cache = RadixCache(capacity_tokens=400, capacity_bytes=1 << 30, event_block_tokens=16,
                       listener=lambda event: index.apply("md-a", [event.__dict__]))
    cache.insert(prompt, torch.zeros(1, 2, 1, len(prompt), 4))
    for md in ("md-a", "md-b"):
        registry.observe(beat(md))
    main, hit = dispatcher.planner.choose_main(prompt + [1], avoid=set())
    assert main.heartbeat.instance_id == "md-a" and hit == 64, "routing follows the cached prefix"
    registry.done("md-a")
    registry.mark_gone("md-a")
    assert "md-a" not in index.instances()
    registry.observe(beat("md-a"))  # restarted under the same id, with an empty cache
    main, hit = dispatcher.planner.choose_main(prompt + [1], avoid=set())
    assert hit == 0 and index.hit_tokens("md-a", prompt) == 0, "a dead MD's cache no longer attracts requests"


def test_prefill_is_routed_to_the_p_whose_cache_holds_the_prompt() -> None:
    import time

    from services.gateway.routing.dispatcher import Dispatcher
    from services.gateway.routing.registry import InstanceRegistry
    from shared.config import CommonConfig, GatewayConfig
    from shared.messages import Heartbeat
    from shared.names import Role

    index = CacheIndex()
    registry = InstanceRegistry(stale_after_s=60)
    config = GatewayConfig(common=CommonConfig("nats://127.0.0.1:4222", "gw", "INFO", "", 1.0), model="tiny")
    dispatcher = Dispatcher(None, registry, config, index)
    prompt = list(range(100, 164))
    cache = RadixCache(capacity_tokens=400, capacity_bytes=1 << 30, event_block_tokens=16,
                       listener=lambda event: index.apply("p-a", [event.to_dict()]))
    cache.insert(prompt[:48], torch.zeros(1, 2, 1, 48, 4))
    for p in ("p-a", "p-b"):  # p-b wins a tie on load
        registry.observe(Heartbeat("prefill", p, "", 0, "m", 0, 0, time.time()))
    prefill, hit = dispatcher.planner.pick_cached(Role.PREFILL, prompt + [1], avoid=set())
    assert (prefill.heartbeat.instance_id, hit) == ("p-a", 48), "P's own hit: what it will not compute"


def test_a_migration_never_goes_back_to_the_instance_that_just_failed() -> None:
    """A failed instance that answers pings is busy, and is preferred against but still taken; the
    one a request just failed on is never taken back (issue 43: P's KV connections to the only MD
    were refused, and the request migrated to that MD twice). With no other MD, RLD serves alone."""
    import time

    import pytest

    from services.gateway.routing.dispatcher import Dispatcher
    from services.gateway.routing.registry import InstanceRegistry
    from shared.config import CommonConfig, GatewayConfig
    from shared.errors import PeerGone
    from shared.messages import Heartbeat
    from shared.names import Role

    registry = InstanceRegistry(stale_after_s=60)
    registry.observe(Heartbeat("main", "md-a", "127.0.0.1", 1, "m", 0, 0, time.time()))
    registry.mark_answered("md-a")
    assert registry.pick(Role.MAIN, avoid={"md-a"}).heartbeat.instance_id == "md-a"
    with pytest.raises(PeerGone, match="just failed"):
        registry.pick(Role.MAIN, avoid={"md-a"}, exclude={"md-a"})
    config = GatewayConfig(common=CommonConfig("nats://127.0.0.1:4222", "gw", "INFO", "", 1.0), model="tiny",
                           host="127.0.0.1", port=0, default_pipeline="auto", request_timeout_s=10.0,
                           token_timeout_s=5.0, max_body_bytes=1024, default_max_tokens=8)
    dispatcher = Dispatcher(None, registry, config, CacheIndex())
    assert dispatcher.planner.choose_main([1, 2, 3], set(), frozenset({"md-a"})) is None


async def test_p_is_asked_to_cache_a_running_answer_every_step_but_the_last() -> None:
    """The run tells its host (the dispatcher) each time the client's answer grows; the dispatcher
    asks P for whole steps of it."""
    import dataclasses

    from services.gateway.routing.dispatcher import Dispatcher
    from services.gateway.routing.registry import InstanceRegistry
    from services.gateway.run.attempt import Attempt, GenerationRequest
    from services.gateway.run.request_run import RequestRun
    from shared.config import CommonConfig, GatewayConfig
    from shared.messages import TokenChunk
    from shared.sampling_params import SamplingParams

    config = GatewayConfig(common=CommonConfig("nats://127.0.0.1:4222", "gw", "INFO", "", 1.0), model="tiny",
                           host="127.0.0.1", port=0, default_pipeline="auto", request_timeout_s=10.0,
                           token_timeout_s=5.0, max_body_bytes=1024, default_max_tokens=8, warm_prefill_tokens=4)

    async def on_tokens(step_tokens: int, *chunks: tuple[int, list[int], bool]) -> list[list[int] | None]:
        dispatcher = Dispatcher(None, InstanceRegistry(stale_after_s=60), dataclasses.replace(
            config, warm_prefill_tokens=step_tokens), CacheIndex())
        asked: list[list[int]] = []

        async def warm(attempt: Attempt, answer: list[int]) -> None:
            asked.append(answer)

        dispatcher._warm_prefill = warm  # type: ignore[method-assign]
        req = GenerationRequest("req-" + "0" * 32, [1, 2], SamplingParams(max_tokens=20), None, None, 0.0)
        run = RequestRun(req, config, dispatcher)
        run.attempt = run.first = Attempt(req, 0, "p-md", None, {})
        answers: list[list[int] | None] = []
        for start, ids, finished in chunks:
            before = len(asked)
            await run.handle(TokenChunk(req.request_id, start, ids, "main", "length" if finished else None))
            answers.append(asked[-1] if len(asked) > before else None)
        return answers

    answers = await on_tokens(4, (0, [1, 2, 3], False), (4, [5, 6], False), (3, [4], False), (6, [7, 8, 9], False),
                              (9, [10, 11, 12], True))
    assert answers[0] is None
    assert answers[1] is None, "token 3 is still missing"
    assert answers[2] == [1, 2, 3, 4]
    assert answers[3] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert answers[4] is None, "the next turn computes the rest"
    assert await on_tokens(0, (0, [1, 2, 3, 4], False)) == [None]


def test_catch_up_streams_from_the_first_token_and_cuts_at_mds_first_report() -> None:
    from services.relay.handoff import HandoffPlan, Step
    from shared.config import HandoffConfig
    from shared.names import HandoffMode

    plan = HandoffPlan(HandoffMode.CATCH_UP, HandoffConfig().catch_up_threshold, handoff_at=None)
    assert plan.next(0).step is Step.DECODE, "nothing to send before the first token"
    for eager in range(1, 9):  # MD's KV still crossing: each token goes to MD as it is made
        sent = plan.next(eager)
        assert (sent.step, sent.start, sent.end) == (Step.SEND_CHUNK, eager - 1, eager)
        assert plan.next(eager).step is Step.DECODE
    assert plan.would_cut(9, adopted_tokens=0), "MD's first report while token 9 is made: the cut is announced"
    plan.on_main_progress(0)  # MD's KV is in; MD holds all 8 streamed tokens in its queue
    cut = plan.next(9)
    assert (cut.step, cut.start, cut.end) == (Step.CUT, 8, 9), "no round of asking: the cut carries one token"
    one_shot = HandoffPlan(HandoffMode.ONE_SHOT, HandoffConfig().catch_up_threshold, handoff_at=None)
    assert one_shot.next(3).step is Step.DECODE, "One-Shot sends nothing before MD reports"
    pinned = HandoffPlan(HandoffMode.CATCH_UP, HandoffConfig().catch_up_threshold, handoff_at=5)
    assert pinned.next(3).step is Step.DECODE, "a pinned cut (tests) keeps its chunks as before"


def test_mds_report_that_it_holds_streamed_tokens_cuts_whatever_the_threshold() -> None:
    """MD reports once that it holds RLD's tokens and then only collects: RLD must cut at that report,
    even with a threshold that the token in the making alone reaches."""
    from services.relay.handoff import HandoffPlan, Step
    from shared.names import HandoffMode

    plan = HandoffPlan(HandoffMode.CATCH_UP, threshold=1, handoff_at=None)
    for eager in range(1, 6):
        assert plan.next(eager).step is Step.SEND_CHUNK
    assert plan.would_cut(6, adopted_tokens=5), "announced while token 6 is made"
    plan.on_main_progress(5)
    cut = plan.next(6)
    assert (cut.step, cut.start, cut.end) == (Step.CUT, 5, 6)


def test_a_pinned_catch_up_cut_needs_md_ready_not_a_report_after_each_chunk() -> None:
    """MD reports holding the first chunk once; RLD streams on and cuts at the pinned count without
    waiting for another report (MD, collecting, sends none)."""
    from services.relay.handoff import HandoffPlan, Step
    from shared.names import HandoffMode

    plan = HandoffPlan(HandoffMode.CATCH_UP, threshold=4, handoff_at=8)
    plan.on_main_progress(0)
    assert plan.next(3).step is Step.SEND_CHUNK and plan.main_ready
    plan.on_main_progress(3)
    for eager in range(4, 8):
        assert plan.next(eager).step is Step.SEND_CHUNK
    cut = plan.next(8)
    assert (cut.step, cut.start, cut.end) == (Step.CUT, 7, 8)


def test_a_handoff_after_a_handful_of_eager_tokens_still_catches_up() -> None:
    from services.relay.handoff import HandoffPlan, Step
    from shared.config import HandoffConfig
    from shared.names import HandoffMode

    plan = HandoffPlan(HandoffMode.CATCH_UP, HandoffConfig().catch_up_threshold, handoff_at=None)
    plan.on_main_progress(0)  # MD's KV is in after 6 eager tokens RLD has not streamed (say, a lost message)
    first = plan.next(6)
    assert (first.step, first.start, first.end) == (Step.SEND_CHUNK, 0, 6), "RLD keeps decoding while MD recomputes"
    streamed = plan.next(7)
    assert (streamed.step, streamed.start, streamed.end) == (Step.SEND_CHUNK, 6, 7), "each new token goes at once"
    plan.on_main_progress(6)
    cut = plan.next(8)
    assert (cut.step, cut.start, cut.end) == (Step.CUT, 7, 8), "the final chunk holds one token, not eight"
