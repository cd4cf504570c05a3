"""Benchmark the batch engine: decode tokens/s by batch size, prefill tokens/s, and a mixed workload
against transformers' own continuous batching (`model.generate_batch`), all in one run.

    python scripts/bench_engine.py                 # SmolLM2, the numbers in docs/engine.md
    python scripts/bench_engine.py --model tiny --batches 1,4 --mixed-requests 4   # a quick look

Every figure goes through the engine's async API (submit, await the future), as RLD and MD use it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.batch_engine import BatchEngine  # noqa: E402
from shared.config import EngineConfig  # noqa: E402
from shared.model_runner import DECODE_ATTENTION_CHOICES, DecodeSequence, ModelRunner  # noqa: E402
from shared.models import load_model, resolve_model  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402


@dataclass(frozen=True)
class BenchConfig:
    model: str
    dtype: str
    decode_attention: str
    threads: int
    batches: tuple[int, ...]
    context_tokens: int
    decode_tokens: int
    prefill_prompts: int
    prefill_prompt_tokens: int
    chunk_tokens: int
    max_batch_tokens: int
    mixed_requests: int
    mixed_min_prompt: int
    mixed_max_prompt: int
    mixed_new_tokens: int
    generate_batch: bool
    repeats: int
    sections: tuple[str, ...]
    json_path: str


def load() -> float:
    return os.getloadavg()[0]


def median_run(results: list[dict]) -> dict:
    """The run with the median tokens/s, plus every run's tokens/s (the machine is shared: runs vary)."""
    ordered = sorted(results, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "runs_tokens_per_s": [round(r["tokens_per_s"], 1) for r in results]}


def random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


async def serve(engine: BatchEngine, runner: ModelRunner, key: str, prompt_ids: list[int], new_tokens: int,
                prefilled: asyncio.Event | None = None, go: asyncio.Event | None = None) -> list[int]:
    """One request: KV for the prompt through the engine (chunked), then decode to `new_tokens`."""
    seq = DecodeSequence(key, prompt_ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                         runner.max_context_tokens)
    try:
        await engine.open(key, [], seq.kv_tokens_needed, seq)
        await engine.extend(key, prompt_ids[:-1])
        if prefilled is not None:
            prefilled.set()
        if go is not None:
            await go.wait()
        return await engine.decode(seq, [prompt_ids[-1]])
    finally:
        engine.release(key)


async def bench_decode(engine: BatchEngine, runner: ModelRunner, config: BenchConfig, batch: int) -> dict:
    rng = random.Random(batch)
    prompts = [random_prompt(rng, runner.config.vocab_size, config.context_tokens) for _ in range(batch)]
    prefilled = [asyncio.Event() for _ in prompts]
    go = asyncio.Event()
    tasks = [asyncio.create_task(serve(engine, runner, f"d{batch}-{i}", p, config.decode_tokens, prefilled[i], go))
             for i, p in enumerate(prompts)]
    await asyncio.gather(*(e.wait() for e in prefilled))
    steps0, rows0, forward_s0 = engine.steps, engine.rows, engine.forward_s
    t0, cpu0 = time.perf_counter(), time.process_time()
    go.set()
    outputs = await asyncio.gather(*tasks)
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(len(o) for o in outputs)
    steps = engine.steps - steps0
    return {"batch": batch, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "cpu_s": cpu_s, "tokens_per_cpu_s": tokens / cpu_s,
            "steps": steps, "step_ms": 1000 * elapsed / max(1, steps),
            "forward_ms": 1000 * (engine.forward_s - forward_s0) / max(1, steps),
            "mean_batch": (engine.rows - rows0) / max(1, steps)}


async def bench_prefill(engine: BatchEngine, runner: ModelRunner, config: BenchConfig, prompts: int) -> dict:
    rng = random.Random(100 + prompts)
    kv_ids = [random_prompt(rng, runner.config.vocab_size, config.prefill_prompt_tokens) for _ in range(prompts)]

    async def prefill(key: str, ids: list[int]) -> None:
        await engine.open(key, [], len(ids))
        try:
            for start in range(0, len(ids), config.chunk_tokens):  # as P does: one chunk, its KV out, the next
                await engine.submit(key, ids[start:start + config.chunk_tokens], sample=False, return_kv=True)
        finally:
            engine.release(key)

    steps0 = engine.steps
    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(prefill(f"p{prompts}-{i}", ids) for i, ids in enumerate(kv_ids)))
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = prompts * config.prefill_prompt_tokens
    return {"prompts": prompts, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "cpu_s": cpu_s, "tokens_per_cpu_s": tokens / cpu_s,
            "steps": engine.steps - steps0}


def mixed_workload(config: BenchConfig, vocab: int) -> list[list[int]]:
    rng = random.Random(2024)
    return [random_prompt(rng, vocab, rng.randint(config.mixed_min_prompt, config.mixed_max_prompt))
            for _ in range(config.mixed_requests)]


async def bench_mixed(engine: BatchEngine, runner: ModelRunner, config: BenchConfig,
                      prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
    t0, cpu0 = time.perf_counter(), time.process_time()
    outputs = await asyncio.gather(*(serve(engine, runner, f"m{i}", p, config.mixed_new_tokens)
                                     for i, p in enumerate(prompts)))
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    generated = sum(len(o) for o in outputs)
    return {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "generated_tokens": generated,
            "seconds": elapsed, "tokens_per_s": generated / elapsed, "cpu_s": cpu_s}, outputs


def bench_generate_batch(path: Path, config: BenchConfig, prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
    """transformers' continuous batching on the same prompts, its paged cache sized for the workload
    (left to itself on a CPU it sizes the cache from the machine's free RAM and zeroes all of it)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_model(path, "float32", "cpu")
    page = 256
    pages = sum(-(-(len(p) + config.mixed_new_tokens) // page) for p in prompts)
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=pages + 8, max_batch_tokens=config.max_batch_tokens)
    generation = GenerationConfig(do_sample=False, max_new_tokens=config.mixed_new_tokens, eos_token_id=-1,
                                  pad_token_id=0)
    t0, cpu0 = time.perf_counter(), time.process_time()
    results = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=cb,
                                   warmup=False)
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    outputs = [list(r.generated_tokens) for r in results.values()]
    generated = sum(len(o) for o in outputs)
    return {"requests": len(prompts), "generated_tokens": generated, "seconds": elapsed,
            "tokens_per_s": generated / elapsed, "cpu_s": cpu_s}, outputs


async def run(config: BenchConfig) -> dict:
    torch.set_num_threads(config.threads)
    path = resolve_model(config.model)
    runner = ModelRunner(load_model(path, config.dtype, "cpu"), config.decode_attention)
    engine = BatchEngine(runner, EngineConfig(max_batch_tokens=config.max_batch_tokens,
                                              torch_threads=config.threads), name="bench")
    report: dict = {"model": config.model, "dtype": config.dtype, "threads": config.threads, "load_before": load(),
                    "decode_attention": "kernel" if runner.decode_attention else "sdpa",
                    "config": {k: v for k, v in vars(config).items() if k != "json_path"}}
    try:
        await serve(engine, runner, "warmup", random_prompt(random.Random(0), runner.config.vocab_size, 64), 4)
        report["decode"] = []
        for batch in config.batches if "decode" in config.sections else ():
            runs = []
            for _ in range(config.repeats):
                runs.append(await bench_decode(engine, runner, config, batch))
                result = runs[-1]
                print(f"decode batch {batch:3d}: {result['tokens_per_s']:7.1f} tokens/s, "
                      f"{result['tokens_per_cpu_s']:7.1f} per CPU-s  ({result['step_ms']:.0f} ms/step, "
                      f"{result['forward_ms']:.0f} ms in the forward, {result['mean_batch']:.1f} rows/step, "
                      f"load {load():.1f})", flush=True)
            report["decode"].append(median_run(runs))
        report["prefill"] = []
        for prompts in (1, config.prefill_prompts) if "prefill" in config.sections else ():
            runs = []
            for _ in range(config.repeats):
                runs.append(await bench_prefill(engine, runner, config, prompts))
                result = runs[-1]
                print(f"prefill {prompts} x {config.prefill_prompt_tokens}: {result['tokens_per_s']:7.1f} tokens/s, "
                      f"{result['tokens_per_cpu_s']:7.1f} per CPU-s ({result['steps']} steps, load {load():.1f})",
                      flush=True)
            report["prefill"].append(median_run(runs))
        if "mixed" in config.sections:
            prompts = mixed_workload(config, runner.config.vocab_size)
            ours, our_outputs = await bench_mixed(engine, runner, config, prompts)
            report["mixed"] = {"pdd": ours}
            print(f"mixed, pdd engine: {ours['seconds']:.1f} s ({ours['cpu_s']:.1f} CPU-s), "
                  f"{ours['tokens_per_s']:.1f} generated tokens/s (load {load():.1f})", flush=True)
    finally:
        engine.shutdown()
    if config.generate_batch and "mixed" in config.sections:
        del runner, engine
        theirs, their_outputs = bench_generate_batch(path, config, prompts)
        report["mixed"]["generate_batch"] = theirs
        report["mixed"]["speedup"] = theirs["seconds"] / ours["seconds"]
        report["mixed"]["cpu_speedup"] = theirs["cpu_s"] / ours["cpu_s"]
        report["mixed"]["same_outputs"] = sum(a == b for a, b in zip(our_outputs, their_outputs))
        print(f"mixed, generate_batch: {theirs['seconds']:.1f} s ({theirs['cpu_s']:.1f} CPU-s), "
              f"{theirs['tokens_per_s']:.1f} generated tokens/s; pdd is {report['mixed']['speedup']:.2f}x "
              f"({report['mixed']['cpu_speedup']:.2f}x in CPU-s); identical outputs {report['mixed']['same_outputs']}"
              f"/{len(prompts)} (load {load():.1f})", flush=True)
    if report["decode"]:
        base = report["decode"][0]["tokens_per_s"]
        report["decode_speedup"] = {r["batch"]: r["tokens_per_s"] / base for r in report["decode"]}
        base_cpu = report["decode"][0]["tokens_per_cpu_s"]
        for r in report["decode"][1:]:
            print(f"decode batch {r['batch']} / batch {report['decode'][0]['batch']}: "
                  f"{report['decode_speedup'][r['batch']]:.2f}x tokens/s, {r['tokens_per_cpu_s'] / base_cpu:.2f}x "
                  f"tokens per CPU-s (batch 1: {1000 / report['decode'][0]['tokens_per_s']:.1f} ms/token)", flush=True)
    report["load_after"] = load()
    return report


def markdown(report: dict) -> str:
    lines = []
    if report["decode"]:
        base_cpu = report["decode"][0]["tokens_per_cpu_s"]
        lines += ["| decode batch | tokens/s (median) | runs | vs batch 1 | tokens per CPU-s | vs batch 1 | ms/step "
                  "| of which forward | rows/step |", "|---|---|---|---|---|---|---|---|---|"]
        for r in report["decode"]:
            lines.append(f"| {r['batch']} | {r['tokens_per_s']:.1f} | {', '.join(map(str, r['runs_tokens_per_s']))} | "
                         f"{report['decode_speedup'][r['batch']]:.2f}x | {r['tokens_per_cpu_s']:.1f} | "
                         f"{r['tokens_per_cpu_s'] / base_cpu:.2f}x | {r['step_ms']:.0f} | {r['forward_ms']:.0f} | "
                         f"{r['mean_batch']:.1f} |")
    if report["prefill"]:
        lines += ["", "| prefill | tokens/s (median) | runs | tokens per CPU-s | steps |", "|---|---|---|---|---|"]
        for r in report["prefill"]:
            lines.append(f"| {r['prompts']} x {r['tokens'] // r['prompts']} tokens | {r['tokens_per_s']:.1f} | "
                         f"{', '.join(map(str, r['runs_tokens_per_s']))} | {r['tokens_per_cpu_s']:.1f} | "
                         f"{r['steps']} |")
    mixed = report.get("mixed", {})
    if mixed:
        lines += ["", "| mixed workload | seconds | CPU-s | generated tokens/s |", "|---|---|---|---|",
                  f"| pdd batch engine | {mixed['pdd']['seconds']:.1f} | {mixed['pdd']['cpu_s']:.1f} | "
                  f"{mixed['pdd']['tokens_per_s']:.1f} |"]
    if "generate_batch" in mixed:
        lines.append(f"| transformers generate_batch | {mixed['generate_batch']['seconds']:.1f} | "
                     f"{mixed['generate_batch']['cpu_s']:.1f} | {mixed['generate_batch']['tokens_per_s']:.1f} |")
        lines.append(f"| ratio (generate_batch / pdd) | {mixed['speedup']:.2f}x | {mixed['cpu_speedup']:.2f}x | "
                     f"same outputs {mixed['same_outputs']}/{mixed['pdd']['requests']} |")
    lines.append(f"\nload average {report['load_before']:.1f} before, {report['load_after']:.1f} after; "
                 f"{report['threads']} torch threads, {report['dtype']}, {report['decode_attention']} decode attention")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", help="float32 (exact, the default) or bfloat16")
    p.add_argument("--decode-attention", default="auto", choices=DECODE_ATTENTION_CHOICES,
                   help="one-token attention: pdd's CPU kernel, torch's SDPA, or auto (the kernel for half precision)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,4,8,16,32")
    p.add_argument("--context-tokens", type=int, default=128, help="prompt length of each decode request")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens each decode request makes")
    p.add_argument("--prefill-prompts", type=int, default=8)
    p.add_argument("--prefill-prompt-tokens", type=int, default=512)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--mixed-requests", type=int, default=32)
    p.add_argument("--mixed-min-prompt", type=int, default=16)
    p.add_argument("--mixed-max-prompt", type=int, default=256)
    p.add_argument("--mixed-new-tokens", type=int, default=32)
    p.add_argument("--no-generate-batch", dest="generate_batch", action="store_false")
    p.add_argument("--repeats", type=int, default=3, help="runs of each decode and prefill figure (median kept)")
    p.add_argument("--sections", default="decode,prefill,mixed")
    p.add_argument("--json", dest="json_path", default="")
    ns = p.parse_args(argv)
    return BenchConfig(ns.model, ns.dtype, ns.decode_attention, ns.threads,
                       tuple(int(b) for b in ns.batches.split(",")),
                       ns.context_tokens,
                       ns.decode_tokens, ns.prefill_prompts, ns.prefill_prompt_tokens, ns.chunk_tokens,
                       ns.max_batch_tokens, ns.mixed_requests, ns.mixed_min_prompt, ns.mixed_max_prompt,
                       ns.mixed_new_tokens, ns.generate_batch, ns.repeats, tuple(ns.sections.split(",")),
                       ns.json_path)


def main() -> None:
    config = parse()
    report = asyncio.run(run(config))
    print()
    print(markdown(report))
    if config.json_path:
        Path(config.json_path).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
