"""The gateway's pipeline choice and its index of MD caches, as plain logic."""
from __future__ import annotations

import random

import torch

from services.gateway.routing.cache_index import MainCacheIndex
from services.gateway.routing.policy import LinkEstimate, PolicyConfig, choose_pipeline
from shared.radix_cache import RadixCache

CONFIG = PolicyConfig(ttft_slo_s=2.0, budget_fraction=0.5, skip_wan_max_tokens=0,
                      default_link_bytes_per_s=100e6 / 8, default_prefill_tokens_per_s=5000)
KV_BYTES_PER_TOKEN = 46_080  # SmolLM2, fp32


def decide(link_mbps: float, prompt_tokens: int = 2000, hit: int = 0, max_tokens: int = 256,
           config: PolicyConfig = CONFIG) -> str:
    estimate = LinkEstimate(link_mbps * 1e6 / 8, 5000.0, 0.0)
    return choose_pipeline(config, prompt_tokens, max_tokens, hit, KV_BYTES_PER_TOKEN, estimate).pipeline


def test_choice_flips_to_relay_as_bandwidth_drops() -> None:
    # 2,000 uncached tokens = 92 MB: 0.07 s at 10 Gbit/s, 7.4 s at 100 Mbit/s
    assert decide(10_000) == "p-md"
    assert decide(1_000) == "p-md"
    assert decide(100) == "p-rld-md"
    assert decide(10) == "p-rld-md"


def test_choice_flips_to_relay_as_the_main_hit_falls() -> None:
    assert decide(100, hit=1999) == "p-md"
    assert decide(100, hit=1990) == "p-md"  # 9 tokens cross
    assert decide(100, hit=1000) == "p-rld-md"
    assert decide(100, hit=0) == "p-rld-md"


def test_prediction_counts_what_crosses_and_the_queue() -> None:
    estimate = LinkEstimate(10e6, 1000.0, 0.25)
    decision = choose_pipeline(CONFIG, 1001, 64, 500, 1000, estimate)
    assert decision.wan_bytes == 500 * 1000
    assert abs(decision.predicted_main_ready_s - (0.25 + max(0.5, 0.05))) < 1e-9


def test_short_outputs_may_skip_the_wan_only_when_enabled_and_late() -> None:
    skipping = PolicyConfig(2.0, 0.5, skip_wan_max_tokens=4, default_link_bytes_per_s=1e6,
                            default_prefill_tokens_per_s=5000)
    assert decide(100, max_tokens=2, config=skipping) == "p-rld"
    assert decide(100, max_tokens=2, hit=1999, config=skipping) == "p-md", "in time: nothing to skip"
    assert decide(100, max_tokens=64, config=skipping) == "p-rld-md"
    assert decide(100, max_tokens=2) == "p-rld-md", "off by default: P-RLD is never planned"


def test_index_mirrors_the_main_cache_from_its_events() -> None:
    index = MainCacheIndex()
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
    from services.gateway.routing.telemetry import Telemetry, fit_prefill

    assert fit_prefill([(100, 0.2), (100, 0.21)]) is None, "one size says nothing of the slope"
    telemetry = Telemetry()
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
    bare = LinkEstimate(link_bytes_per_s=1e9, prefill_tokens_per_s=1e4, main_queue_s=0.0)
    costly = LinkEstimate(link_bytes_per_s=1e9, prefill_tokens_per_s=1e4, main_queue_s=0.0, prefill_fixed_s=0.2,
                          round_trip_s=0.06)
    small = {"prompt_tokens": 100, "max_tokens": 64, "main_hit_tokens": 60, "kv_bytes_per_token": 46080}
    fast = choose_pipeline(CONFIG, estimate=bare, **small)
    slow = choose_pipeline(CONFIG, estimate=costly, **small)
    assert abs(slow.predicted_main_ready_s - fast.predicted_main_ready_s - 0.26) < 1e-9


def test_routing_forgets_the_cache_of_a_main_found_dead() -> None:
    import time

    from services.gateway.routing.dispatcher import Dispatcher
    from services.gateway.routing.registry import InstanceRegistry
    from shared.config import CommonConfig, GatewayConfig
    from shared.messages import Heartbeat

    def beat(instance_id: str) -> Heartbeat:
        return Heartbeat("main", instance_id, "127.0.0.1", 1, "m", 0, 0, time.time())

    index = MainCacheIndex()
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
    main, hit = dispatcher._choose_main(prompt + [1], avoid=set())
    assert main.heartbeat.instance_id == "md-a" and hit == 64, "routing follows the cached prefix"
    registry.done("md-a")
    registry.mark_gone("md-a")
    assert "md-a" not in index.instances()
    registry.observe(beat("md-a"))  # restarted under the same id, with an empty cache
    main, hit = dispatcher._choose_main(prompt + [1], avoid=set())
    assert hit == 0 and index.hit_tokens("md-a", prompt) == 0, "a dead MD's cache no longer attracts requests"
