"""Do event loops only move bytes? Two measurements on a local stack (loopback only).

1. Stream gaps under huge prompts: one stream runs (`--stream-tokens` tokens, greedy,
   ignore_eos); once it has `--warm-tokens` tokens, a 3.9 MB and a 1 MB text prompt arrive at
   once (both within the 4 MB body limit; the first is over the prompt byte bound and refused
   before tokenising, the second is tokenised in the gateway's pool and refused as longer than
   the context). Reports the stream's median gap between tokens, the largest gap while the big
   requests were in the gateway, and their ratio (goal: under 4x); and whether any instance
   looked dead meanwhile (`/healthz` polled every 100 ms, the gateway's `pdd_live_instances`).
2. Event-loop lag under many streams: `--streams` concurrent streamed requests, then each
   service's `pdd_event_loop_lag_seconds` (its P99 as a histogram bucket bound) and
   `pdd_event_loop_lag_max_seconds`, and its Python garbage collections (`pdd_gc_*`: count, time
   and longest pause by generation, objects frozen at start-up), read from their /metrics; and the
   streams' gaps between tokens (median, P99, largest).

`--gc-freeze off` starts every service with its start-up heap left to the collector (the default,
on, freezes it: `shared/gc_heap.py`), to measure what the freeze is worth.

    .venv/bin/python scripts/bench_loop_lag.py --model smollm2 --streams 64 --out bench-results/loop-lag.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.api_client import ApiError, stream_completion  # noqa: E402
from tools.launcher import LocalStack  # noqa: E402
from tools.stack_config import StackConfig, free_port  # noqa: E402

MODEL_ROLES = ("prefill", "relay", "main")
WORDS = ("agent", "tool", "call", "result", "prefix", "cache", "token", "stream", "decode", "relay")


def text_of_bytes(n: int, rng: random.Random) -> str:
    words: list[str] = []
    size = 0
    while size < n:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:n]


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text format, enough of it: name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        out.setdefault(name, []).append(({k: v.strip('"') for k, v in labels.items()}, float(value)))
    return out


def lag_summary(metrics: dict[str, list[tuple[dict[str, str], float]]]) -> dict:
    buckets = sorted((float(labels["le"]), count)
                     for labels, count in metrics.get("pdd_event_loop_lag_seconds_bucket", ()))
    total = buckets[-1][1] if buckets else 0
    p99 = next((le for le, count in buckets if count >= 0.99 * total), None) if total else None
    max_lag = metrics.get("pdd_event_loop_lag_max_seconds", [({}, None)])[0][1]
    return {"samples": int(total), "p99_at_most_s": p99, "max_s": max_lag}


def gc_summary(metrics: dict[str, list[tuple[dict[str, str], float]]]) -> dict:
    """A service's collections by generation: count, seconds in all, the longest; and its frozen heap."""
    def by_generation(name: str) -> dict[str, float]:
        return {labels["generation"]: value for labels, value in metrics.get(name, ())}

    counts, seconds = by_generation("pdd_gc_collections_total"), by_generation("pdd_gc_pause_seconds_total")
    longest, freed = by_generation("pdd_gc_pause_max_seconds"), by_generation("pdd_gc_collected_objects_total")
    frozen = metrics.get("pdd_gc_frozen_objects", [({}, None)])[0][1]
    return {"frozen_objects": frozen,
            **{f"gen{g}": {"collections": int(counts.get(g, 0)), "seconds": seconds.get(g),
                           "max_s": longest.get(g), "collected": int(freed.get(g, 0))} for g in ("0", "1", "2")}}



async def get_text(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.get(url) as resp:
        return resp.status, await resp.text()


def big_body(nbytes: int, rng: random.Random) -> bytes:
    """Made before the stream starts: building and encoding it on this client's loop would delay the
    stream's reads and show up as a gap the server did not cause."""
    return json.dumps({"prompt": text_of_bytes(nbytes, rng), "max_tokens": 4}).encode()


async def big_prompt(http: aiohttp.ClientSession, api_url: str, body: bytes) -> dict:
    nbytes = len(body)
    t0 = time.monotonic()
    async with http.post(f"{api_url}/v1/completions", data=body,
                         headers={"Content-Type": "application/json"}) as resp:
        text = await resp.text()
        return {"bytes": nbytes, "status": resp.status, "seconds": time.monotonic() - t0,
                "answer": text[:200], "sent_at": t0, "done_at": time.monotonic()}


async def stream_gaps(stack: LocalStack, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    api = stack.api_url
    bodies = [big_body(int(3.9 * 2**20), rng), big_body(2**20, rng)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        warm = asyncio.Event()
        stream_t0 = time.monotonic()

        def on_token(index: int, _tier: str) -> None:
            if index + 1 >= args.warm_tokens:
                warm.set()

        body = {"prompt": [rng.randrange(100, 40000) for _ in range(64)], "max_tokens": args.stream_tokens,
                "temperature": 0, "ignore_eos": True}
        stream = asyncio.create_task(stream_completion(http, api, body, on_token=on_token))
        await asyncio.wait_for(warm.wait(), 300)
        health: list[tuple[float, int, dict]] = []
        stop_polling = asyncio.Event()

        async def poll() -> None:
            while not stop_polling.is_set():
                status, _ = await get_text(http, f"{api}/healthz")
                _, metrics = await get_text(http, f"{api}/metrics")
                live = {labels.get("role"): value
                        for labels, value in parse_metrics(metrics).get("pdd_live_instances", ())}
                health.append((time.monotonic(), status, live))
                await asyncio.sleep(0.1)

        poller = asyncio.create_task(poll())
        big = await asyncio.gather(*(big_prompt(http, api, body) for body in bodies))
        await asyncio.sleep(1.0)  # a second after: what the stall would have left behind
        stop_polling.set()
        await poller
        result = await stream
    times = [stream_t0 + t for t in result.token_times_s]
    gaps = list(zip(times[1:], result.gaps_s))
    window = (min(b["sent_at"] for b in big), max(b["done_at"] for b in big) + 0.5)
    during = [gap for at, gap in gaps if window[0] <= at <= window[1]]
    median = statistics.median(gap for _, gap in gaps)
    worst = max(during) if during else None
    return {"stream_tokens": len(result.token_ids), "median_gap_s": median, "largest_gap_during_s": worst,
            "ratio": worst / median if worst else None, "gaps_during": len(during),
            "big_requests": [{k: v for k, v in b.items() if k not in ("sent_at", "done_at")} for b in big],
            "healthz_not_200": sum(1 for _, status, _ in health if status != 200), "healthz_polls": len(health),
            "fewest_live": {role: min(live.get(role, 0) for _, _, live in health) for role in MODEL_ROLES}}


async def many_streams(stack: LocalStack, metrics_ports: dict[str, int], args: argparse.Namespace) -> dict:
    rng = random.Random(1)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as http:
        gaps: list[float] = []

        async def one() -> str:
            body = {"prompt": [rng.randrange(100, 40000) for _ in range(rng.randrange(32, 256))],
                    "max_tokens": args.stream_max_tokens, "temperature": 0, "ignore_eos": True}
            try:
                gaps.extend((await stream_completion(http, stack.api_url, body)).gaps_s)
                return "ok"
            except (TimeoutError, ApiError, aiohttp.ClientError) as exc:
                return f"failed: {exc}"

        t0 = time.monotonic()
        outcomes = await asyncio.gather(*(one() for _ in range(args.streams)))
        seconds = time.monotonic() - t0
        urls = {"gateway": f"{stack.api_url}/metrics",
                **{role: f"http://127.0.0.1:{port}/metrics" for role, port in metrics_ports.items()}}
        lags, collections = {}, {}
        for role, url in urls.items():
            metrics = parse_metrics((await get_text(http, url))[1])
            lags[role], collections[role] = lag_summary(metrics), gc_summary(metrics)
    return {"streams": args.streams, "seconds": seconds, "ok": outcomes.count("ok"),
            "failed": [o for o in outcomes if o != "ok"][:5], "event_loop_lag": lags, "gc": collections,
            "token_gaps": {"count": len(gaps), "median_s": statistics.median(gaps) if gaps else None,
                           "p99_s": (statistics.quantiles(gaps, n=100, method="inclusive")[98]
                                     if len(gaps) > 1 else None),
                           "max_s": max(gaps, default=None)}}


async def run(args: argparse.Namespace) -> dict:
    metrics_ports = {role: free_port() for role in MODEL_ROLES}
    config = StackConfig(model=args.model, port=0, pipeline=args.pipeline, startup_timeout_s=600,
                         log_dir=Path(tempfile.mkdtemp(prefix="pdd-loop-lag-")),
                         extra_args={"gateway": ["--gc-freeze", args.gc_freeze],
                                     **{role: ["--metrics-port", str(port), "--gc-freeze", args.gc_freeze]
                                        for role, port in metrics_ports.items()}})
    async with LocalStack(config) as stack:
        report = {"model": args.model, "pipeline": args.pipeline, "gc_freeze": args.gc_freeze,
                  "gaps": None if args.skip_gaps else await stream_gaps(stack, args)}
        print(json.dumps(report["gaps"], indent=1), flush=True)
        report["many_streams"] = await many_streams(stack, metrics_ports, args)
        print(json.dumps(report["many_streams"], indent=1), flush=True)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--pipeline", default="p-rld-md", help="every tier's loop is measured on P-RLD-MD")
    p.add_argument("--stream-tokens", type=int, default=300)
    p.add_argument("--warm-tokens", type=int, default=40)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-max-tokens", type=int, default=32)
    p.add_argument("--gc-freeze", choices=("on", "off"), default="on", help="every service's --gc-freeze")
    p.add_argument("--skip-gaps", action="store_true", help="only the many streams (part 2)")
    p.add_argument("--out", type=Path, default=Path("bench-results/loop-lag.json"))
    args = p.parse_args()
    report = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
