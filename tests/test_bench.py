"""`pdd bench` on real stacks with the tiny model: every available mode and workload runs, and what
it writes is well formed and adds up (tokens by tier, hits, WAN bytes, goodput). No timing claims."""
from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from tools.bench import report
from tools.bench.cli import add_bench_parser, config_from_args, finish_report
from tools.bench.config import (
    AgenticOptions,
    BenchConfig,
    LoadOptions,
    MooncakeOptions,
    Slo,
    StackOptions,
    SyntheticOptions,
    Target,
    WanLink,
)
from tools.bench.metrics import handoff_stall_s, summarize, tpot_s
from tools.bench.modes import MODES, stack_config, unavailable_reason
from tools.bench.replay import RequestRecord
from tools.bench.runner import RunResult, plan_workloads, run_on_stack, run_target
from tools.bench.workloads import agentic_workload, mooncake_workload, synthetic_workload
from tools.launcher import LocalStack

# Modes whose stacks differ only in the gateway's default pipeline share one: their requests name
# their pipeline (or leave it to the policy), and each mode replays its own tokens (its own seed).
STACK_GROUPS = {"pd-local": ("pd-local",), "pd-wan": ("pd-wan",),
                "pdd": ("pdd", "pd-wan-drc", "pdd-oneshot", "pdd-catchup")}
HIT_RATES = (0.0, 0.9)
PEER = "gateway-as-peer"  # pd-local's gateway, measured as --target-url measures any other server


def small_config(out_dir: Path) -> BenchConfig:
    return BenchConfig(
        modes=(*MODES, "colocated"), workloads=("agentic", "mooncake", "synthetic"), hit_rates=HIT_RATES,
        out_dir=out_dir,
        stack=StackOptions(model="tiny", torch_threads=1, chunk_tokens=64, startup_timeout_s=120,
                           log_dir=out_dir / "logs"),
        load=LoadOptions(request_rate=20.0, max_concurrency=3, max_requests=6, request_timeout_s=60,
                         progress=False),
        wan=WanLink(bandwidth_mbps=100, rtt_ms=10),
        slo=Slo(ttft_ms=500, tpot_ms=100),
        agentic=AgenticOptions(prefix_tokens=96, output_tokens=8, turns_per_session=3),
        mooncake=MooncakeOptions(max_input_tokens=256, max_output_tokens=8, time_scale=0.05),
        synthetic=SyntheticOptions(input_tokens=64, output_tokens=8),
    )


@pytest.fixture(scope="module")
async def bench(tmp_path_factory) -> tuple[BenchConfig, list[RunResult]]:
    cfg = small_config(tmp_path_factory.mktemp("bench"))
    groups = {lead: [MODES[m] for m in modes if unavailable_reason(m) is None]
              for lead, modes in STACK_GROUPS.items() if unavailable_reason(lead) is None}
    stacks = {lead: LocalStack(stack_config(MODES[lead], cfg, cfg.stack.log_dir / lead)) for lead in groups}
    results: list[RunResult] = []

    async def run_group(lead: str) -> None:
        for i, mode in enumerate(groups[lead]):
            workloads = plan_workloads(replace(cfg, seed=cfg.seed + i))
            results.extend(await run_on_stack(stacks[lead], mode, workloads, cfg,
                                              lambda r: report.write_result(r, cfg.out_dir)))

    try:
        await asyncio.gather(*(s.start() for s in stacks.values()))
        await asyncio.gather(*(run_group(lead) for lead in groups))
        synthetic = [w for w in plan_workloads(cfg) if w.kind == "synthetic"]
        results.extend(await run_target(Target(PEER, stacks["pd-local"].api_url), synthetic, cfg,
                                        lambda r: report.write_result(r, cfg.out_dir)))
    finally:
        await asyncio.gather(*(s.stop() for s in stacks.values()))
    finish_report(cfg)
    return cfg, results


def test_every_available_mode_ran_every_workload(bench):
    cfg, results = bench
    ran = {(r.mode, r.workload.name) for r in results}
    workloads = [w.name for w in plan_workloads(cfg)]
    assert workloads == ["agentic-h0.00", "agentic-h0.90", "mooncake", "synthetic"]
    for mode in MODES:
        if unavailable_reason(mode) is None:
            assert {(mode, w) for w in workloads} <= ran, mode
    assert all(r.metrics["requests"]["completed"] == r.metrics["requests"]["sent"] > 0 for r in results)


def test_a_target_url_is_measured_by_the_same_client_without_pdd_fields(bench):
    cfg, results = bench
    (peer,) = [r for r in results if r.mode == PEER]
    assert peer.stack["url"].startswith("http://") and peer.metrics["requests"]["completed"] == cfg.load.max_requests
    for q in peer.records:  # no `pdd` object in the requests: pd-local's gateway chose its own default
        assert q.ok and q.pipeline == "p-md" and q.completion_tokens == q.max_tokens and q.ttft_s is not None
    assert peer.metrics["ttft_ms"]["n"] == cfg.load.max_requests and peer.metrics["tpot_ms"]["n"] > 0
    assert f"| {PEER} |" in (cfg.out_dir / report.SUMMARY_FILE).read_text()


async def test_a_server_that_is_not_pdd_is_timed_per_chunk_of_text():
    """What a peer such as vLLM streams: OpenAI chunks, no `pdd` object; each chunk with text is timed."""
    from aiohttp import web

    from tools.api_client import PEER_TIER, stream_completion

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert "pdd" not in body and body["model"] == "smol"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, text in enumerate(["a", "", "b", "c"]):  # an empty chunk (held-back text) is not a token time
            await asyncio.sleep(0.01)
            chunk = {"choices": [{"index": 0, "text": text, "finish_reason": "length" if i == 3 else None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as http:
            result = await stream_completion(http, f"http://127.0.0.1:{port}",
                                             {"prompt": [1, 2, 3], "max_tokens": 4, "model": "smol"})
    finally:
        await runner.cleanup()
    assert result.text == "abc" and result.tiers == [PEER_TIER] * 3 and result.token_ids == []
    assert len(result.token_times_s) == 3 and result.token_times_s == sorted(result.token_times_s)
    assert result.usage["completion_tokens"] == 4 and result.finish_reason == "length"


def test_target_url_parses_name_and_url():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--target-url", "vllm=http://127.0.0.1:8100/v1", "--target-url",
                              "http://10.0.0.1:9000", "--target-model", "smol"])
    cfg = config_from_args(args)
    assert cfg.modes == () and cfg.targets == (Target("vllm", "http://127.0.0.1:8100", "smol"),
                                               Target("10.0.0.1:9000", "http://10.0.0.1:9000", "smol"))
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--target-url", "pdd=127.0.0.1:8000"])  # no scheme


def test_counters_add_up(bench):
    _, results = bench
    for r in results:
        if r.mode == PEER:
            continue
        m, d = r.metrics, r.metrics["pdd"]
        ok = [q for q in r.records if q.ok]
        for q in ok:
            assert sum(q.tokens_by_tier.values()) == q.completion_tokens == len(q.tiers) == q.max_tokens
            assert 0 <= q.prefill_hit_tokens < q.prompt_tokens and 0 <= q.main_hit_tokens < q.prompt_tokens
            assert q.main_kv_bytes >= 0
        assert d["wan_kv_bytes"] == sum(q.main_kv_bytes for q in ok)
        assert d["relay_tokens"] == sum(q.tiers.count("relay") for q in ok)
        assert m["completion_tokens"] == sum(q.completion_tokens for q in ok)
        assert 0 <= m["goodput"] <= m["request_throughput"]
        assert m["requests"]["good"] <= m["requests"]["completed"]
        assert 0 <= d["prefill_hit_rate"] <= 1 and 0 <= d["main_hit_rate"] <= 1
        if r.stack["two_dc"]:  # every byte MD reported crossed the emulator, plus frame headers
            assert d["wan_emulator_a_to_b_bytes"] >= d["wan_kv_bytes"]
        else:
            assert d["wan_emulator_a_to_b_bytes"] is None
        if not r.stack["drc"]:
            assert d["main_hit_rate"] == 0 and d["drc_saved_bytes"] == 0
        if MODES[r.mode].relay is False:
            assert d["relay_tokens"] == 0 and m["cost"]["instances"]["relay"] == 0
            assert d["relay_finished_wan_bytes"] is None
        else:  # P's own count of what crossed for requests RLD finished alone
            assert 0 <= d["relay_finished_wan_bytes"] and 0 <= d["relay_finished_kv_bytes"]
            assert 0 <= d["backfill_wan_bytes"] and (d["backfill_wan_bytes"] == 0 or d["finished_by_relay"] > 0)
            assert d["relay_finished_kv_bytes"] > 0 or d["finished_by_relay"] == 0


def test_drc_keeps_session_kv_off_the_wan(bench):
    _, results = bench
    by = {(r.mode, r.workload.name): r.metrics["pdd"] for r in results}
    if ("pd-wan", "agentic-h0.90") not in by:
        pytest.skip("two-dc modes not available")
    with_drc, without = by[("pd-wan-drc", "agentic-h0.90")], by[("pd-wan", "agentic-h0.90")]
    assert with_drc["main_hit_rate"] > 0.8
    assert with_drc["wan_kv_bytes"] * 4 < without["wan_kv_bytes"]


def test_report_files_are_written(bench):
    cfg, results = bench
    summary = (cfg.out_dir / report.SUMMARY_FILE).read_text()
    assert "## Against the PDD paper" in summary and "| share of tokens made by RLD | 6.2 % |" in summary
    for r in results:
        data = json.loads((cfg.out_dir / r.name / report.RESULTS_FILE).read_text())
        assert data["mode"] == r.mode and len(data["requests"]) == len(r.records)
        assert data["metrics"]["ttft_ms"]["n"] == data["metrics"]["requests"]["completed"]
    summary = (cfg.out_dir / report.SUMMARY_FILE).read_text()
    assert all(f"| {r.mode} |" in summary for r in results)
    assert "colocated" in summary  # listed as not run, with its reason
    pytest.importorskip("matplotlib")
    pngs = {p.name for p in cfg.out_dir.glob("*.png")}
    assert {"wan_bytes_vs_hit.png", "throughput_vs_hit.png", "ttft_cdf_mooncake.png"} <= pngs


def test_agentic_workload_mixes_long_sessions_and_fresh_requests():
    opts = AgenticOptions(hit_rate=0.5, prefix_tokens=256, output_tokens=16, turns_per_session=8)
    w = agentic_workload(opts, 200, 2.0, seed=1)
    assert w == agentic_workload(opts, 200, 2.0, seed=1)
    hits = [r.planned_hit_tokens / r.planned_prompt_tokens for r in w.requests]
    assert abs(sum(hits) / len(hits) - 0.5) < 0.02
    assert sum(h > 0.94 for h in hits) > 0.45 * len(hits) and sum(h == 0 for h in hits) > 0.45 * len(hits)
    assert len(w.warmup) == w.params["sessions"]
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(w.requests, w.requests[1:]))
    high = agentic_workload(replace(opts, hit_rate=0.99), 50, 2.0, seed=1)
    assert all(r.session is not None for r in high.requests) and high.planned_hit_rate > 0.985


def test_agentic_turns_answered_by_tool_calls_are_short_and_the_history_follows():
    opts = AgenticOptions(hit_rate=0.9, prefix_tokens=256, output_tokens=64, turns_per_session=8,
                          max_context_tokens=4096, tool_call_share=0.75, tool_call_tokens=6)
    w = agentic_workload(opts, 32, 2.0, seed=1)
    turns = [r for r in w.requests if r.session is not None]
    assert sorted({r.max_tokens for r in turns}) == [6, 64]
    assert sum(r.max_tokens == 6 for r in turns) == round(0.75 * len(turns)) == w.params["tool_calls"]
    assert {r.max_tokens for r in w.requests if r.session is None} <= {64}, "fresh requests keep the long answer"
    for s in {r.session for r in turns}:  # each turn's history is the last turn's prompt and answer
        own = [r for r in turns if r.session == s]
        for last, nxt in zip(own, own[1:]):
            assert nxt.planned_hit_tokens == last.planned_prompt_tokens + last.max_tokens
    plain = agentic_workload(replace(opts, tool_call_share=0.0), 32, 2.0, seed=1)
    assert {r.max_tokens for r in plain.requests} == {64}
    assert [r.arrival_s for r in plain.requests] == [r.arrival_s for r in w.requests]


def test_mooncake_equal_block_ids_make_equal_prefixes():
    w = mooncake_workload(MooncakeOptions(block_tokens=16, max_input_tokens=4096), 5, seed=0)
    first, second = w.requests[0].new_ids, w.requests[1].new_ids  # both start with block 0
    assert first[:16] == second[:16] and first[16:32] != second[16:32]
    assert w.requests[1].planned_hit_tokens == 16
    assert len(first) == -(-6758 * 16 // 512)


def test_mooncake_outputs_keep_the_traces_lengths_capped():
    w = mooncake_workload(MooncakeOptions(block_tokens=16, max_output_tokens=400), 5, seed=0)
    assert [r.max_tokens for r in w.requests] == [400, 400, 400, 316, 3], "trace: 500, 490, 794, 316, 3"


def test_synthetic_requests_have_fixed_lengths():
    w = synthetic_workload(SyntheticOptions(input_tokens=50, output_tokens=7), 10, float("inf"), seed=3)
    assert {len(r.new_ids) for r in w.requests} == {50} and {r.max_tokens for r in w.requests} == {7}
    assert {r.arrival_s for r in w.requests} == {0.0}


def test_metrics_of_handmade_records():
    rec = RequestRecord(0, None, 0.0, sent_s=0.0, ok=True, prompt_tokens=10, completion_tokens=4, max_tokens=4,
                        token_times_s=[0.1, 0.2, 0.6, 0.7], tiers=["relay", "relay", "main", "main"], e2e_s=0.7,
                        tokens_by_tier={"relay": 2, "main": 2}, main_hit_tokens=5, main_kv_bytes=400)
    assert tpot_s(rec) == pytest.approx(0.2)
    assert handoff_stall_s(rec) == pytest.approx(0.4)
    failed = RequestRecord(1, None, 0.0, sent_s=0.0, error="boom")
    m = summarize([rec, failed], 2.0, slo=Slo(ttft_ms=50), costs=BenchConfig().costs,
                  instances={"prefill": 1, "relay": 1, "main": 1}, kv_bytes_per_token=100)
    assert m["requests"] == {"planned": 2, "sent": 2, "completed": 1, "failed": 1, "good": 0}
    assert m["goodput"] == 0 and m["request_throughput"] == 0.5 and m["bcr"] == 0
    assert m["pdd"]["drc_saved_bytes"] == 500 and m["pdd"]["relay_token_share"] == 0.5
    assert m["itl_ms"]["n"] == 3 and m["ttft_ms"]["median"] == pytest.approx(100)


def test_cli_flags_build_the_config(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--modes", "pd-local,pdd", "--workload", "agentic,synthetic",
                              "--hit-rates", "0,0.5,0.99", "--wan-rtt-ms", "30", "--slo-ttft-ms", "800",
                              "--cost-relay", "0.5", "--out", str(tmp_path)])
    cfg = config_from_args(args)
    assert cfg.modes == ("pd-local", "pdd") and cfg.workloads == ("agentic", "synthetic")
    assert cfg.hit_rates == (0.0, 0.5, 0.99) and cfg.wan.delay_ms == 15 and cfg.slo.ttft_ms == 800
    assert cfg.costs.of({"prefill": 1, "relay": 1, "main": 1}) == 2.5
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--modes", "nonsense"])


def test_placement_flags_reach_every_modes_stack(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args(["bench", "--gateway-dc", "b", "--cpus", "prefill=0",
                                              "--cpus", "relay,main=1", "--out", str(tmp_path)]))
    two_dc, one_dc = stack_config(MODES["pdd"], cfg, tmp_path), stack_config(MODES["pd-local"], cfg, tmp_path)
    assert two_dc.gateway_datacenter == "b" and two_dc.datacenter_of("gateway") == "b"
    assert one_dc.gateway_datacenter == "a", "one datacenter has no B to put the gateway in"
    for config in (two_dc, one_dc):
        assert dict(config.cpu_affinity) == {"prefill": (0,), "relay": (1,), "main": (1,)}
    assert config_from_args(parser.parse_args(["bench", "--out", str(tmp_path)])).stack.cpu_affinity == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--cpus", "decoder=0"])


def test_service_flags_reach_every_modes_stack(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args([
        "bench", "--service-flags", "gateway=--backfill-link-share 0", "--service-flags", "main=--hold-steps 1",
        "--service-flags", "gateway=--warm-prefill-tokens 64", "--out", str(tmp_path)]))
    for mode in ("pdd", "pd-local"):
        extra = stack_config(MODES[mode], cfg, tmp_path).extra_args
        assert extra["gateway"][:4] == ["--backfill-link-share", "0", "--warm-prefill-tokens", "64"]
        assert extra["main"][:2] == ["--hold-steps", "1"]
    for bad in ("decoder=--x 1", "gateway", "gateway='unclosed"):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "--service-flags", bad])


def test_the_paper_scenario_presets_what_was_left_at_its_default(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args(["bench", "--scenario", "paper", "--max-requests", "8",
                                              "--out", str(tmp_path)]))
    assert cfg.modes == ("pdd", "pd-local", "pd-wan", "pd-wan-drc") and cfg.workloads == ("agentic", "mooncake")
    assert (cfg.agentic.prefix_tokens, cfg.agentic.output_tokens, cfg.agentic.max_context_tokens) == (1024, 128, 3200)
    assert (cfg.wan.bandwidth_mbps, cfg.wan.rtt_ms, cfg.slo.ttft_ms, cfg.slo.tpot_ms) == (100, 30, 2000, 150)
    assert cfg.mooncake.max_output_tokens == 128 and cfg.load.request_rate == 0.2
    assert cfg.load.max_requests == 8, "a flag given wins over the preset"
    given_as_default = config_from_args(parser.parse_args(["bench", "--scenario", "paper", "--workload", "agentic",
                                                           "--modes", "pdd", "--out", str(tmp_path)]))
    assert given_as_default.workloads == ("agentic",), "a flag given equal to its default wins as well"
    assert given_as_default.modes == ("pdd",) and given_as_default.agentic.prefix_tokens == 1024
    plain = config_from_args(parser.parse_args(["bench", "--out", str(tmp_path)]))
    assert plain.workloads == ("agentic",) and plain.agentic.prefix_tokens == AgenticOptions().prefix_tokens


def test_plots_need_only_results_json(bench, tmp_path):
    plots = pytest.importorskip("tools.bench.plots")
    cfg, _ = bench
    written = plots.write_plots(report.load_results(cfg.out_dir), tmp_path)
    assert written and all(p.stat().st_size > 1000 for p in written)
