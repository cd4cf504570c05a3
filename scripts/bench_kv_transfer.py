"""Benchmark KV transfer across the emulated WAN, and TTFT of P-MD versus P-RLD-MD.

Default mode: pdd's own KV sender and receiver (`shared.kv_sender`, `shared.kv_receiver`) in this process, an
in-process `WanEmulator` between them on loopback, synthetic KV in SmolLM2's layout (30 layers,
3 KV heads, head dim 64: 46,080 bytes a token in float32). For each bandwidth, one-way delay and
number of parallel connections it reports the transfer time (first chunk queued to the last cell
received) against the line's arithmetic, and the throughput achieved. It also runs
scripts/bench_wan.py's unlimited cases for the emulator's own ceiling.

`--vs-raw`: pdd against the machine's own TCP over loopback, each side its own process, no
emulator: pdd's `KVSender` and `KVReceiver` (their defaults, chunks of 256 tokens through P's
4-chunk queue) against two plain processes moving the same bytes with 16 MiB `sendall`/`recv_into`
between pre-touched buffers, and iperf3 where it is installed; KV in SmolLM2's layout (float32,
2,000 tokens) and a 70B-like one (80 layers, 8 KV heads, head dim 128, bfloat16, 2,048 and 8,192
tokens), over 1 and 4 connections, pdd and raw alternated; GB/s, pdd/raw, and each side's CPU
seconds per GB (getrusage in each child, over the transfers only). Every pdd transfer's KV is
compared with what was sent (a CRC32C of the whole tensor on both sides).

`--ttft`: a real two-datacenter stack (`LocalStack`, topology two-dc) with SmolLM2 behind a
100 Mbit/s, 15 ms one-way link; time to first token of P-MD and P-RLD-MD for 2,000-token prompts
that no cache holds. Both print markdown tables; `--out FILE` also writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import random
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from shared import kv_wire
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


# --- pdd against raw TCP over loopback, separate processes ---------------------------------------

LAYOUT_70B = KVLayout("bench-70b-like-layout", num_layers=80, kv_heads=8, head_dim=128)
RAW_BUFFER_BYTES = 16 * 1024 * 1024
CHILD_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class WireCase:
    name: str
    layout: KVLayout
    dtype: str  # kv_wire.DTYPE_NAMES key
    tokens: int
    connections: int

    @property
    def kv_bytes(self) -> int:
        return self.layout.bytes_per_token_fp32 // 4 * kv_wire.DTYPE_NAMES[self.dtype].itemsize * self.tokens


def wire_cases(connections: tuple[int, ...]) -> list[WireCase]:
    shapes = [("SmolLM2 fp32, 2,000 tokens", SMOLLM2_LAYOUT, "float32", 2000),
              ("70B-like bf16, 2,048 tokens", LAYOUT_70B, "bfloat16", 2048),
              ("70B-like bf16, 8,192 tokens", LAYOUT_70B, "bfloat16", 8192)]
    return [WireCase(name, layout, dtype, tokens, n) for name, layout, dtype, tokens in shapes for n in connections]


@dataclass(frozen=True)
class WireRun:
    seconds: float  # the sender's start to the receiver's last byte (CLOCK_MONOTONIC is machine-wide)
    send_cpu_s: float
    recv_cpu_s: float


@dataclass(frozen=True)
class WireResult:
    case: str
    connections: int
    kv_bytes: int
    pdd_gb_s: float  # medians
    raw_gb_s: float
    pdd_send_cpu_s_per_gb: float
    pdd_recv_cpu_s_per_gb: float
    raw_send_cpu_s_per_gb: float
    raw_recv_cpu_s_per_gb: float
    pdd_runs: list[WireRun]
    raw_runs: list[WireRun]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def _layout_of(case: WireCase) -> tuple[KVLayout, torch.dtype]:
    return case.layout, kv_wire.DTYPE_NAMES[case.dtype]


def _pdd_receiver_child(pipe: multiprocessing.connection.Connection) -> None:
    """Serves commands: ("listen", case) -> port; ("expect", rid, tokens) -> "ready", then (done_at, cpu_s, crc)."""

    async def serve() -> None:
        receiver: KVReceiver | None = None
        while (command := await asyncio.to_thread(pipe.recv))[0] != "stop":
            if command[0] == "listen":
                if receiver is not None:
                    await receiver.stop()
                layout, dtype = _layout_of(command[1])
                receiver = KVReceiver(layout, dtype)
                pipe.send(await receiver.start("127.0.0.1", 0))
                continue
            assert receiver is not None
            _, rid, tokens = command
            inbox = receiver.expect(rid, 0, tokens)
            cpu0 = _cpu_s()
            pipe.send("ready")
            kv = await inbox.wait(CHILD_TIMEOUT_S)
            cpu_s = _cpu_s() - cpu0
            assert inbox.done_at is not None
            crc = kv_wire.checksum(kv_wire.payload_rows(kv) or [])  # outside the measured time
            receiver.release(rid)
            pipe.send((inbox.done_at, cpu_s, crc))
        if receiver is not None:
            await receiver.stop()

    asyncio.run(serve())


def _pdd_sender_child(pipe: multiprocessing.connection.Connection) -> None:
    """Serves ("source", case) -> crc of fresh random KV; ("send", rid, port, connections) -> (t0, cpu_s, bytes)."""

    async def serve() -> None:
        kv = torch.empty(0)
        layout, dtype = SMOLLM2_LAYOUT, torch.float32
        senders: dict[tuple[int, int], KVSender] = {}
        while (command := await asyncio.to_thread(pipe.recv))[0] != "stop":
            if command[0] == "source":
                layout, dtype = _layout_of(command[1])
                kv = torch.randn(layout.num_layers, 2, layout.kv_heads, command[1].tokens, layout.head_dim,
                                 dtype=dtype)  # P's KV: its pages are P's already
                pipe.send(kv_wire.checksum(kv_wire.payload_rows(kv) or []))
                continue
            _, rid, port, connections = command
            if (port, connections) not in senders:
                senders[(port, connections)] = KVSender(layout, dtype, connect_timeout_s=10.0,
                                                        connections_per_peer=connections, stall_timeout_s=30.0)
            sender = senders[(port, connections)]
            await sender.connections("127.0.0.1", port)  # P keeps its pool: connections are warm
            cpu0, t0 = _cpu_s(), time.monotonic()
            transfer = OutgoingTransfer(sender, KVTarget("main", "127.0.0.1", port), rid, QUEUE_CHUNKS,
                                        CHILD_TIMEOUT_S)
            for start in range(0, kv.shape[3], CHUNK_TOKENS):
                await transfer.put(start, kv[:, :, :, start:start + CHUNK_TOKENS])
            result = await transfer.finish()
            if result.state is not TransferState.DONE:
                raise RuntimeError(f"pdd transfer failed: {result.error}")
            pipe.send((t0, _cpu_s() - cpu0, result.kv_bytes))
        for sender in senders.values():
            await sender.close()

    asyncio.run(serve())


def _raw_receiver_child(pipe: multiprocessing.connection.Connection) -> None:
    """Serves ("recv", nbytes, connections): accepts that many connections, recv_into a pre-touched
    16 MiB buffer each until the bytes are in; answers (done_at, cpu_s)."""
    listener = socket.create_server(("127.0.0.1", 0))
    pipe.send(listener.getsockname()[1])
    while (command := pipe.recv())[0] != "stop":
        _, nbytes, connections = command
        pipe.send("ready")
        socks = [listener.accept()[0] for _ in range(connections)]
        cpu0 = _cpu_s()

        def take(sock: socket.socket, share: int) -> None:
            view = memoryview(bytearray(b"\1" * RAW_BUFFER_BYTES))
            while share > 0:
                got = sock.recv_into(view, min(share, RAW_BUFFER_BYTES))
                if not got:
                    raise ConnectionError("raw sender closed early")
                share -= got

        _each_in_a_thread(take, socks, _shares(nbytes, connections))
        done_at, cpu_s = time.monotonic(), _cpu_s() - cpu0
        for sock in socks:
            sock.close()
        pipe.send((done_at, cpu_s))
    listener.close()


def _raw_sender_child(pipe: multiprocessing.connection.Connection) -> None:
    """Serves ("send", port, nbytes, connections): sendall from a pre-touched 16 MiB buffer per connection."""
    buffer = memoryview(bytearray(b"\1" * RAW_BUFFER_BYTES))
    while (command := pipe.recv())[0] != "stop":
        _, port, nbytes, connections = command
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]

        def give(sock: socket.socket, share: int) -> None:
            while share > 0:
                sock.sendall(buffer[:min(share, RAW_BUFFER_BYTES)])
                share -= min(share, RAW_BUFFER_BYTES)

        cpu0, t0 = _cpu_s(), time.monotonic()
        _each_in_a_thread(give, socks, _shares(nbytes, connections))
        cpu_s = _cpu_s() - cpu0
        for sock in socks:
            sock.close()
        pipe.send((t0, cpu_s))


def _each_in_a_thread(move: Callable[[socket.socket, int], None], socks: list[socket.socket],
                      shares: list[int]) -> None:
    """move(sock, share) for every connection at once, one thread each; returns when all are done."""
    threads = [threading.Thread(target=move, args=(sock, share)) for sock, share in zip(socks, shares, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _shares(nbytes: int, parts: int) -> list[int]:
    return [nbytes // parts + (1 if i < nbytes % parts else 0) for i in range(parts)]


class _Child:
    """A child process and its end of a pipe."""

    def __init__(self, target: object) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=target, args=(theirs,), daemon=True)
        self.process.start()

    def ask(self, *command: object) -> object:
        self.pipe.send(command)
        return self.answer()

    def answer(self) -> object:
        if not self.pipe.poll(CHILD_TIMEOUT_S):
            raise TimeoutError(f"{self.process.name} did not answer within {CHILD_TIMEOUT_S:g}s")
        return self.pipe.recv()

    def stop(self) -> None:
        self.pipe.send(("stop",))
        self.process.join(30)


def _pdd_once(case: WireCase, receiver: _Child, sender: _Child, port: int, source_crc: int) -> WireRun:
    rid = "req-" + uuid.uuid4().hex
    if receiver.ask("expect", rid, case.tokens) != "ready":
        raise RuntimeError("pdd receiver did not get ready")
    t0, send_cpu_s, _ = sender.ask("send", rid, port, case.connections)  # type: ignore[misc]
    done_at, recv_cpu_s, crc = receiver.answer()  # type: ignore[misc]
    if crc != source_crc:
        raise RuntimeError(f"{case.name}: the KV received differs from the KV sent")
    return WireRun(done_at - t0, send_cpu_s, recv_cpu_s)


def _raw_once(case: WireCase, receiver: _Child, sender: _Child, port: int) -> WireRun:
    receiver.pipe.send(("recv", case.kv_bytes, case.connections))
    if receiver.answer() != "ready":
        raise RuntimeError("raw receiver did not get ready")
    t0, send_cpu_s = sender.ask("send", port, case.kv_bytes, case.connections)  # type: ignore[misc]
    done_at, recv_cpu_s = receiver.answer()  # type: ignore[misc]
    return WireRun(done_at - t0, send_cpu_s, recv_cpu_s)


def run_vs_raw(cases: list[WireCase], repeats: int) -> list[WireResult]:
    pdd_receiver, pdd_sender = _Child(_pdd_receiver_child), _Child(_pdd_sender_child)
    raw_receiver, raw_sender = _Child(_raw_receiver_child), _Child(_raw_sender_child)
    results = []
    try:
        raw_port = int(raw_receiver.answer())  # type: ignore[call-overload]
        shape = None
        for case in cases:
            if shape != (case.layout, case.dtype, case.tokens):
                shape = (case.layout, case.dtype, case.tokens)
                port = int(pdd_receiver.ask("listen", case))  # type: ignore[call-overload]
                source_crc = int(pdd_sender.ask("source", case))  # type: ignore[call-overload]
            pdd_runs: list[WireRun] = []
            raw_runs: list[WireRun] = []
            _pdd_once(case, pdd_receiver, pdd_sender, port, source_crc)  # warm-up: pages, pool, code paths
            _raw_once(case, raw_receiver, raw_sender, raw_port)
            for repeat in range(repeats):  # alternated, so load that comes and goes hits both
                if repeat % 2:
                    raw_runs.append(_raw_once(case, raw_receiver, raw_sender, raw_port))
                    pdd_runs.append(_pdd_once(case, pdd_receiver, pdd_sender, port, source_crc))
                else:
                    pdd_runs.append(_pdd_once(case, pdd_receiver, pdd_sender, port, source_crc))
                    raw_runs.append(_raw_once(case, raw_receiver, raw_sender, raw_port))
            result = _summarise(case, pdd_runs, raw_runs)
            results.append(result)
            print(f"  {case.name}, {case.connections} conn: pdd {result.pdd_gb_s:.2f} GB/s, raw "
                  f"{result.raw_gb_s:.2f} GB/s", file=sys.stderr, flush=True)
    finally:
        for child in (pdd_receiver, pdd_sender, raw_receiver, raw_sender):
            child.stop()
    return results


def _summarise(case: WireCase, pdd: list[WireRun], raw: list[WireRun]) -> WireResult:
    gb = case.kv_bytes / 1e9

    def median(runs: list[WireRun], field: str) -> float:
        return statistics.median(getattr(run, field) for run in runs)

    return WireResult(case.name, case.connections, case.kv_bytes, gb / median(pdd, "seconds"),
                      gb / median(raw, "seconds"), median(pdd, "send_cpu_s") / gb, median(pdd, "recv_cpu_s") / gb,
                      median(raw, "send_cpu_s") / gb, median(raw, "recv_cpu_s") / gb, pdd, raw)


def iperf3_gb_s(connections: int, seconds: float) -> float | None:
    """iperf3's own loopback rate with that many streams (None: iperf3 is not installed)."""
    if shutil.which("iperf3") is None:
        return None
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            client = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds),
                                     "-P", str(connections), "-J"], capture_output=True, text=True)
            report = json.loads(client.stdout or "{}")
            if client.returncode == 0 and "sum_received" in report.get("end", {}):
                return report["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
            time.sleep(0.1)  # the server is not listening yet
        raise RuntimeError(f"iperf3 failed: {client.stderr.strip() or client.stdout[-300:]}")
    finally:
        server.kill()
        server.wait()


def vs_raw_table(results: list[WireResult], iperf: dict[int, float | None]) -> str:
    lines = ["| case | conns | KV bytes | pdd GB/s | raw TCP GB/s | pdd / raw | iperf3 GB/s "
             "| pdd CPU s/GB send / recv | raw CPU s/GB send / recv |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rate = iperf.get(r.connections)
        lines.append(f"| {r.case} | {r.connections} | {r.kv_bytes / 1e6:,.0f} MB | {r.pdd_gb_s:.2f} | "
                     f"{r.raw_gb_s:.2f} | {r.pdd_gb_s / r.raw_gb_s:.0%} | "
                     f"{f'{rate:.2f}' if rate is not None else 'not installed'} | "
                     f"{r.pdd_send_cpu_s_per_gb:.2f} / {r.pdd_recv_cpu_s_per_gb:.2f} | "
                     f"{r.raw_send_cpu_s_per_gb:.2f} / {r.raw_recv_cpu_s_per_gb:.2f} |")
    return "\n".join(lines)


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
    p.add_argument("--vs-raw", action="store_true",
                   help="pdd against raw TCP and iperf3 over loopback, separate processes, no emulator")
    p.add_argument("--out", default="", help="also write the results as JSON to this file")
    transfer = p.add_argument_group("transfer mode")
    transfer.add_argument("--connections", default="1,2,4,8", help="parallel connections to try, comma-separated")
    transfer.add_argument("--target-s", type=float, default=1.5,
                          help="tokens per case are chosen for about this much line time (at most 2,000)")
    transfer.add_argument("--repeats", type=int, default=None,
                          help="transfers per case (the median is reported; --vs-raw: 3 unless given)")
    transfer.add_argument("--iperf-s", type=float, default=3.0, help="--vs-raw: seconds per iperf3 run")
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

    if args.vs_raw:
        connections = tuple(int(n) for n in (args.connections if args.connections != "1,2,4,8" else "1,4").split(","))
        iperf = {n: iperf3_gb_s(n, args.iperf_s) for n in connections}
        wire_results = run_vs_raw(wire_cases(connections), args.repeats or 3)
        print(f"pdd's KVSender/KVReceiver against raw TCP, loopback, separate processes; medians of "
              f"{args.repeats or 3}, alternated, after a warm-up of each; {before}; after: {machine()}\n")
        print(vs_raw_table(wire_results, iperf))
        if args.out:
            Path(args.out).write_text(json.dumps({"vs_raw": [asdict(r) for r in wire_results],
                                                  "iperf3_gb_s": iperf}, indent=2))
        return 0

    connections = tuple(int(n) for n in args.connections.split(","))
    results = asyncio.run(run_transfer_cases(default_cases(connections), args.target_s, args.repeats or 2))
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
