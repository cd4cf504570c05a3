"""Measure the stall a user sees at the RLD -> MD handoff, One-Shot against Catch-Up.

For handoffs after 10, 100 and 300 eager tokens, the largest gap between two consecutive tokens
around the cut (the two tokens before it to the two after it) against the median gap of the whole
stream, one request at a time on a local stack. Goal (issue): Catch-Up's largest gap at most twice
the median gap.

    .venv/bin/python scripts/bench_handoff_stall.py --model smollm2 --out stall.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
from pathlib import Path

import aiohttp

from tools.api_client import stream_completion
from tools.launcher import LocalStack
from tools.stack_config import StackConfig


def stall_around_cut(gaps: list[float], cut: int, window: int = 2) -> float:
    """Largest gap among tokens cut-window .. cut+window (gap i is between token i and i+1)."""
    return max(gaps[max(0, cut - window - 1):cut + window])


async def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="pdd-stall-"))
    config = StackConfig(model=args.model, port=0, log_dir=log_dir, torch_threads=1, pipeline="p-rld-md",
                         startup_timeout_s=300, extra_args={"relay": ["--catch-up-threshold", str(args.threshold)]})
    async with LocalStack(config) as stack, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        rng = random.Random(0)
        for eager in args.eager:
            for mode in ("one-shot", "catch-up"):
                for repeat in range(args.repeats):
                    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
                    body = {"prompt": prompt, "max_tokens": eager + args.after, "temperature": 0, "ignore_eos": True,
                            "pdd": {"pipeline": "p-rld-md", "handoff_mode": mode, "handoff_at": eager}}
                    result = await stream_completion(http, stack.api_url, body)
                    gaps = result.gaps_s
                    cut = result.tiers.index("main")
                    row = {"eager_tokens": eager, "mode": mode, "repeat": repeat,
                           "chunks": result.handoff["chunks"], "handed_off_as": result.handoff["mode"],
                           "median_gap_s": statistics.median(gaps), "stall_s": stall_around_cut(gaps, cut),
                           "extend_s": result.handoff["extend_s"], "ttft_s": result.ttft_s}
                    row["stall_over_median"] = row["stall_s"] / row["median_gap_s"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| eager tokens | mode | chunks | median gap (ms) | largest gap at cut (ms) | ratio | final extend (ms) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        as_ = "" if row["handed_off_as"] == row["mode"] else f" (as {row['handed_off_as']})"
        lines.append(f"| {row['eager_tokens']} | {row['mode']}{as_} | "
                     f"{row['chunks']} | {row['median_gap_s'] * 1000:.1f} | {row['stall_s'] * 1000:.1f} | "
                     f"{row['stall_over_median']:.2f} | {row['extend_s'] * 1000:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--eager", type=int, nargs="+", default=[10, 100, 300])
    parser.add_argument("--after", type=int, default=30, help="tokens MD makes after the cut")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--threshold", type=int, default=64, help="RLD's --catch-up-threshold")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = asyncio.run(measure(args))
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
