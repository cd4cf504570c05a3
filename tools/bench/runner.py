"""Run the benchmark: for each mode, start its stack once, then warm up and replay every workload.

Owns the order (modes x workloads), the stack's life, the WAN counters around each replay and the
progress bar. Writing results is the caller's (`on_result`), so a run cut short keeps what it did.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import aiohttp
from tqdm import tqdm

from shared import bus, messages, subjects
from shared.messages import Heartbeat
from shared.models import DTYPES, kv_layout
from shared.names import Role
from tools.bench import cpu, metrics
from tools.bench.config import BenchConfig, Target
from tools.bench.modes import MODES, Mode, pipeline_of, request_fields, stack_config, unavailable_reason
from tools.bench.replay import Replayer, RequestRecord, warmup_requests
from tools.bench.workloads import Workload, agentic_workload, mooncake_workload, synthetic_workload
from tools.launcher import LocalStack
from tools.stack_config import StackConfig

log = logging.getLogger(__name__)
Json = dict[str, object]


@dataclass
class RunResult:
    mode: str
    workload: Workload
    records: list[RequestRecord]
    duration_s: float
    metrics: Json
    stack: Json = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)  # per process over the replay (tools/bench/cpu.py)

    @property
    def name(self) -> str:
        return f"{self.workload.name}__{self.mode}"


def plan_workloads(cfg: BenchConfig) -> list[Workload]:
    n, rate, seed = cfg.load.max_requests, cfg.load.request_rate, cfg.seed
    plans: list[Workload] = []
    for kind in cfg.workloads:
        if kind == "agentic":
            for h in cfg.hit_rates or (cfg.agentic.hit_rate,):
                opts = cfg.agentic.__class__(**{**asdict(cfg.agentic), "hit_rate": h})
                plans.append(agentic_workload(opts, n, rate, seed))
        elif kind == "mooncake":
            plans.append(mooncake_workload(cfg.mooncake, n, seed))
        elif kind == "synthetic":
            plans.append(synthetic_workload(cfg.synthetic, n, rate, seed))
        else:
            raise ValueError(f"unknown workload {kind!r}")
    return plans


def skipped_modes(cfg: BenchConfig) -> dict[str, str]:
    return {name: reason for name in cfg.modes if (reason := unavailable_reason(name)) is not None}


def _kv_bytes_per_token(stack: LocalStack, dtype: str) -> int:
    assert stack.model_path is not None  # set once the stack started
    return kv_layout(stack.model_path).bytes_per_token_fp32 * DTYPES[dtype].itemsize // 4


async def _wan_kv_bytes(stack: LocalStack, settle_s: float = 0.5, limit_s: float = 10.0) -> int | None:
    """A->B bytes the emulator delivered on the MDs' KV routes (payload, frame headers, handshakes),
    once the count stops moving (aborted transfers may still drain); None in one datacenter."""
    if not stack.config.two_dc:
        return None
    deadline = time.monotonic() + limit_s
    last = -1
    while True:
        stats = await stack.wan.stats()
        now = sum(int(stats["routes"][route]["a_to_b"]["bytes"]) for route in stack.md_kv_routes)
        if now == last or time.monotonic() >= deadline:
            return now
        last = now
        await asyncio.sleep(settle_s)


RELAY_FINISHED_STATS = ("relay_finished_wan_bytes", "relay_finished_kv_bytes", "backfill_wan_bytes")
BACKFILL_WAIT_S = 120.0  # how long a workload's end waits for P's backfills of MD's DRC to end


async def _relay_finished_bytes(stack: LocalStack, timeout_s: float = 10.0) -> tuple[int, int, int] | None:
    """P's counts, from a heartbeat sent after this call began: KV bytes sent toward MD for requests
    RLD finished alone before it did, the KV MD lacked of them, and the bytes sent after, in the
    background, for MD's DRC. Waits (up to BACKFILL_WAIT_S) until no backfill is under way, so the
    WAN's byte count includes them; None if P's heartbeat lacks the counts."""
    deadline = time.monotonic() + BACKFILL_WAIT_S
    while True:
        stats = await prefill_stats(stack, timeout_s)
        if stats is None or any(key not in stats for key in RELAY_FINISHED_STATS):
            return None
        ended = sum(stats.get(f"backfills_{outcome}", 0) for outcome in ("done", "failed", "aborted"))
        if stats.get("backfills_started", 0) <= ended or time.monotonic() > deadline:
            return tuple(int(stats[key]) for key in RELAY_FINISHED_STATS)  # type: ignore[return-value]
        await asyncio.sleep(0.5)


async def prefill_stats(stack: LocalStack, timeout_s: float) -> dict[str, float] | None:
    """Every P's heartbeat stats, summed, each from a heartbeat sent after this call began; None if
    one of them sends none."""
    after = time.time() + 0.05
    count = stack.config.count_of(Role.PREFILL)
    nc = await bus.connect(stack.nats_url, "bench-prefill-stats", stack.nats_auth)
    beats: dict[str, Heartbeat] = {}
    all_heard = asyncio.Event()

    async def on_beat(msg) -> None:
        heartbeat = messages.decode(msg.data)
        if heartbeat.sent_at > after and heartbeat.instance_id not in beats:
            beats[heartbeat.instance_id] = heartbeat
            if len(beats) >= count:
                all_heard.set()

    try:
        await nc.subscribe(subjects.heartbeat(Role.PREFILL), cb=on_beat)
        async with asyncio.timeout(timeout_s):
            await all_heard.wait()
    except TimeoutError:
        return None
    finally:
        await nc.close()
    summed: dict[str, float] = {}
    for beat in beats.values():
        for key, value in beat.stats.items():
            summed[key] = summed.get(key, 0) + value
    return summed


def stack_facts(mode: Mode, cfg: BenchConfig, stack_cfg: StackConfig) -> Json:
    return {"model": cfg.stack.model, "dtype": cfg.stack.dtype, "two_dc": mode.two_dc,
            "pipeline": pipeline_of(mode), "handoff_mode": mode.handoff_mode, "request_fields": request_fields(mode),
            "drc": mode.drc, "wan": asdict(cfg.wan) if mode.two_dc else None,
            "torch_threads": stack_cfg.torch_threads, "chunk_tokens": stack_cfg.chunk_tokens,
            "extra_args": {r: list(f) for r, f in stack_cfg.extra_args.items()},
            "gateway_datacenter": stack_cfg.gateway_datacenter if mode.two_dc else None,
            "cpu_affinity": {name: list(cores) for name, cores in stack_cfg.cpu_affinity.items()},
            "engine": stack_cfg.engine, "sim_device": stack_cfg.sim_device if stack_cfg.engine == "sim" else None,
            "sim_devices": dict(stack_cfg.sim_devices) or None,
            "instances": {role: stack_cfg.count_of(role) for role in ("prefill", "relay", "main")},
            "sim_profile": stack_cfg.sim_profile if stack_cfg.engine == "sim" else None,
            "sim_shape": stack_cfg.sim_shape or None, "kv_byte_scale": stack_cfg.kv_byte_scale,
            "wan_line_mbps": stack_cfg.wan_line_mbps if mode.two_dc else None}


# An idle pooled connection is closed by the client after this long, before any server closes it:
# the gateway does at --header-timeout-s (10 s), uvicorn (vLLM) at 5 s. A request sent on a
# connection the server is closing that very moment fails (ServerDisconnectedError: the first
# request after a pause of about the server's keep-alive, as after a warm-up, was lost so once).
CLIENT_KEEPALIVE_S = 1.0


def client_session() -> aiohttp.ClientSession:
    """The benchmark client's HTTP session: no total timeout (a request's own deadline governs)."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                 connector=aiohttp.TCPConnector(keepalive_timeout=CLIENT_KEEPALIVE_S))


async def run_on_stack(stack: LocalStack, mode: Mode, workloads: list[Workload], cfg: BenchConfig,
                       on_result: Callable[[RunResult], None] = lambda r: None) -> list[RunResult]:
    """Replay each workload in turn against a running stack configured for `mode`."""
    bytes_per_token = _kv_bytes_per_token(stack, cfg.stack.dtype)
    results = []
    async with client_session() as session:
        for workload in workloads:
            result = await _run_workload(stack, session, mode, workload, cfg, bytes_per_token)
            result.stack = stack_facts(mode, cfg, stack.config)
            on_result(result)
            results.append(result)
    return results


async def run_mode(mode: Mode, workloads: list[Workload], cfg: BenchConfig,
                   on_result: Callable[[RunResult], None] = lambda r: None) -> list[RunResult]:
    """A fresh stack for the mode (empty caches), every workload on it, then stop it."""
    began = time.monotonic()
    async with LocalStack(stack_config(mode, cfg, cfg.stack.log_dir / mode.name)) as stack:
        log.info("%s: stack up in %.1f s", mode.name, time.monotonic() - began)
        return await run_on_stack(stack, mode, workloads, cfg, on_result)


async def _run_workload(stack: LocalStack, session: aiohttp.ClientSession, mode: Mode, workload: Workload,
                        cfg: BenchConfig, bytes_per_token: int) -> RunResult:
    n = min(len(workload.requests), cfg.load.max_requests)
    bar = tqdm(total=n, desc=f"{mode.name} {workload.name}", unit="req", disable=not cfg.load.progress)
    replayer = Replayer(session, stack.api_url, request_fields(mode), cfg.load, on_done=lambda rec: bar.update())
    try:
        warm = await replayer.warm_up(warmup_requests(workload, cfg.load.warmup_requests))
        if failed := [r.error for r in warm if not r.ok]:
            log.warning("%s %s: %d warm-up requests failed, first: %s", mode.name, workload.name,
                        len(failed), failed[0])
        relay_before = await _relay_finished_bytes(stack) if mode.relay else None
        before = await _wan_kv_bytes(stack)
        pids = {role: proc.pid for role, proc in stack.processes.items()}
        cpu_before = cpu.cpu_seconds(pids)
        records, duration_s = await replayer.run(workload.requests)
        cpu_used = cpu.used_between(cpu_before, cpu.cpu_seconds(pids))
        relay_after = await _relay_finished_bytes(stack) if relay_before is not None else None
        after = await _wan_kv_bytes(stack)
    finally:
        bar.close()
    wan_bytes = after - before if before is not None and after is not None else None
    relay_finished = (None if relay_before is None or relay_after is None
                      else tuple(a - b for a, b in zip(relay_after, relay_before)))
    summary = metrics.summarize(records, duration_s, slo=cfg.slo, costs=cfg.costs,
                                instances=mode.instances(stack.config),
                                kv_bytes_per_token=bytes_per_token, wan_emulator_bytes=wan_bytes,
                                relay_finished_bytes=relay_finished)
    return RunResult(mode.name, workload, records, duration_s, summary, cpu_s=cpu_used)


async def run_target(target: Target, workloads: list[Workload], cfg: BenchConfig,
                     on_result: Callable[[RunResult], None] = lambda r: None) -> list[RunResult]:
    """Replay each workload against a server pdd did not start, with the same client and metrics.

    Its requests carry no `pdd` object; TTFT and gaps are timed per chunk of text. A session's
    next turn cannot append an answer whose token ids the server did not return, so multi-turn
    workloads are not comparable against a target: use the synthetic one."""
    results = []
    async with client_session() as session:
        for workload in workloads:
            n = min(len(workload.requests), cfg.load.max_requests)
            bar = tqdm(total=n, desc=f"{target.name} {workload.name}", unit="req", disable=not cfg.load.progress)
            replayer = Replayer(session, target.url, None, cfg.load, on_done=lambda rec, bar=bar: bar.update(),
                                model=target.model)
            try:
                warm = await replayer.warm_up(warmup_requests(workload, cfg.load.warmup_requests))
                if failed := [r.error for r in warm if not r.ok]:
                    log.warning("%s %s: %d warm-up requests failed, first: %s", target.name, workload.name,
                                len(failed), failed[0])
                records, duration_s = await replayer.run(workload.requests)
            finally:
                bar.close()
            summary = metrics.summarize(records, duration_s, slo=cfg.slo, costs=cfg.costs, instances={"target": 1},
                                        kv_bytes_per_token=0)
            result = RunResult(target.name, workload, records, duration_s, summary,
                               {"target": target.name, "url": target.url, "model": target.model or cfg.stack.model})
            on_result(result)
            results.append(result)
    return results


async def run_bench(cfg: BenchConfig, on_result: Callable[[RunResult], None] = lambda r: None) -> list[RunResult]:
    """Every available mode of cfg.modes over every workload (unavailable modes are left out), then
    every target."""
    workloads = plan_workloads(cfg)
    skipped = skipped_modes(cfg)
    results: list[RunResult] = []
    for name in cfg.modes:
        if name in skipped:
            log.warning("mode %s skipped: %s", name, skipped[name])
            continue
        results += await run_mode(MODES[name], workloads, cfg, on_result)
    for target in cfg.targets:
        results += await run_target(target, workloads, cfg, on_result)
    return results
