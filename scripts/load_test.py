"""Ramp concurrent streams past the gateway's capacity and report what happens (loopback only).

For each concurrency level, send that many streamed requests at once against a local stack and
report accepted, refused (429/503) and failed requests, latency, and each service's memory
(resident set size). Bounded in count and time; it stops by itself.

    .venv/bin/python scripts/load_test.py --model tiny --levels 1 4 8 16 32 --max-running 8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from tools.api_client import ApiError, stream_completion
from tools.launcher import LocalStack
from tools.stack_config import StackConfig


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one(http: aiohttp.ClientSession, url: str, rng: random.Random, max_tokens: int) -> tuple[str, float]:
    body = {"prompt": [rng.randrange(100, 40000) for _ in range(rng.randrange(50, 400))],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    try:
        await stream_completion(http, url, body)
        return "accepted", time.monotonic() - t0
    except ApiError as exc:
        return ("refused" if exc.status in (429, 503) else "failed"), time.monotonic() - t0
    except (TimeoutError, aiohttp.ClientError):
        return "failed", time.monotonic() - t0


async def run(args: argparse.Namespace) -> list[dict]:
    config = StackConfig(model=args.model, port=0, log_dir=Path(tempfile.mkdtemp(prefix="pdd-load-")),
                         torch_threads=1, startup_timeout_s=300,
                         extra_args={"gateway": ["--max-running-requests", str(args.max_running),
                                                 "--max-queued-requests", "0"]})  # refusals, not a queue
    rows = []
    rng = random.Random(0)
    async with LocalStack(config) as stack, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout_s)) as http:
        for level in args.levels:
            t0 = time.monotonic()
            outcomes = await asyncio.gather(*(one(http, stack.api_url, rng, args.max_tokens) for _ in range(level)))
            by_kind = {kind: [t for k, t in outcomes if k == kind] for kind in ("accepted", "refused", "failed")}
            row = {"concurrency": level, **{kind: len(ts) for kind, ts in by_kind.items()},
                   "accepted_median_s": statistics.median(by_kind["accepted"]) if by_kind["accepted"] else None,
                   "accepted_max_s": max(by_kind["accepted"], default=None),
                   "refused_max_s": max(by_kind["refused"], default=None),
                   "wall_s": time.monotonic() - t0,
                   "rss_mib": {role: round(rss_mib(p.pid), 1) for role, p in stack.processes.items()
                               if p.poll() is None}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    roles = sorted({role for row in rows for role in row["rss_mib"]})
    head = "| streams | accepted | refused | failed | accepted median (s) | slowest refusal (s) | " + \
        " | ".join(f"{r} RSS (MiB)" for r in roles) + " |"
    lines = [head, "|" + "---:|" * (6 + len(roles))]
    for row in rows:
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"| {row['concurrency']} | {row['accepted']} | {row['refused']} | {row['failed']} | "
                     f"{fmt(row['accepted_median_s'])} | {fmt(row['refused_max_s'])} | " +
                     " | ".join(str(row["rss_mib"].get(r, "-")) for r in roles) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--max-running", type=int, default=8, help="the gateway's --max-running-requests")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = asyncio.run(run(args))
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
