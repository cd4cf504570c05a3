"""The kernels under one decode step, alone: what bounds the engine on this machine.

Memory bandwidth (sum and copy of 200 MB), the linears of one SmolLM2 forward (30 layers' q, k, v,
o, gate, up, down and the tied LM head) at a few row counts in float32 and bfloat16, as `F.linear`
and on weights packed once for oneDNN (what the engine does for bfloat16 models), and one
query token's attention over 512 positions: SDPA in each dtype, bfloat16 upcast to float32, and
pdd's decode attention kernel (shared/cpu_attention), on one request's KV again and again (hot in
the caches) and, as in a decode step, on 16 requests x 30 layers of separate KV (cold). Apart from
that kernel nothing of pdd is imported: these are torch's kernels as the engine calls them.

    .venv/bin/python scripts/bench_kernels.py --threads 1
    .venv/bin/python scripts/bench_kernels.py --threads 2
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared import cpu_attention  # noqa: E402

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, 30 layers, vocab 49152
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SHAPES = LAYER * 30 + [(49152, 576)]


def per_call_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def bandwidth() -> None:
    a = torch.empty(50_000_000)
    b = torch.empty_like(a)
    a.normal_()
    print(f"sum of 200 MB: {200e6 / per_call_s(a.sum, 5) / 1e9:.0f} GB/s; "
          f"copy of 200 MB: {400e6 / per_call_s(lambda: b.copy_(a), 5) / 1e9:.0f} GB/s (read + write)")


def linears(rows: list[int]) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(out, inp).to(dtype) for out, inp in SHAPES]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        packs = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        for m in rows:
            x = {n: torch.randn(m, n).to(dtype) for n in (576, 1536)}
            s = per_call_s(lambda: [F.linear(x[w.shape[1]], w) for w in weights], 5)
            packed = per_call_s(lambda: [torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "")
                                         for w, p in zip(weights, packs)], 5)
            print(f"linears of one forward, {str(dtype)[6:]:8} M={m:3}: {s * 1e3:6.1f} ms "
                  f"({nbytes / s / 1e9:5.1f} GB/s of weights); weights packed once for oneDNN "
                  f"(shared/cpu_linears.py): {packed * 1e3:6.1f} ms")


def attention(positions: int) -> None:
    kernel = cpu_attention.load()
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, 9, 1, 64).to(dtype)
        k = torch.randn(1, 3, positions + 128, 64).to(dtype).narrow(2, 0, positions)  # a view, as in SequenceKV
        v = torch.randn(1, 3, positions + 128, 64).to(dtype).narrow(2, 0, positions)
        sdpa = per_call_s(lambda: F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True), 200)
        line = f"one query token over {positions} positions, {str(dtype)[6:]:8}: SDPA {sdpa * 1e6:5.0f} us"
        if dtype != torch.float32:
            upcast = per_call_s(lambda: F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), scale=0.125, enable_gqa=True).to(dtype), 200)
            line += f"; upcast to float32 {upcast * 1e6:5.0f} us"
        q32 = q.float().view(1, 9, 64)
        hot = per_call_s(lambda: kernel(q32, [k[0]], [v[0]], 0.125), 200)
        print(f"{line}; pdd's kernel {hot * 1e6:5.0f} us")


def attention_step(positions: int, requests: int = 16, layers: int = 30) -> None:
    """The attention of one decode step: every request's own KV per layer, too much for the caches."""
    kernel = cpu_attention.load()
    for dtype in (torch.float32, torch.bfloat16):
        kv = [torch.randn(layers, 2, 3, positions + 128, 64).to(dtype) for _ in range(requests)]
        q = torch.randn(requests, 9, 64)

        def sdpa() -> None:
            for layer in range(layers):
                for r in range(requests):
                    k, v = kv[r][layer, 0, :, :positions][None], kv[r][layer, 1, :, :positions][None]
                    F.scaled_dot_product_attention(q[r].view(1, 9, 1, 64), k.float(), v.float(), scale=0.125,
                                                   enable_gqa=True)

        def ours() -> None:
            for layer in range(layers):
                kernel(q, [x[layer, 0, :, :positions] for x in kv], [x[layer, 1, :, :positions] for x in kv], 0.125)

        print(f"attention of a decode step, {requests} requests x {layers} layers x {positions} positions, "
              f"{str(dtype)[6:]:8} KV: SDPA {per_call_s(sdpa, 3) * 1e3:5.1f} ms (float32 upcast per call), "
              f"pdd's kernel {per_call_s(ours, 3) * 1e3:5.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,16", help="row counts (decode batch sizes) for the linears")
    p.add_argument("--positions", type=int, default=512)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    bandwidth()
    linears([int(r) for r in args.rows.split(",")])
    attention(args.positions)
    attention_step(args.positions)


if __name__ == "__main__":
    main()
