"""How long a client waits when an instance dies mid-request, and whether its answer stays exact.

Each trial streams a greedy request on a local stack (one datacenter, default heartbeats unless
--heartbeat-s), kills one instance at a chosen moment with SIGKILL, and measures the gap the
client sees: from the last token before the kill to the first one after it. The answer is
compared with an undisturbed run of the same request. Faults:

- `main-decoding`: P-MD, MD killed after --kill-at tokens: the request migrates (to RLD alone,
  the stack's only other decoder).
- `relay-before-cut`: P-RLD-MD with the cut pinned at token 100 (MD holds its KV long before),
  RLD killed after --kill-at tokens: MD takes over from the tokens the client has.
- `main-before-cut`: P-RLD-MD with MD's KV held back 4 s, MD killed: RLD finishes alone.

    .venv/bin/python scripts/bench_recovery.py --model tiny --trials 5 --out docs/results/recovery.json
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

from tools.api_client import StreamResult, stream_completion
from tools.launcher import LocalStack
from tools.stack_config import StackConfig

FAULTS = {  # name -> (role killed, the request's pdd options)
    "main-decoding": ("main", {"pipeline": "p-md"}),
    "relay-before-cut": ("relay", {"pipeline": "p-rld-md", "handoff_at": 100}),
    "main-before-cut": ("main", {"pipeline": "p-rld-md", "md_kv_delay_ms": 4000}),
}


async def healthy(http: aiohttp.ClientSession, stack: LocalStack, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            async with http.get(stack.api_url + "/healthz") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.2)


async def trial(http: aiohttp.ClientSession, stack: LocalStack, fault: str, prompt: list[int],
                args: argparse.Namespace) -> dict:
    role, pdd = FAULTS[fault]
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "pdd": pdd}
    undisturbed = await stream_completion(http, stack.api_url, body)

    def kill(index: int, tier: str) -> None:
        if index == args.kill_at - 1:
            stack.kill(role)

    disturbed: StreamResult = await stream_completion(http, stack.api_url, body, on_token=kill)
    gap = disturbed.token_times_s[args.kill_at] - disturbed.token_times_s[args.kill_at - 1]
    normal_gaps = undisturbed.gaps_s
    await stack.restart(role)
    await asyncio.sleep(args.heartbeat_s * 4)  # the dead instance's heartbeats go stale first
    await healthy(http, stack)
    return {"fault": fault, "exact": disturbed.token_ids == undisturbed.token_ids,
            "recovery": disturbed.summary.get("recovery"), "gap_s": round(gap, 4),
            "median_gap_undisturbed_s": round(statistics.median(normal_gaps), 4),
            "tiers": {tier: disturbed.tiers.count(tier) for tier in dict.fromkeys(disturbed.tiers)}}


async def run(args: argparse.Namespace) -> list[dict]:
    beat = ["--heartbeat-s", str(args.heartbeat_s)]
    config = StackConfig(model=args.model, port=0, log_dir=Path(tempfile.mkdtemp(prefix="pdd-recovery-")),
                         torch_threads=1, startup_timeout_s=300,
                         extra_args={role: beat for role in ("prefill", "relay", "main", "gateway")})
    rng = random.Random(0)
    rows = []
    async with LocalStack(config) as stack, aiohttp.ClientSession() as http:
        for fault in args.faults:
            for _ in range(args.trials):
                prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
                row = await trial(http, stack, fault, prompt, args)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    table = []
    for fault in dict.fromkeys(r["fault"] for r in rows):
        mine = [r for r in rows if r["fault"] == fault]
        gaps = [r["gap_s"] for r in mine]
        table.append({"fault": fault, "trials": len(mine), "exact": sum(r["exact"] for r in mine),
                      "recoveries": sorted({str(r["recovery"]) for r in mine}),
                      "gap_median_s": statistics.median(gaps), "gap_max_s": max(gaps),
                      "undisturbed_gap_median_s": statistics.median(r["median_gap_undisturbed_s"] for r in mine)})
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--kill-at", type=int, default=20, help="kill once the client has this many tokens")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="every service's heartbeat (the default is 1)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows = asyncio.run(run(args))
    table = summarise(rows)
    for line in table:
        print(json.dumps(line))
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": table,
                                        "trials": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
