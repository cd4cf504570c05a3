"""Measure a step-time profile for `--engine sim --sim-profile` (shared/step_timing.py) on this machine.

    python scripts/profile_engine.py --model smollm2 --out shared/sim_profiles/smollm2-cpu.json

Times our own runner's packed forward (`ModelRunner.forward_packed`, what the sim's forward replaces)
over a grid of steps: decode batches at several contexts, prefill chunks over cached prefixes, and mixed
steps, each on the runner of the tier that runs it (a prefill chunk alone on P's, which neither pads nor
splits its linears' calls: shared/cpu_linears.py; every other step on a decoder's); fits step_s = a + b*rows +
c*tokens + d*positions attended by short rows (decode) + e*by long ones (prefill chunks) + f*tail tokens
(shared/step_timing.py) on relative error, and writes samples and fit.
Cached KV holds random values (timing does not depend on them). About three and a half minutes on two cores.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.model_runner import KERNEL_ROW_TOKENS, ModelRunner, PackedRow  # noqa: E402
from shared.models import load_model, resolve_model  # noqa: E402
from shared.step_timing import PROFILE_FEATURES, StepRow, fit_profile  # noqa: E402

# (past, new) per row. Decode batches of 1 to 4 rows (what a decoder runs at the paper preset's 4 concurrent
# requests) at contexts to 3,072 and of mixed contexts, larger batches, prefill chunks alone and over cached
# prefixes to 3,072 (P's suffixes after a prefix-cache hit), P's chunk beside decode rows, and MD's extend of
# eager tokens beside its decode rows.
GRID: list[list[tuple[int, int]]] = [
    *([(past, 1)] * batch for batch in (1, 2, 3, 4) for past in (128, 1024, 2048, 3072)),
    *([(past, 1)] * batch for batch in (16, 32) for past in (128, 1024)),
    [(128, 1), (1024, 1)], [(1024, 1), (3072, 1)], [(512, 1), (1536, 1), (3072, 1)],
    [(256, 1), (1024, 1), (2048, 1), (3072, 1)], [(1024, 1)] * 4 + [(2048, 1)] * 4,
    *([(past, chunk)] for chunk in (64, 256, 512) for past in (0, 1024)),
    *([(past, chunk)] for chunk in (64, 128, 256) for past in (2048, 3072)),
    [(0, 256)] + [(512, 1)] * 8,
    [(2048, 16)] + [(1024, 1)] * 3,
]


def step_s(runner: ModelRunner, shape: list[tuple[int, int]], repeats: int) -> float:
    """Median seconds of one packed forward of rows `shape`, each row's KV prefilled with random values."""
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        rows = []
        for past, new in shape:
            kv = runner.new_kv(past + new)
            kv.data[:, :, :, :past] = torch.randn_like(kv.data[:, :, :, :past]) * 0.1
            kv.length = past
            rows.append(PackedRow(kv, [100 + i % 1000 for i in range(new)], want_logits=True))
        started = time.perf_counter()
        runner.forward_packed(rows)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the launcher gives each model "
                                                               "process a third of the cores, at least one)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device-name", default="", help="what the profile names as its device (default: this CPU)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    runner = ModelRunner(load_model(path, args.dtype, "cpu"))
    p_runner = ModelRunner(load_model(path, args.dtype, "cpu"), row_invariant=False)
    samples = []
    for shape in GRID:
        seconds = step_s(p_runner if len(shape) == 1 and shape[0][1] > 1 else runner, shape, args.repeats)
        rows = [StepRow(past, new) for past, new in shape]
        samples.append((rows, seconds))
        print(f"rows {len(rows):3d}  tokens {sum(n for _, n in shape):4d}  past {min(p for p, _ in shape):5d}"
              f"-{max(p for p, _ in shape):<5d}  "
              f"{seconds * 1000:8.1f} ms", flush=True)
    device = args.device_name or f"{platform.processor() or platform.machine()}, {args.threads} thread(s), {args.dtype}"
    # the runner attends rows of up to KERNEL_ROW_TOKENS token by token with its kernel, else only decode rows
    short_row_tokens = KERNEL_ROW_TOKENS if runner.decode_attention is not None else 1
    profile = fit_profile(args.model, device, short_row_tokens, samples)
    profile.save(args.out)
    worst = max(abs(profile.step_s(rows) - s) / s for rows, s in samples)
    print(f"fit {dict(zip(PROFILE_FEATURES, profile.coefficients))}; "
          f"worst error {worst:.0%}; written to {args.out}")


if __name__ == "__main__":
    main()
