"""Benchmark KV transfer across the emulated WAN, and TTFT of P-MD versus P-RLD-MD.

Default mode: pdd's own KV sender and receiver (`shared.kv_sender`, `shared.kv_receiver`) in this process, an
in-process `WanEmulator` between them on loopback, synthetic KV in SmolLM2's layout (30 layers,
3 KV heads, head dim 64: 46,080 bytes a token in float32). For each bandwidth, one-way delay and
number of parallel connections it reports the transfer time (first chunk queued to the last cell
received) against the line's arithmetic, and the throughput achieved. It also runs
scripts/bench_wan.py's unlimited cases for the emulator's own ceiling.

`--ttft`: a real two-datacenter stack (`LocalStack`, topology two-dc) with SmolLM2 behind a
100 Mbit/s, 15 ms one-way link; time to first token of P-MD and P-RLD-MD for 2,000-token prompts
that no cache holds. Both print markdown tables; `--out FILE` also writes JSON.
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
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from shared.kv_receiver import KVReceiver
from shared.kv_sender import KVSender, OutgoingTransfer
from shared.kv_transfer_state import TransferState
from shared.messages import KVTarget
from shared.models import KVLayout
from tools.api_client import stream_completion
from tools.launcher import LocalStack
from tools.stack_config import StackConfig
from wan.emulator import LinkConfig, Route, WanEmulator

SMOLLM2_LAYOUT = KVLayout("bench-smollm2-layout", num_layers=30, kv_heads=3, head_dim=64)
CHUNK_TOKENS = 256  # P's default --chunk-tokens: KV leaves P a chunk at a time
QUEUE_CHUNKS = 4  # P's default --kv-queue-chunks
MAX_TOKENS = 2000
MIN_TOKENS = 64


@dataclass(frozen=True)
class Case:
    bandwidth_mbps: float  # 0: unlimited
    delay_ms: float  # one way
    connections: int
    jitter_ms: float = 0.0


@dataclass(frozen=True)
class Result:
    bandwidth_mbps: float
    delay_ms: float
    jitter_ms: float
    connections: int
    tokens: int
    kv_bytes: int
    transfer_s: float  # median over repeats
    ideal_s: float  # kv_bytes at line rate plus one one-way delay
    achieved_mbps: float
    runs_s: list[float]


def default_cases(connections: tuple[int, ...]) -> list[Case]:
    cases = [Case(0, 0, n) for n in (1, 4)]
    cases += [Case(mbps, delay, n) for mbps in (100, 1000) for delay in (5, 30) for n in connections]
    cases += [Case(100, 30, n, jitter_ms=5) for n in (1, 4)]
    return cases


def tokens_for(case: Case, target_s: float) -> int:
    """Enough tokens for about target_s of line time, at most a 2,000-token prompt."""
    if not case.bandwidth_mbps:
        return MAX_TOKENS
    tokens = target_s * case.bandwidth_mbps * 1e6 / 8 / SMOLLM2_LAYOUT.bytes_per_token_fp32
    return int(min(MAX_TOKENS, max(MIN_TOKENS, tokens)))


async def _transfer_once(receiver: KVReceiver, port: int, sender: KVSender, kv: torch.Tensor) -> tuple[float, int]:
    request_id = "req-" + uuid.uuid4().hex  # the form the frame header carries
    tokens = kv.shape[3]
    inbox = receiver.expect(request_id, 0, tokens)
    t0 = time.monotonic()
    transfer = OutgoingTransfer(sender, KVTarget("main", "127.0.0.1", port), request_id, QUEUE_CHUNKS, 120.0)
    for start in range(0, tokens, CHUNK_TOKENS):
        await transfer.put(start, kv[:, :, :, start:start + CHUNK_TOKENS])
    result = await transfer.finish()
    await inbox.wait(120.0)
    receiver.release(request_id)
    if result.state is not TransferState.DONE or inbox.done_at is None:
        raise RuntimeError(f"transfer failed: {result.error}")
    return inbox.done_at - t0, result.kv_bytes


async def run_case(case: Case, receiver: KVReceiver, receiver_port: int, target_s: float, repeats: int) -> Result:
    tokens = tokens_for(case, target_s)
    kv = torch.randn(SMOLLM2_LAYOUT.num_layers, 2, SMOLLM2_LAYOUT.kv_heads, tokens, SMOLLM2_LAYOUT.head_dim)
    link = LinkConfig(bandwidth_bps=case.bandwidth_mbps * 1e6, delay_ms=case.delay_ms, jitter_ms=case.jitter_ms)
    async with WanEmulator(link, [Route("kv", "127.0.0.1", 0, "127.0.0.1", receiver_port)]) as wan:
        sender = KVSender(SMOLLM2_LAYOUT, torch.float32, connect_timeout_s=5.0,
                          connections_per_peer=case.connections, stall_timeout_s=30.0)
        try:
            await sender.connections("127.0.0.1", wan.port("kv"))  # P keeps its connections: warm them first
            runs = [await _transfer_once(receiver, wan.port("kv"), sender, kv) for _ in range(repeats)]
        finally:
            await sender.close()
    kv_bytes = runs[0][1]
    transfer_s = statistics.median(s for s, _ in runs)
    line_s = kv_bytes * 8 / (case.bandwidth_mbps * 1e6) if case.bandwidth_mbps else 0.0
    return Result(case.bandwidth_mbps, case.delay_ms, case.jitter_ms, case.connections, tokens, kv_bytes,
                  transfer_s, line_s + case.delay_ms / 1000, kv_bytes * 8 / transfer_s / 1e6,
                  [round(s, 4) for s, _ in runs])


async def run_transfer_cases(cases: list[Case], target_s: float, repeats: int) -> list[Result]:
    receiver = KVReceiver(SMOLLM2_LAYOUT, torch.float32)
    port = await receiver.start("127.0.0.1", 0)
    results = []
    try:
        await run_case(Case(0, 0, 1), receiver, port, target_s, 1)  # page in buffers and code paths; not reported
        for case in cases:
            result = await run_case(case, receiver, port, target_s, repeats)
            results.append(result)
            print(f"  {case}: {result.transfer_s:.3f} s, {result.achieved_mbps:,.0f} Mbit/s",
                  file=sys.stderr, flush=True)
    finally:
        await receiver.stop()
    return results


def transfer_table(results: list[Result]) -> str:
    lines = [("| bandwidth | one-way delay | jitter | conns | tokens | KV MB | transfer (s) | line arithmetic (s) "
              "| achieved (Mbit/s) | of set rate |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        bandwidth = f"{r.bandwidth_mbps:g} Mbit/s" if r.bandwidth_mbps else "unlimited"
        share = f"{100 * r.achieved_mbps / r.bandwidth_mbps:.0f}%" if r.bandwidth_mbps else "-"
        lines.append(f"| {bandwidth} | {r.delay_ms:g} ms | {r.jitter_ms:g} ms | {r.connections} | {r.tokens:,} "
                     f"| {r.kv_bytes / 1e6:.1f} | {r.transfer_s:.3f} | {r.ideal_s:.3f} | {r.achieved_mbps:,.0f} "
                     f"| {share} |")
    return "\n".join(lines)


def emulator_ceiling(duration_s: float) -> tuple[str, list[dict[str, object]]]:
    """scripts/bench_wan.py's unlimited cases: raw bytes through the emulator as its own process."""
    import bench_wan

    cases = tuple(c for c in bench_wan.DEFAULT_CASES if c.bandwidth_mbps == 0)
    results = bench_wan.run_cases(cases, warmup_s=0.5, duration_s=duration_s)
    return bench_wan.markdown(results), [asdict(r) for r in results]


# --- TTFT on a real two-datacenter stack --------------------------------------------------------

@dataclass(frozen=True)
class TtftRun:
    pipeline: str
    run: int
    prompt_tokens: int
    ttft_s: float  # seen by the client
    first_tier: str
    relay_kv_wait_s: float | None  # P-RLD-MD: RLD's KV, over the local link
    main_kv_bytes: int
    main_kv_wait_s: float | None
    eager_tokens: int | None
    total_s: float


FLOOR = "p-md, link unlimited"


async def _ttft_once(session: aiohttp.ClientSession, stack: LocalStack, rng: random.Random, args: argparse.Namespace,
                     pipeline: str, label: str, run: int) -> TtftRun:
    prompt = fresh_prompt(rng, args.prompt_tokens)
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "pdd": {"pipeline": pipeline}}
    t0 = time.monotonic()
    result = await stream_completion(session, stack.api_url, body)
    kv = result.summary.get("kv", {})
    main, relay = kv.get("main", {}), kv.get("relay", {})
    measured = TtftRun(label, run, len(prompt), result.ttft_s or float("nan"), result.tiers[0] if result.tiers else "-",
                       relay.get("kv_wait_s"), int(main.get("kv_bytes", 0)), main.get("kv_wait_s"),
                       (result.handoff or {}).get("eager_tokens"), time.monotonic() - t0)
    print(f"  {measured}", file=sys.stderr, flush=True)
    await asyncio.sleep(args.settle_s)  # let the last transfer and decode finish
    return measured


def fresh_prompt(rng: random.Random, tokens: int) -> list[int]:
    """Random ordinary-vocabulary ids: neither P's prefix cache nor MD's DRC can hold them."""
    return [rng.randrange(1000, 40_000) for _ in range(tokens)]


async def measure_ttft(args: argparse.Namespace) -> list[TtftRun]:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdd-bench-ttft-"))
    config = StackConfig(model=args.model, port=0, log_dir=log_dir, topology="two-dc",
                         wan_bandwidth_mbps=args.bandwidth_mbps, wan_delay_ms=args.delay_ms, wan_jitter_ms=0.0,
                         chunk_tokens=args.chunk_tokens, startup_timeout_s=600.0,
                         extra_args={"prefill": args.prefill_arg})
    rng = random.Random(args.seed)
    runs: list[TtftRun] = []
    print(f"starting a two-dc stack with {args.model} (logs in {log_dir})", file=sys.stderr, flush=True)
    async with LocalStack(config) as stack, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            warm = {"prompt": fresh_prompt(rng, 64), "max_tokens": 4, "temperature": 0, "pdd": {"pipeline": "p-md"}}
            await stream_completion(session, stack.api_url, warm)  # first-call costs stay out of the numbers
            for run in range(args.runs):
                for pipeline in args.pipelines.split(","):
                    runs.append(await _ttft_once(session, stack, rng, args, pipeline, pipeline, run))
            # The compute floor: the same requests with the WAN out of the way (P's prefill and one
            # decode step; on a CPU this, not the link, may dominate TTFT).
            await stack.wan.set_link(bandwidth_mbps=0, delay_ms=0, jitter_ms=0)
            for run in range(args.floor_runs):
                runs.append(await _ttft_once(session, stack, rng, args, "p-md", FLOOR, run))
    return runs


def ttft_table(runs: list[TtftRun]) -> str:
    lines = [("| pipeline | run | TTFT (s) | first token by | RLD KV wait (s) | MD KV (MB) | MD KV wait (s) "
              "| eager tokens | total (s) |"),
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]

    def seconds(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    for r in runs:
        eager = str(r.eager_tokens) if r.eager_tokens is not None else "-"
        lines.append(f"| {r.pipeline} | {r.run} | {r.ttft_s:.2f} | {r.first_tier} | {seconds(r.relay_kv_wait_s)} "
                     f"| {r.main_kv_bytes / 1e6:.1f} | {seconds(r.main_kv_wait_s)} | {eager} | {r.total_s:.2f} |")
    lines += ["", "| pipeline | median TTFT (s) | min | max |", "|---|---:|---:|---:|"]
    for pipeline in ("p-md", "p-rld-md", FLOOR):
        ttfts = [r.ttft_s for r in runs if r.pipeline == pipeline]
        if ttfts:
            lines.append(f"| {pipeline} | {statistics.median(ttfts):.2f} | {min(ttfts):.2f} | {max(ttfts):.2f} |")
    return "\n".join(lines)


def machine() -> str:
    """What the numbers were measured on: they depend on it (and on whatever else runs there)."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs, loopback, load average {load}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Benchmark pdd's KV transfer over the emulated WAN, or TTFT per pipeline")
    p.add_argument("--ttft", action="store_true", help="measure TTFT of P-MD vs P-RLD-MD on a two-dc stack instead")
    p.add_argument("--out", default="", help="also write the results as JSON to this file")
    transfer = p.add_argument_group("transfer mode")
    transfer.add_argument("--connections", default="1,2,4,8", help="parallel connections to try, comma-separated")
    transfer.add_argument("--target-s", type=float, default=1.5,
                          help="tokens per case are chosen for about this much line time (at most 2,000)")
    transfer.add_argument("--repeats", type=int, default=2, help="transfers per case (the median is reported)")
    transfer.add_argument("--ceiling-s", type=float, default=2.0,
                          help="seconds per bench_wan.py unlimited case; 0 skips them")
    ttft = p.add_argument_group("--ttft mode")
    ttft.add_argument("--model", default="smollm2")
    ttft.add_argument("--bandwidth-mbps", type=float, default=100.0)
    ttft.add_argument("--delay-ms", type=float, default=15.0, help="one way (RTT is twice this)")
    ttft.add_argument("--prompt-tokens", type=int, default=2000)
    ttft.add_argument("--max-tokens", type=int, default=8)
    ttft.add_argument("--chunk-tokens", type=int, default=StackConfig().chunk_tokens, help="P's --chunk-tokens")
    ttft.add_argument("--pipelines", default="p-md,p-rld-md", help="comma-separated, run in this order")
    ttft.add_argument("--runs", type=int, default=3, help="requests per pipeline")
    ttft.add_argument("--floor-runs", type=int, default=2, help="P-MD requests with the link unlimited afterwards")
    ttft.add_argument("--settle-s", type=float, default=1.0)
    ttft.add_argument("--seed", type=int, default=0)
    ttft.add_argument("--log-dir", default="")
    ttft.add_argument("--prefill-arg", action="append", default=[],
                      help="one more flag for P, e.g. --prefill-arg=--kv-queue-chunks=16 (repeatable)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    before = machine()
    if args.ttft:
        runs = asyncio.run(measure_ttft(args))
        extra = f", chunks of {args.chunk_tokens} tokens"
        extra += f", P flags {' '.join(args.prefill_arg)}" if args.prefill_arg else ""
        print(f"TTFT, {args.model}, two-dc at {args.bandwidth_mbps:g} Mbit/s and {args.delay_ms:g} ms one way, "
              f"{args.prompt_tokens}-token prompts, no cache hit{extra} ({before}; after: {machine()})\n")
        print(ttft_table(runs))
        if args.out:
            Path(args.out).write_text(json.dumps([asdict(r) for r in runs], indent=2))
        return 0

    connections = tuple(int(n) for n in args.connections.split(","))
    results = asyncio.run(run_transfer_cases(default_cases(connections), args.target_s, args.repeats))
    print("KV transfer through the in-process WAN emulator (SmolLM2 layout, float32, 46,080 B/token; "
          f"{before}; after: {machine()})\n")
    print(transfer_table(results))
    report: dict[str, object] = {"transfer": [asdict(r) for r in results]}
    if args.ceiling_s > 0:
        table, ceiling = emulator_ceiling(args.ceiling_s)
        print("\nThe emulator's own ceiling (scripts/bench_wan.py, emulator as its own process)\n")
        print(table)
        report["emulator_ceiling"] = ceiling
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
