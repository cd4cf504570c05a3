"""One long prompt's KV through the two-datacenter stack: when MD has all of it, against the line.

A real two-dc stack (`LocalStack`, topology two-dc, `--engine sim` serving Llama-3.1-70B's shape with
bfloat16 KV: 327,680 bytes per token, the real size) behind the WAN emulator at a set line rate and
one-way delay, no jitter. After a short warm-up request (P's pool of connections to MD opens), each
run sends one prompt of fresh random ids (no cache holds it) through P-MD and times, from the
request's own trace (every service exports its spans to the gateway's OTLP receiver), from the end
of P's first `prefill.chunk` span (the chunk is handed to the transfer then, and its first KV byte
leaves) to the end of MD's `main.kv_wait` span (MD holds the whole KV), against KV bytes x 8 / rate
+ one-way delay. It also reports the emulator's byte counter on P's KV route, P's prefill (wall
clock, and as the roofline models it: P's heartbeat `sim_modelled_s`), how long after P's last chunk
MD had everything, P's transfer span and MD's own `kv_wait_s` (from its assignment).

The shipped llama-70b shape (Llama 3) has an 8,192-token context, in which no 8,192-token prompt
fits; this script serves it with Llama 3.1's context (131,072), a config.json written beside the logs.

    python scripts/bench_two_dc_kv.py --bandwidth-mbps 2000 --delay-ms 25 --prompt-tokens 8192 --runs 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from shared.sim_checkpoint import SHAPES_DIR
from tools.api_client import stream_completion
from tools.bench.runner import prefill_stats
from tools.launcher import LocalStack
from tools.stack_config import MD_KV_ROUTE, StackConfig, free_port

SHAPE = "llama-70b"
CONTEXT_TOKENS = 131_072  # Llama 3.1 70B's; its layers, heads and KV are Llama 3 70B's
TRACE_WAIT_S = 30.0
SPANS = ("prefill.chunk", "prefill.kv_transfer", "main.kv_wait")
SERVICES = ("gateway", "prefill", "relay", "main")


@dataclass(frozen=True)
class Run:
    run: int
    prompt_tokens: int
    kv_tokens: int  # the positions whose KV MD received
    kv_bytes: int  # the payload MD received
    wan_bytes: int  # what the emulator delivered on P's KV route during the request
    prefill_s: float  # P's, first chunk to last, wall clock
    modelled_prefill_s: float  # P's steps as the roofline times them (the sim sleeps what its own work leaves)
    transfer_s: float  # P's first chunk handed to the transfer -> MD holds the whole KV
    ideal_s: float  # kv_bytes * 8 / rate + one-way delay
    after_prefill_s: float  # P's last chunk computed -> MD holds the whole KV
    p_write_s: float  # P's transfer span to MD: the request's arrival -> P ends it (after its cache keeps the prompt)
    main_kv_wait_s: float  # MD's own: assigned -> the whole KV

    @property
    def ratio(self) -> float:
        return self.transfer_s / self.ideal_s


def shape_with_context(directory: Path, context_tokens: int) -> Path:
    """The llama-70b shape with a longer context, as a config.json under `directory`."""
    config = json.loads((SHAPES_DIR / f"{SHAPE}.json").read_text())
    config["max_position_embeddings"] = context_tokens
    config["_source"] = f"{config['_source']}; max_position_embeddings {context_tokens} (bench_two_dc_kv.py)"
    path = directory / f"llama-70b-ctx{context_tokens}" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1))
    return path


async def modelled_prefill_s(stack: LocalStack) -> float:
    """P's engine's modelled step time so far (its heartbeat's `sim_modelled_s`), from a beat sent now."""
    stats = await prefill_stats(stack, timeout_s=10.0)
    if stats is None:
        raise RuntimeError("P sent no heartbeat within 10 s")
    return stats["sim_modelled_s"]


def fresh_prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(1000, 40_000) for _ in range(tokens)]


async def trace_spans(session: aiohttp.ClientSession, api_url: str, trace_id: str) -> dict[str, list[dict]]:
    """The request's spans by name, once those this script reads have all come in."""
    deadline = time.monotonic() + TRACE_WAIT_S
    named: dict[str, list[dict]] = {}
    while time.monotonic() < deadline:
        async with session.get(f"{api_url}/dashboard/api/traces/{trace_id}") as resp:
            if resp.status == 200:
                named = {}
                for row in (await resp.json())["rows"]:
                    named.setdefault(row["name"], []).append(row)
                if all(name in named for name in SPANS):
                    return named
        await asyncio.sleep(0.25)
    raise RuntimeError(f"trace {trace_id} lacks {sorted(set(SPANS) - set(named))} after {TRACE_WAIT_S:g}s")


def end_ms(row: dict) -> float:
    return float(row["start_ms"]) + float(row["duration_ms"])


async def route_bytes(stack: LocalStack) -> int:
    stats = await stack.wan.stats()
    return int(stats["routes"][MD_KV_ROUTE]["a_to_b"]["bytes"])


async def one_run(session: aiohttp.ClientSession, stack: LocalStack, args: argparse.Namespace, rng: random.Random,
                  run: int) -> Run:
    body = {"prompt": fresh_prompt(rng, args.prompt_tokens), "max_tokens": args.max_tokens, "temperature": 0,
            "pdd": {"pipeline": "p-md"}}
    modelled_before = await modelled_prefill_s(stack)
    wan_before = await route_bytes(stack)
    result = await stream_completion(session, stack.api_url, body)
    summary = result.summary
    if summary.get("pipeline") != "p-md" or "main" not in summary.get("kv", {}):  # type: ignore[operator]
        raise RuntimeError(f"run {run} was not served through P-MD with MD's KV: {summary}")
    main = summary["kv"]["main"]  # type: ignore[index]
    spans = await trace_spans(session, stack.api_url, str(summary["trace_id"]))
    await asyncio.sleep(args.settle_s)  # the emulator's counter: its last chunk's write is counted by now
    wan_bytes = await route_bytes(stack) - wan_before
    modelled_s = await modelled_prefill_s(stack) - modelled_before
    chunks = sorted(spans["prefill.chunk"], key=lambda row: row["attributes"]["pdd.token_start"])
    first_chunk_end, main_has_all = end_ms(chunks[0]), end_ms(spans["main.kv_wait"][0])
    (to_main,) = [row for row in spans["prefill.kv_transfer"] if row["attributes"]["pdd.target_role"] == "main"]
    kv_bytes = int(main["kv_bytes"])
    measured = Run(
        run, args.prompt_tokens, int(main["kv_tokens"]), kv_bytes, wan_bytes,
        prefill_s=(end_ms(chunks[-1]) - float(chunks[0]["start_ms"])) / 1000, modelled_prefill_s=modelled_s,
        transfer_s=(main_has_all - first_chunk_end) / 1000,
        ideal_s=kv_bytes * 8 / (args.bandwidth_mbps * 1e6) + args.delay_ms / 1000,
        after_prefill_s=(main_has_all - end_ms(chunks[-1])) / 1000,
        p_write_s=float(to_main["duration_ms"]) / 1000,
        main_kv_wait_s=float(main["kv_wait_s"]))
    print(f"  run {run}: {kv_bytes / 1e9:.3f} GB in {measured.transfer_s:.2f} s, ideal {measured.ideal_s:.2f} s, "
          f"{measured.ratio:.3f}x; prefill {measured.prefill_s:.2f} s", file=sys.stderr, flush=True)
    return measured


async def measure(args: argparse.Namespace) -> list[Run]:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdd-bench-two-dc-kv-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    shape = shape_with_context(log_dir, args.context_tokens)
    port = free_port()  # the gateway is every service's OTLP endpoint, so its port is chosen first
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # the services export their spans every 200 ms
    config = StackConfig(model=args.model, dtype="bfloat16", engine="sim", sim_device=args.sim_device,
                         sim_shape=str(shape), port=port, log_dir=log_dir, topology="two-dc",
                         wan_bandwidth_mbps=args.bandwidth_mbps, wan_delay_ms=args.delay_ms, wan_jitter_ms=0.0,
                         startup_timeout_s=300.0,
                         extra_args={role: ["--otlp-endpoint", endpoint] for role in SERVICES})
    rng = random.Random(args.seed)
    print(f"starting a two-dc stack, {SHAPE} shape sim (logs in {log_dir})", file=sys.stderr, flush=True)
    runs = []
    async with LocalStack(config) as stack, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        warm = {"prompt": fresh_prompt(rng, args.warmup_tokens), "max_tokens": 1, "temperature": 0,
                "pdd": {"pipeline": "p-md"}}
        await stream_completion(session, stack.api_url, warm)  # P's pool to MD opens; code paths warm
        for run in range(args.runs):
            runs.append(await one_run(session, stack, args, rng, run))
    return runs


def table(runs: list[Run]) -> str:
    lines = ["| run | KV tokens | KV GB (MD) | emulator GB (md_kv) | P's prefill (s), modelled | "
             "first KV → MD has all (s) | bytes/rate + delay (s) | ratio | P's last chunk → MD has all (s) "
             "| P's transfer span (s) | MD's kv_wait_s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r.run} | {r.kv_tokens:,} | {r.kv_bytes / 1e9:.3f} | {r.wan_bytes / 1e9:.3f} | "
                     f"{r.prefill_s:.2f}, {r.modelled_prefill_s:.2f} | {r.transfer_s:.2f} | {r.ideal_s:.2f} | "
                     f"{r.ratio:.3f} | {r.after_prefill_s:.2f} | {r.p_write_s:.2f} | {r.main_kv_wait_s:.2f} |")
    ratios = [r.ratio for r in runs]
    lines += ["", f"ratio: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A long prompt's KV through the two-dc stack against bytes/rate + delay")
    p.add_argument("--bandwidth-mbps", type=float, default=2000.0, help="the emulated line rate")
    p.add_argument("--delay-ms", type=float, default=25.0, help="one way")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--context-tokens", type=int, default=CONTEXT_TOKENS, help="the served shape's context")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup-tokens", type=int, default=256)
    p.add_argument("--model", default="smollm2", help="the tokenizer's checkpoint")
    p.add_argument("--sim-device", default="h100", help="whose roofline times P's prefill")
    p.add_argument("--settle-s", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="")
    p.add_argument("--out", default="", help="also write the runs as JSON to this file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    runs = asyncio.run(measure(args))
    after = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{args.prompt_tokens:,}-token prompts through P-MD, {SHAPE} shape (bfloat16 KV) on the sim "
          f"({args.sim_device} roofline), two-dc at {args.bandwidth_mbps:g} Mbit/s and {args.delay_ms:g} ms one way, "
          f"no jitter; {os.cpu_count()} CPUs, load average {load} before, {after} after\n")
    print(table(runs))
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) | {"ratio": r.ratio} for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
