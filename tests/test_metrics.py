"""Prometheus metrics on every service: the gateway's /metrics on its API port, P's, RLD's and MD's
on --metrics-port. Each test reads every service before and after a few requests and checks that
the counters moved by what the responses themselves report."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.kv_wire import FRAME_HEADER
from tools.launcher import LocalStack
from tools.stack_config import free_port

from helpers import complete

MODEL_ROLES = ("prefill", "relay", "main")
PROMPT = "Metrics should move by exactly what the responses report, no more and no less. " * 4
Samples = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module")
def metrics_ports() -> dict[str, int]:
    return {role: free_port() for role in MODEL_ROLES}


@pytest.fixture(scope="module")
def stack_overrides(metrics_ports: dict[str, int]) -> dict[str, object]:
    return {"extra_args": {role: ["--metrics-port", str(port)] for role, port in metrics_ports.items()}}


@pytest.fixture(scope="module")
def metrics_urls(stack: LocalStack, metrics_ports: dict[str, int]) -> dict[str, str]:
    return {"gateway": f"{stack.api_url}/metrics",
            **{role: f"http://127.0.0.1:{port}/metrics" for role, port in metrics_ports.items()}}


async def scrape(session: aiohttp.ClientSession, metrics_urls: dict[str, str]) -> dict[str, Samples]:
    out: dict[str, Samples] = {}
    for role, url in metrics_urls.items():
        async with session.get(url) as resp:
            assert resp.status == 200 and resp.content_type == "text/plain"
            text = await resp.text()
        out[role] = {(s.name, frozenset(s.labels.items())): s.value
                     for family in text_string_to_metric_families(text) for s in family.samples}
    return out


def delta(before: dict[str, Samples], after: dict[str, Samples], role: str, name: str, **labels: str) -> float:
    """How much a sample moved; labels not named are summed over."""
    def total(samples: Samples) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)
    return total(after[role]) - total(before[role])


async def settled(session: aiohttp.ClientSession, metrics_urls: dict[str, str]) -> dict[str, Samples]:
    """Read again until every role shows no request running: P and MD may still be finishing
    (releasing, aborting) a moment after the client has its last token."""
    for _ in range(100):
        now = await scrape(session, metrics_urls)
        if all(now[role][("pdd_running_requests", frozenset())] == 0 for role in now):
            return now
        await asyncio.sleep(0.1)
    raise AssertionError("requests still running 10 s after the last response")


async def test_requests_tokens_and_kv_bytes_add_up(stack, session, metrics_urls):
    before = await scrape(session, metrics_urls)
    results = [await complete(session, stack, f"[{i}] {PROMPT}", 16, pipeline="p-rld-md", handoff_at=4,
                              md_kv_delay_ms=20) for i in range(3)]
    results += [await complete(session, stack, f"[md {i}] {PROMPT}", 12, pipeline="p-md") for i in range(2)]
    after = await settled(session, metrics_urls)

    assert delta(before, after, "gateway", "pdd_requests_total", pipeline="p-rld-md") == 3
    assert delta(before, after, "gateway", "pdd_requests_total", pipeline="p-md") == 2
    assert delta(before, after, "gateway", "pdd_pipeline_decisions_total", pipeline="p-rld-md") == 3
    assert delta(before, after, "gateway", "pdd_http_responses_total", route="/v1/completions", status="200") == 5
    assert delta(before, after, "gateway", "pdd_ttft_seconds_count", pipeline="p-md") == 2
    gaps = sum(len(r.token_ids) - 1 for r in results[:3])
    assert delta(before, after, "gateway", "pdd_inter_token_seconds_count", pipeline="p-rld-md") == gaps
    assert delta(before, after, "gateway", "pdd_time_per_output_token_seconds_count") == 5
    assert delta(before, after, "gateway", "pdd_policy_main_ready_error_seconds_count") == 5
    assert delta(before, after, "gateway", "pdd_aborts_total", reason="finished") == 5

    tiers = [tier for r in results for tier in r.tiers]
    for tier in ("relay", "main"):
        assert delta(before, after, "gateway", "pdd_output_tokens_total", tier=tier) == tiers.count(tier)
        assert delta(before, after, tier, "pdd_output_tokens_total") == tiers.count(tier)
    assert tiers.count("relay") == 3 * 4

    # the handoff: seen by the client (gateway), handed over (RLD), taken over (MD)
    assert delta(before, after, "gateway", "pdd_handoffs_total") == 3
    assert delta(before, after, "gateway", "pdd_handoff_stall_seconds_count") == 3
    assert delta(before, after, "relay", "pdd_handoffs_total") == 3
    assert delta(before, after, "main", "pdd_handoffs_total") == 3
    assert delta(before, after, "main", "pdd_handoff_extend_seconds_count") == 3
    assert delta(before, after, "relay", "pdd_eager_tokens_sum") == 3 * 4

    # KV: decoders count payload bytes, exactly what each response reports; P also counts each
    # frame's header, so its count is above theirs by a whole number of headers
    for tier in ("relay", "main"):
        payload = sum(r.summary["kv"][tier]["kv_bytes"] for r in results if tier in r.summary["kv"])
        kv_tokens = sum(r.summary["kv"][tier]["kv_tokens"] for r in results if tier in r.summary["kv"])
        assert delta(before, after, tier, "pdd_kv_received_bytes_total") == payload
        sent = delta(before, after, "prefill", "pdd_kv_transfer_bytes_total", target=tier)
        headers = sent - payload
        assert headers > 0 and headers % FRAME_HEADER.size == 0 and headers / FRAME_HEADER.size <= kv_tokens
        assert delta(before, after, "prefill", "pdd_kv_transfers_total", target=tier, outcome="done") == \
            (3 if tier == "relay" else 5)
    assert delta(before, after, "prefill", "pdd_kv_transfers_total", outcome="failed") == 0
    assert delta(before, after, "prefill", "pdd_prefill_seconds_count") == 5
    for role in after:
        assert after[role][("pdd_queue_depth", frozenset())] == 0


async def test_cache_hits_on_p_and_md_are_counted(stack, session, metrics_urls):
    prompt = "[cache] " + PROMPT
    before = await scrape(session, metrics_urls)
    first = await complete(session, stack, prompt, 4, pipeline="p-md")
    await settled(session, metrics_urls)  # its KV enters P's and MD's caches as they finish, after its last token
    second = await complete(session, stack, prompt, 4, pipeline="p-md")
    after = await settled(session, metrics_urls)
    hits = {tier: first.summary["cached_tokens"][tier] + second.summary["cached_tokens"][tier]
            for tier in ("prefill", "main")}
    for tier in ("prefill", "main"):  # the first may share a token or two (BOS) with earlier prompts
        assert second.summary["cached_tokens"][tier] > first.summary["cached_tokens"][tier], (
            f"{tier}'s cache did not serve the repeat: cached tokens first {first.summary['cached_tokens']},"
            f" second {second.summary['cached_tokens']}")
    assert delta(before, after, "prefill", "pdd_cache_hit_tokens_total") == hits["prefill"]
    assert delta(before, after, "main", "pdd_cache_hit_tokens_total") == hits["main"]
    prompt_tokens = first.usage["prompt_tokens"]
    assert delta(before, after, "prefill", "pdd_prompt_tokens_total") == 2 * (prompt_tokens - 1)
    computed = delta(before, after, "prefill", "pdd_prefill_computed_tokens_total")
    assert computed == 2 * (prompt_tokens - 1) - hits["prefill"]


async def test_an_abort_is_counted_where_it_stopped_work(stack, session, metrics_urls):
    # RLD makes both tokens while MD's KV is held back 3 s: the gateway's Abort ("finished on
    # relay": MD made no token) finds P still sending to MD, which P counts, with the transfer it cut
    before = await scrape(session, metrics_urls)
    result = await complete(session, stack, "[abort] " + PROMPT, 2, pipeline="p-rld-md", md_kv_delay_ms=3000)
    after = await settled(session, metrics_urls)
    assert result.tiers == ["relay", "relay"]
    assert delta(before, after, "gateway", "pdd_aborts_total", reason="finished") == 1
    assert delta(before, after, "prefill", "pdd_aborts_total", reason="finished on relay") == 1
    assert delta(before, after, "gateway", "pdd_finished_on_relay_total") == 1
    assert delta(before, after, "prefill", "pdd_relay_finished_kv_bytes_total") > 0
    assert delta(before, after, "prefill", "pdd_kv_transfers_total", target="main", outcome="aborted") == 1
    # RLD needs every KV cell: the Abort may cut RLD's path after its last byte
    assert delta(before, after, "prefill", "pdd_kv_transfers_total", target="relay") == 1
    assert delta(before, after, "gateway", "pdd_handoffs_total") == 0


async def test_gateway_reports_live_instances(stack, session, metrics_urls):
    now = await scrape(session, metrics_urls)
    for role in MODEL_ROLES:
        assert now["gateway"][("pdd_live_instances", frozenset({("role", role)}))] == 1


async def test_every_service_froze_its_start_up_heap_and_counts_its_collections(stack, session, metrics_urls):
    """`--gc-freeze on` (the default): start-up's objects (torch, the model) are out of the
    collector's sight in every process, and each reports its collections by generation."""
    await complete(session, stack, PROMPT, 4)
    now = await scrape(session, metrics_urls)
    young = 0.0
    for role in ("gateway", *MODEL_ROLES):
        assert now[role][("pdd_gc_frozen_objects", frozenset())] > 10_000, role
        collections = [now[role][("pdd_gc_collections_total", frozenset({("generation", str(g))}))]
                       for g in range(3)]
        young += collections[0]
        for generation in range(3):
            longest = now[role][("pdd_gc_pause_max_seconds", frozenset({("generation", str(generation))}))]
            assert longest >= 0 and (longest > 0) == (collections[generation] > 0), role
    assert young > 0  # requests allocate: somewhere the youngest generation was collected
