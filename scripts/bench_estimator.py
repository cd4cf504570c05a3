"""How well the gateway predicts when MD can start: predicted against actual MD-ready time.

Sends requests of varied prompt lengths and cache hits through a two-datacenter stack (the
gateway's policy on) and reports, per request, the prediction the policy used and the time
MD actually had its KV (both measured from dispatch), and the error's distribution.

    .venv/bin/python scripts/bench_estimator.py --model smollm2 --bandwidth-mbps 100 --delay-ms 15
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


async def run(args: argparse.Namespace) -> list[dict]:
    config = StackConfig(model=args.model, port=0, log_dir=Path(tempfile.mkdtemp(prefix="pdd-est-")),
                         torch_threads=1, pipeline="auto", topology="two-dc", wan_bandwidth_mbps=args.bandwidth_mbps,
                         wan_delay_ms=args.delay_ms, wan_jitter_ms=0, startup_timeout_s=300)
    rng = random.Random(0)
    rows = []
    async with LocalStack(config) as stack, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        history: list[int] = []
        for i in range(args.requests):
            if i % 3 == 0:  # a fresh prompt, then two turns that extend it
                history = [rng.randrange(100, 40000) for _ in range(rng.randrange(100, args.max_prompt))]
            else:
                history = history + [rng.randrange(100, 40000) for _ in range(rng.randrange(10, 100))]
            result = await stream_completion(http, stack.api_url, {
                "prompt": history, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            policy = result.summary["policy"]
            row = {"prompt_tokens": len(history), "pipeline": result.summary["pipeline"],
                   "main_hit_predicted": policy["main_hit_predicted"],
                   "main_hit_actual": result.summary["cached_tokens"]["main"],
                   "predicted_s": policy["main_ready_predicted_s"], "actual_s": policy["main_ready_actual_s"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--bandwidth-mbps", type=float, default=100)
    parser.add_argument("--delay-ms", type=float, default=15)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-prompt", type=int, default=600)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = asyncio.run(run(args))
    measured = [r for r in rows if r["actual_s"] is not None]
    errors = sorted(r["actual_s"] - r["predicted_s"] for r in measured)
    if errors:
        print(f"{len(measured)} requests with MD's KV: error (actual - predicted) "
              f"median {statistics.median(errors):+.3f} s, "
              f"min {errors[0]:+.3f} s, max {errors[-1]:+.3f} s, mean |error| "
              f"{statistics.mean(abs(e) for e in errors):.3f} s")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
