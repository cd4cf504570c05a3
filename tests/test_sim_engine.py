"""The simulated engine (`--engine sim`): its step times follow the roofline, its tokens are a function
of the context alone (batched or not, recomputed or received as KV), each step sleeps its modelled
time, a larger model's shape is served with its KV scaled by --kv-byte-scale, and a real two-datacenter
stack on it (Llama-3-8B's shape, KV and WAN line rate at 1/16) hands off token-exact through P-MD and
P-RLD-MD with the carried KV bytes on the WAN."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
import time

import jsonschema
import pytest
import torch

from shared.batch_engine import BatchEngine
from shared.config import ModelConfig
from shared.model_runner import DecodeSequence
from shared.models import kv_layout, load_tokenizer
from shared.sampling_params import SamplingParams
from shared.sim_checkpoint import carried_kv, load_shape, sim_checkpoint
from shared.sim_runner import SimRunner, build_runner, next_token
from shared.step_timing import (
    DEVICES,
    PROFILES_DIR,
    ModelShape,
    ProfiledTiming,
    Roofline,
    StepRow,
    fit_profile,
    timing_for,
)
from tools.api_client import stream_completion
from tools.bench import cli, cpu, fidelity, report
from tools.bench.modes import MODES, stack_config
from tools.stack_config import MD_KV_ROUTE, StackConfig

from helpers import complete, engine_with, fresh_heartbeats, random_prompt

SCALE = 16
STACK = {"engine": "sim", "sim_device": "h20", "sim_shape": "llama-8b", "kv_byte_scale": SCALE,
         "topology": "two-dc", "wan_bandwidth_mbps": 1000.0}
SMOLLM2_7B_LIKE = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}  # Llama-3-8B's shape


def roofline(device: str = "h100") -> Roofline:
    return Roofline(ModelShape.from_config(SMOLLM2_7B_LIKE), DEVICES[device])


def test_decode_is_memory_bound_and_prefill_compute_bound_as_the_roofline_says():
    model = roofline()
    shape, device = model.model, model.device
    weights_s = (shape.body_params + shape.head_params) * 2 / (device.memory_bytes_per_s * device.memory_efficiency)
    one = model.step_s([StepRow(0, 1)]) - device.step_overhead_s
    assert one == pytest.approx(weights_s, rel=0.01), "one short decode row: the weights' read"
    eight = model.step_s([StepRow(0, 1)] * 8) - device.step_overhead_s
    assert eight < 1.05 * one, "decode rows share the weights' read"
    long_context = model.step_s([StepRow(32768, 1)] * 8) - device.step_overhead_s
    kv_s = 8 * 32769 * shape.kv_bytes_per_token / (device.memory_bytes_per_s * device.memory_efficiency)
    assert long_context == pytest.approx(weights_s + kv_s, rel=0.02), "each row's KV is read once"
    prefill = model.step_s([StepRow(0, 8192)]) - device.step_overhead_s
    double = model.step_s([StepRow(0, 16384)]) - device.step_overhead_s
    assert prefill > 10 * weights_s, "a long prefill is compute bound"
    assert 2.0 < double / prefill < 2.6, "linear in tokens, plus attention's quadratic part"
    h20 = roofline("h20").step_s([StepRow(0, 8192)]) - device.step_overhead_s
    assert h20 / prefill == pytest.approx(989 / 148, rel=0.01), "compute bound: the ratio of peak FLOPs"
    h20_decode = roofline("h20").step_s([StepRow(4096, 1)] * 16) - device.step_overhead_s
    h100_decode = model.step_s([StepRow(4096, 1)] * 16) - device.step_overhead_s
    assert h100_decode / h20_decode == pytest.approx(4.0 / 3.35, rel=0.01), "memory bound: the ratio of bandwidth"


def test_a_profile_fit_recovers_its_coefficients_and_round_trips(tmp_path):
    truth = (0.004, 0.0002, 0.00003, 5e-8, 1e-8, 0.002)
    samples = []
    for rows in ([StepRow(100, 1)] * 4, [StepRow(500, 1)] * 16, [StepRow(0, 256)], [StepRow(0, 64), StepRow(40, 1)],
                 [StepRow(1000, 1)] * 2, [StepRow(3000, 1)] * 3, [StepRow(256, 128)], [StepRow(1024, 512)]):
        exact = ProfiledTiming("m", "d", truth, 1).step_s(rows)
        samples.append((rows, exact))
    fitted = fit_profile("m", "d", 1, samples)
    assert fitted.coefficients == pytest.approx(truth, rel=1e-6)
    fitted.save(tmp_path / "p.json")
    loaded = timing_for({}, 2, "", str(tmp_path / "p.json"))
    assert loaded.step_s([StepRow(300, 7)]) == pytest.approx(fitted.step_s([StepRow(300, 7)]))


def test_the_shipped_cpu_profile_loads_and_grows_with_the_step():
    profile = ProfiledTiming.load(PROFILES_DIR / "smollm2-cpu.json")
    assert len(profile.samples) >= 10 and all(c >= 0 for c in profile.coefficients)
    for *features, measured_s in profile.samples:  # the fit stays near what was measured
        assert profile.coefficients[0] + sum(c * x for c, x in zip(profile.coefficients[1:], features)) \
            == pytest.approx(measured_s, rel=0.35)
    small = profile.step_s([StepRow(128, 1)])
    assert timing_for({}, 4, "h100", "smollm2-cpu").step_s([StepRow(128, 1)]) == small, "--sim-profile by name"
    assert 0 < small < profile.step_s([StepRow(128, 1)] * 16) < profile.step_s([StepRow(0, 512)])


def test_kv_byte_scale_divides_the_head_dim_then_the_kv_heads_then_the_layers():
    assert carried_kv(80, 8, 128, 1) == (80, 8, 128)
    assert carried_kv(80, 8, 128, 16) == (80, 8, 8)
    assert carried_kv(80, 8, 128, 64) == (80, 4, 4)  # the head dim keeps the sim's 3 digits (at least 4)
    assert carried_kv(80, 8, 128, 5) == (16, 8, 128)
    with pytest.raises(ValueError, match="power of two"):
        carried_kv(80, 8, 128, 3)


def test_a_sim_checkpoint_serves_a_larger_shape_with_scaled_kv_and_the_models_tokenizer(tiny_path, tmp_path):
    path = sim_checkpoint(tiny_path, "llama-70b", SCALE, home=tmp_path)
    assert sim_checkpoint(tiny_path, "llama-70b", SCALE, home=tmp_path) == path, "made once, then reused"
    assert not list(path.glob("*.safetensors")), "no weights: only the sim can serve it"
    assert len(load_tokenizer(path)) == len(load_tokenizer(tiny_path))
    _, shape = load_shape("llama-70b")
    modelled_bytes = 80 * 2 * 8 * 128 * 2  # Llama-3-70B's KV per token in bfloat16: 320 KiB
    assert kv_layout(path).bytes_per_token_fp32 // 2 == modelled_bytes // SCALE, "the KV layout peers agree on"
    runner = build_runner(ModelConfig(model=str(path), dtype="bfloat16", engine="sim", sim_device="h20"), path)
    assert runner.new_kv(10).data.nbytes == 10 * modelled_bytes // SCALE, "what crosses the sockets"
    assert runner.vocab == len(load_tokenizer(tiny_path)), "tokens the tokenizer can spell"
    assert runner.timing == Roofline(ModelShape.from_config(shape, 2), DEVICES["h20"]), "timed as the 70B model"


def test_the_wan_line_rate_is_divided_as_the_kv_bytes_are_and_only_a_sim_scales():
    assert StackConfig(engine="sim", kv_byte_scale=SCALE, wan_bandwidth_mbps=10_000).wan_line_mbps == 625
    assert StackConfig(wan_bandwidth_mbps=100).wan_line_mbps == 100
    for wrong in ({"kv_byte_scale": SCALE}, {"sim_shape": "llama-70b"}, {"engine": "sim", "kv_byte_scale": 0},
                  {"engine": "sim", "kv_byte_scale": 2, "wan_trace": "trace.csv"}):
        with pytest.raises(ValueError):
            StackConfig(**wrong)  # type: ignore[arg-type]


def test_pdd_bench_runs_every_mode_on_the_sim_and_says_its_bytes_are_scaled(tmp_path):
    parser = argparse.ArgumentParser(prog="pdd")
    cli.add_bench_parser(parser.add_subparsers(dest="command"))
    cfg = cli.config_from_args(parser.parse_args(
        ["bench", "--scenario", "paper", "--engine", "sim", "--sim-profile", "smollm2-cpu", "--sim-shape", "llama-70b",
         "--kv-byte-scale", str(SCALE), "--wan-bandwidth-mbps", "10000", "--out", str(tmp_path)]))
    for mode in cfg.modes:
        stack = stack_config(MODES[mode], cfg, tmp_path)
        assert (stack.engine, stack.sim_profile, stack.sim_shape, stack.kv_byte_scale) == (
            "sim", "smollm2-cpu", "llama-70b", SCALE)
        assert not MODES[mode].two_dc or stack.wan_line_mbps == 10_000 / SCALE
    note = report._sim_note({"engine": "sim", "sim_profile": "smollm2-cpu", "kv_byte_scale": SCALE})
    assert "profile smollm2-cpu" in note and f"scaled by 1/{SCALE}" in note


def test_the_bench_counts_a_processs_cpu_seconds_with_its_children():
    burn = "import sys, time\nwhile time.process_time() < 0.2: pass\nprint(flush=True)\nsys.stdin.read()"
    shell = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
                              f"{burn!r}])"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        shell.stdout.readline()  # the grandchild has burnt its 0.2 s
        used = cpu.cpu_seconds({"shell": shell.pid})
        assert used["shell"] >= 0.2 and cpu.CLIENT in used
        assert cpu.used_between({"shell": 5.0}, used)["shell"] == round(used["shell"], 3), "a restart counts from 0"
    finally:
        shell.communicate(b"", timeout=30)


def fidelity_run(ttft_ms: float, tpot_ms: float, pipelines: dict[str, int]) -> dict:
    return {"workload": {"name": "sessions"}, "mode": "pdd", "cpu_s": {"main": 10.0},
            "requests": [{"sent_at": 100.0, "e2e_s": 10.0}],
            "metrics": {"duration_s": 10.0, "ttft_ms": {"mean": ttft_ms, "p90": ttft_ms}, "tpot_ms": {"mean": tpot_ms},
                        "itl_ms": {"median": tpot_ms}, "pdd": {"pipelines": pipelines, "relay_token_share": 0.06}}}


def test_the_fidelity_table_joins_real_and_sim_runs_and_counts_what_is_within_tolerance(tmp_path):
    real = {("sessions", "pdd"): fidelity_run(1000, 100, {"p-rld-md": 16})}
    sim = {("sessions", "pdd"): fidelity_run(800, 95, {"p-rld-md": 16})}
    table, within, cells = fidelity.fidelity_table(real, sim, tolerance=0.15)
    assert (within, cells) == (1, 3), "TTFT mean and P90 are 20 % off, TPOT 5 %"
    assert "1,000 / 800 (**-20 %**)" in table and "100 / 95 (-5 %)" in table and "p-rld-md 16" in table
    steps = [{"kind": "step", "t_ns": int(105e9), "end_ns": int(105e9) + 120_000_000, "cpu_ns": 100_000_000},
             {"kind": "step", "t_ns": int(200e9), "end_ns": int(200e9) + 500_000_000, "cpu_ns": 100_000_000}]
    (tmp_path / "main.jsonl").write_text("".join(json.dumps(e) + "\n" for e in steps))
    assert "1, 0.1 / 0.1 s = 1.20" in fidelity.step_waits(real, [tmp_path / "main.jsonl"]), "only the run's window"


@pytest.fixture(scope="module")
def sim(tiny_path) -> SimRunner:
    timing = timing_for(json.loads((tiny_path / "config.json").read_text()), 4, "h20", "")
    return SimRunner(tiny_path, "float32", "cpu", timing)


def sequence(runner: SimRunner, key: str, prompt_ids: list[int], max_tokens: int) -> DecodeSequence:
    return DecodeSequence(key, prompt_ids, SamplingParams(max_tokens=max_tokens), runner.max_context_tokens)


async def decode(engine: BatchEngine, runner: SimRunner, key: str, prompt_ids: list[int], max_tokens: int,
                 parts: list[torch.Tensor], eager_ids: list[int] = ()) -> list[int]:
    seq = sequence(runner, key, prompt_ids, max_tokens)
    await engine.open(key, parts, seq.kv_tokens_needed, seq)
    try:
        seq.output_ids.extend(eager_ids)
        return await engine.decode(seq, [prompt_ids[-1], *eager_ids])
    finally:
        engine.release(key)


def prompt_kv(runner: SimRunner, prompt_ids: list[int]) -> list[torch.Tensor]:
    """What P sends: the KV of every prompt token but the last, made by a forward of its own."""
    kv = runner.new_kv(len(prompt_ids) - 1)
    runner.forward(kv, prompt_ids[:-1])
    return [kv.slice(0, kv.length)]


def reference(runner: SimRunner, prompt_ids: list[int], n: int) -> list[int]:
    """The sim's tokens by its definition, one at a time."""
    ids, out = list(prompt_ids), []
    for _ in range(n):
        out.append(next_token(ids, len(ids) - 1, runner.vocab, runner.avoid))
        ids.append(out[-1])
    return out


async def test_sim_tokens_depend_on_the_context_only_batched_received_or_handed_off(sim):
    prompts = [random_prompt(seed, n) for seed, n in ((1, 3), (2, 40), (3, 9), (4, 70))]
    with engine_with(sim) as engine:
        alone = [await decode(engine, sim, f"a{i}", p, 12, prompt_kv(sim, p)) for i, p in enumerate(prompts)]
        batched = await asyncio.gather(*(decode(engine, sim, f"b{i}", p, 12, prompt_kv(sim, p))
                                         for i, p in enumerate(prompts)))
        assert max(engine.batch_sizes) >= 2
        # P's KV of the prompt (all but its last token), made on another engine, sent in bfloat16 as MD receives it
        with engine_with(sim) as prefill:
            await prefill.open("p", [], len(prompts[3]) - 1)
            kv = await prefill.submit("p", prompts[3][:-1], sample=False, return_kv=True)
            prefill.release("p")
        received = await decode(engine, sim, "md", prompts[3], 12, [kv.to(torch.bfloat16)])
        # MD's extend of RLD's first 5 eager tokens
        handed = await decode(engine, sim, "handoff", prompts[3], 12, [kv], alone[3][:5])
    for prompt_ids, one, many in zip(prompts, alone, batched):
        assert one == many == reference(sim, prompt_ids, 12)
    assert received == alone[3]
    assert handed == alone[3]  # the eager tokens, then MD's own
    assert len({t for out in alone for t in out}) > 20, "tokens vary"
    assert not sim.avoid & {t for out in alone for t in out}


def slow_timing(tiny_path) -> Roofline:
    """A slow device, so each step is long against the engine's own overhead."""
    slow = dataclasses.replace(DEVICES["h20"], name="slow", step_overhead_s=0.02)
    return Roofline(ModelShape.from_config(json.loads((tiny_path / "config.json").read_text()), 4), slow)


async def test_a_sim_step_sleeps_its_modelled_time(tiny_path):
    timing = slow_timing(tiny_path)
    runner = SimRunner(tiny_path, "float32", "cpu", timing)
    prompt_ids = random_prompt(5, 20)
    parts = prompt_kv(runner, prompt_ids)
    steps_before, modelled_before_s = runner.steps, runner.modelled_s
    with engine_with(runner) as engine:
        started = time.perf_counter()
        await decode(engine, runner, "r", prompt_ids, 10, parts)
        wall_s = time.perf_counter() - started
        stats = engine.stats()
    modelled_s = stats["sim_modelled_s"] - modelled_before_s
    assert stats["sim_steps"] - steps_before == stats["engine_steps"] == 10
    assert modelled_s == pytest.approx(sum(timing.step_s([StepRow(19 + i, 1)]) for i in range(10)), rel=1e-6)
    assert modelled_s >= 0.2, "ten steps of at least the device's overhead each"
    # the upper bounds leave room for a loaded machine's late wake-ups (the suite runs on two workers)
    assert modelled_s <= stats["forward_s"] + 0.001 <= modelled_s + 1.0, "each forward lasted its modelled time"
    assert modelled_s <= wall_s < modelled_s + 5.0


async def test_with_sim_wait_cpu_a_step_spends_its_modelled_time_on_a_core(tiny_path):
    """`--sim-wait cpu`: each step's modelled time is CPU time of the engine thread (sleep would
    spend almost none), so a sim tier on a shared core slows its neighbours as a real one does."""
    timing = slow_timing(tiny_path)
    runner = SimRunner(tiny_path, "float32", "cpu", timing, wait="cpu")
    prompt_ids = random_prompt(6, 20)
    parts = prompt_kv(runner, prompt_ids)
    modelled_before_s = runner.modelled_s
    with engine_with(runner) as engine:
        cpu_before_s = time.process_time()
        await decode(engine, runner, "r", prompt_ids, 10, parts)
        cpu_s = time.process_time() - cpu_before_s
    modelled_s = runner.modelled_s - modelled_before_s
    assert modelled_s >= 0.2
    assert cpu_s >= modelled_s
    with pytest.raises(ValueError, match="sim-wait"):
        SimRunner(tiny_path, "float32", "cpu", timing, wait="spin")


async def test_a_sim_stack_hands_off_token_exact_with_the_scaled_kv_on_the_wan(stack, session, sim):
    prompt_ids = random_prompt(11, 30)
    wan_before = (await stack.wan.stats())["routes"][MD_KV_ROUTE]["a_to_b"]["bytes"]
    md = await complete(session, stack, prompt_ids, 16, pipeline="p-md")
    wan_bytes = (await stack.wan.stats())["routes"][MD_KV_ROUTE]["a_to_b"]["bytes"] - wan_before
    split = await complete(session, stack, prompt_ids, 16, pipeline="p-rld-md", handoff_at=6)
    assert set(md.tiers) == {"main"}
    main_kv = md.summary["kv"]["main"]  # the prompt's KV crossed P's socket to MD (or came from MD's DRC)
    assert main_kv["cached_tokens"] + main_kv["kv_tokens"] == len(prompt_ids) - 1 and main_kv["kv_tokens"] > 0
    carried = 32 * 2 * 8 * 128 * 4 // SCALE  # Llama-3-8B's KV per token in float32, scaled
    assert main_kv["kv_bytes"] == main_kv["kv_tokens"] * carried
    assert main_kv["kv_bytes"] <= wan_bytes < 2 * main_kv["kv_bytes"], "the carried KV crossed the WAN (and headers)"
    assert split.tiers == ["relay"] * 6 + ["main"] * 10 and split.handoff["eager_tokens"] == 6
    assert md.token_ids == split.token_ids == reference(sim, prompt_ids, 16)
    beats = await fresh_heartbeats(stack.nats_url)
    for role in ("prefill", "relay", "main"):
        assert beats[role].stats["sim_steps"] > 0 and beats[role].stats["sim_modelled_s"] > 0


COLOURS = {"type": "object", "properties": {"colours": {
    "type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 8, "maxItems": 8}},
    "required": ["colours"], "additionalProperties": False}


async def test_a_schema_seeded_sampling_and_logprobs_work_on_the_sims_logits(stack, session):
    def body(pipeline: str, **extra: object) -> dict:
        return {"prompt": random_prompt(12, 20), "max_tokens": 80, "temperature": 0.9, "seed": 5, "logprobs": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOURS}},
                "pdd": {"pipeline": pipeline, **extra}}

    alone = await stream_completion(session, stack.api_url, body("p-md"))
    split = await stream_completion(session, stack.api_url, body("p-rld-md", handoff_at=6))
    assert split.token_ids == alone.token_ids and split.tiers[:6] == ["relay"] * 6
    jsonschema.validate(json.loads(alone.text), COLOURS)
    assert alone.finish_reason == "stop"
    logprobs = [[value for chunk in result.logprobs for value in chunk["token_logprobs"]] for result in (alone, split)]
    assert len(logprobs[0]) == len(alone.token_ids) and all(value <= 0 for value in logprobs[0])
    assert logprobs[1] == pytest.approx(logprobs[0], abs=1e-4), "the same logits on RLD and MD"
