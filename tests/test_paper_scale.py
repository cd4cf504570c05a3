"""`pdd bench --scenario paper-scale`: the paper's experiment at the paper's scale on the simulated
engine. Its flags resolve to the paper's model class, GPUs, link and cluster in every mode, a flag
given still wins, and the table judges pdd against the DRC alone. No stack starts here."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tools.bench import cli, paper, report
from tools.bench.modes import MODES, stack_config


def bench_config(tmp_path: Path, *flags: str):
    parser = argparse.ArgumentParser(prog="pdd")
    cli.add_bench_parser(parser.add_subparsers(dest="command"))
    return cli.config_from_args(parser.parse_args(["bench", *flags, "--out", str(tmp_path)]))


def test_paper_scale_runs_the_four_modes_on_a_simulated_70b_cluster(tmp_path: Path) -> None:
    cfg = bench_config(tmp_path, "--scenario", "paper-scale")
    assert cfg.modes == ("pdd", "pd-local", "pd-wan", "pd-wan-drc") and cfg.workloads == ("agentic", "mooncake")
    assert cfg.load.max_requests >= 100, "hundreds of requests, so a P99 is not one request"
    assert (cfg.wan.bandwidth_mbps, cfg.wan.rtt_ms) == (10_000, 30)
    scale = cfg.stack.kv_byte_scale
    for name in cfg.modes:
        mode = MODES[name]
        stack = stack_config(mode, cfg, tmp_path)
        assert (stack.engine, stack.sim_shape, stack.dtype) == ("sim", "llama-70b", "bfloat16")
        assert (stack.sim_device_of("prefill"), stack.sim_device_of("relay"), stack.sim_device_of("main")) == (
            "h800", "h20", "h20")
        assert [stack.count_of(r) for r in ("prefill", "relay", "main")] == [2, 1, 4]
        assert mode.instances(stack) == {"prefill": 2, "relay": 1 if mode.relay else 0, "main": 4}
        if mode.two_dc:
            assert stack.wan_line_mbps == 10_000 / scale < 9_000, "the emulator here carries about 9 Gbit/s"


def test_a_flag_given_wins_over_the_scale_preset(tmp_path: Path) -> None:
    cfg = bench_config(tmp_path, "--scenario", "paper-scale", "--instances", "main=2", "--max-requests", "20",
                       "--wan-bandwidth-mbps", "1000", "--sim-devices", "prefill=h100")
    assert dict(cfg.stack.instances) == {"main": 2} and cfg.load.max_requests == 20
    assert cfg.wan.bandwidth_mbps == 1000 and dict(cfg.stack.sim_devices) == {"prefill": "h100"}
    assert cfg.stack.sim_shape == "llama-70b", "what was not given keeps the preset's value"


def test_the_paper_scenario_and_no_scenario_keep_one_real_instance_each(tmp_path: Path) -> None:
    for flags in (("--scenario", "paper"), ()):
        cfg = bench_config(tmp_path, *flags)
        assert cfg.stack.engine == "real" and cfg.stack.instances == () and cfg.stack.sim_devices == ()
        stack = stack_config(MODES["pdd"], cfg, tmp_path)
        assert stack.service_processes() == ["prefill", "relay", "main", "gateway"]


def _run(p99: float, p90: float, mean: float) -> dict[str, object]:
    return {"metrics": {"ttft_ms": {"p99": p99, "p90": p90, "mean": mean}}}


@pytest.mark.parametrize(("drc_p99", "met"), [(1000.0, True), (750.0, False)])
def test_the_table_judges_pdd_against_the_drc_alone(drc_p99: float, met: bool) -> None:
    row = next(r for r in paper.ROWS if "pd-wan-drc" in r.what)
    shown, value = row.measure({"pdd": _run(700, 500, 400), "pd-wan-drc": _run(drc_p99, 1000, 800)})
    assert value == pytest.approx(700 / drc_p99) and row.met is not None and row.met(value) is met
    assert "P99" in shown and "P90 0.50×" in shown and "mean 0.50×" in shown


def test_the_summary_says_which_device_and_how_many_instances_each_role_had() -> None:
    note = report._sim_note({"engine": "sim", "sim_device": "h20", "sim_devices": {"prefill": "h800"},
                             "instances": {"prefill": 2, "relay": 1, "main": 4}, "sim_shape": "llama-70b",
                             "kv_byte_scale": 32})
    assert "h20's roofline (prefill on h800's)" in note and "2 prefill instances, 4 main instances" in note
    assert "relay instances" not in note and "scaled by 1/32" in note
