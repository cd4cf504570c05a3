"""Profile one decode step of the model runner: ms per step by batch size, and where the time goes.

    python scripts/profile_engine_step.py --threads 1 --batches 1,16 --context-tokens 512
    python scripts/profile_engine_step.py --model tiny --batches 1,4 --profile   # torch.profiler tables

Each request's KV is filled with random values up to `--context-tokens` (timing does not depend on
the values), then `forward_packed` runs one decode token per request, as the engine's step does,
plus the engine's sampling (greedy). No engine thread, no asyncio: this is the forward alone.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.model_runner import DECODE_ATTENTION_CHOICES, ModelRunner, PackedRow  # noqa: E402
from shared.models import load_model, resolve_model  # noqa: E402
from shared.sampling import sample_tokens  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402


def decode_rows(runner: ModelRunner, batch: int, context_tokens: int, steps: int) -> list:
    kvs = []
    for _ in range(batch):
        kv = runner.new_kv(context_tokens + steps + 1)
        kv.data[:, :, :, :context_tokens].normal_()
        kv.length = context_tokens
        kvs.append(kv)
    return kvs


def step(runner: ModelRunner, kvs: list, params: SamplingParams) -> list[int]:
    logits = runner.forward_packed([PackedRow(kv, [17], True) for kv in kvs])
    return sample_tokens(logits, [params] * len(kvs), [0] * len(kvs))


def time_steps(runner: ModelRunner, batch: int, config: argparse.Namespace) -> dict:
    kvs = decode_rows(runner, batch, config.context_tokens, config.warmup + config.steps + 8)
    params = SamplingParams()
    for _ in range(config.warmup):
        step(runner, kvs, params)
    times = []
    cpu0 = time.process_time()
    for _ in range(config.steps):
        t0 = time.perf_counter()
        step(runner, kvs, params)
        times.append(time.perf_counter() - t0)
    cpu_s = time.process_time() - cpu0
    result = {"batch": batch, "step_ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times),
              "cpu_ms": 1000 * cpu_s / config.steps}
    result["tokens_per_s"] = batch * 1000 / result["step_ms"]
    if config.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step(runner, kvs, params)
        print(f"\n== batch {batch}, 3 steps ==")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=config.rows))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--decode-attention", default="auto", choices=DECODE_ATTENTION_CHOICES,
                   help="one-token attention: pdd's CPU kernel, torch's SDPA, or auto (the kernel for half precision)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--context-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="print torch.profiler's table per batch size")
    p.add_argument("--rows", type=int, default=25)
    config = p.parse_args()
    torch.set_num_threads(config.threads)
    runner = ModelRunner(load_model(resolve_model(config.model), config.dtype, "cpu"), config.decode_attention)
    results = [time_steps(runner, int(b), config) for b in config.batches.split(",")]
    attention = "kernel" if runner.decode_attention else "sdpa"
    print(f"\n{config.model} {config.dtype}, {attention} decode attention, {config.threads} threads, "
          f"context {config.context_tokens}")
    for r in results:
        print(f"batch {r['batch']:3d}: {r['step_ms']:6.1f} ms/step (min {r['min_ms']:.1f}, CPU {r['cpu_ms']:.1f}), "
              f"{r['tokens_per_s']:6.1f} tokens/s, {r['tokens_per_s'] / results[0]['tokens_per_s']:.2f}x batch "
              f"{results[0]['batch']}")


if __name__ == "__main__":
    main()
