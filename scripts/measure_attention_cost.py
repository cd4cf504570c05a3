"""Measure P's --attention-cost-tokens for a model on this machine: the cached context at which a
prompt token's attention costs as much as the rest of its forward.

    python scripts/measure_attention_cost.py --model smollm2 --dtype bfloat16
    python scripts/measure_attention_cost.py --model smollm2 --dtype bfloat16 --contexts 0,1024,2048,3072

It times one prefill chunk (`--chunk-tokens`, as P's engine runs it: `forward_packed`, one row)
over cached contexts of each length, fits time = a + b * context, and prints C = a / b - chunk / 2,
from the cost model the engine's step budget uses: a chunk of t tokens over n cached positions costs
t * (1 + (n + t / 2) / C). The cached KV holds random values (timing does not depend on them).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.model_runner import ModelRunner, PackedRow  # noqa: E402
from shared.models import load_model, resolve_model  # noqa: E402


def chunk_ms(runner: ModelRunner, chunk_tokens: int, context_tokens: int, repeats: int) -> float:
    """Fastest of `repeats` timings of one chunk over a cached context, in ms: noise from other
    work on the machine only ever adds time, so the minimum is the estimate it disturbs least."""
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        kv = runner.new_kv(context_tokens + chunk_tokens)
        kv.data[:, :, :, :context_tokens].normal_()
        kv.length = context_tokens
        _sync(runner.device)
        t0 = time.perf_counter()
        runner.forward_packed([PackedRow(kv, [17] * chunk_tokens, False)])
        _sync(runner.device)
        times.append(time.perf_counter() - t0)
    return 1000 * min(times[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention_cost_tokens(contexts: list[int], times_ms: list[float], chunk_tokens: int) -> float:
    """C from a least-squares line time = a + b * context (see the module's docstring)."""
    fit = statistics.linear_regression(contexts, times_ms)
    if fit.slope <= 0:
        raise ValueError("the chunk's time does not grow with its context: attention is free here (use 0)")
    return fit.intercept / fit.slope - chunk_tokens / 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads; 0 leaves torch's default")
    p.add_argument("--chunk-tokens", type=int, default=256, help="P's --chunk-tokens")
    p.add_argument("--contexts", default="0,1024,2048,3072", help="cached context lengths to time, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    config = p.parse_args()
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    contexts = [int(c) for c in config.contexts.split(",")]
    if len(set(contexts)) < 2:
        p.error("--contexts needs at least two different lengths")
    runner = ModelRunner(load_model(resolve_model(config.model), config.dtype, config.device))
    times = [chunk_ms(runner, config.chunk_tokens, n, config.repeats) for n in contexts]
    print(f"{config.model} {config.dtype} on {runner.device}, a {config.chunk_tokens}-token chunk:")
    for n, ms in zip(contexts, times):
        print(f"  over {n:6d} cached positions: {ms:8.1f} ms")
    try:
        c = attention_cost_tokens(contexts, times, config.chunk_tokens)
    except ValueError as e:
        p.exit(2, f"{e}; on a busy machine, rerun with more --repeats or longer --contexts\n")
    print(f"--attention-cost-tokens {max(1, round(c))}")


if __name__ == "__main__":
    main()
