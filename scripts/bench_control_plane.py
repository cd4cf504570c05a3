"""The control plane at datacenter scale (#45 item 6): many simulated P, RLD and MD instances and
1, 2, 4 gateways on one machine, driven open-loop; per step: latency, NATS messages per request
(nats-server's /varz and /connz), and CPU seconds per request of each process class (/proc/<pid>/stat).

    .venv/bin/python scripts/bench_control_plane.py --prefill 4 --relay 12 --main 24 --gateways 1,2,4 \\
        --rates 10,20,40,80 --duration-s 20 --out docs/results/control_plane.json

The stack is real processes (nats-server with its monitoring port, `python -m services.<role>` with
`--engine sim`), each in its own process group, stopped at the end. Gateways are added to a running
set of instances (1, then 2, then 4), so the instances start once. See docs/scale.md.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from tools.nats_config import find_nats_server  # noqa: E402
from tools.processes import log_tail, signal_group, start_child, wait_exited  # noqa: E402
from tools.stack_config import LOOPBACK, free_port  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
NATS = "nats"
CLIENT = "client"  # this script: the load generator
ROLES = ("prefill", "relay", "main")
CLASSES = ("gateway", *ROLES, NATS, CLIENT)
WORDS = ("plan", "route", "token", "cache", "relay", "prefill", "decode", "link", "batch", "river", "stone", "cloud")


# --- pure parts (tests/test_bench_control_plane.py) -------------------------------------------------------


def cpu_seconds_of_stat(stat_line: str) -> float:
    """utime + stime of a /proc/<pid>/stat line, in seconds (the command may hold spaces and parens)."""
    fields = stat_line[stat_line.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5), counted from 1


def counter_delta(before: Mapping[str, float], after: Mapping[str, float], keys: Iterable[str]) -> dict[str, float]:
    return {k: float(after.get(k, 0)) - float(before.get(k, 0)) for k in keys}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered) - 1e-9)))
    return ordered[rank - 1]


def net(total: float, idle_per_s: float, elapsed_s: float, requests: int) -> float:
    """Per request, less what the idle control plane would have done in the same time."""
    return (total - idle_per_s * elapsed_s) / max(requests, 1)


def sustained(offered: int, completed: int, errors: int, p99_s: float, latency_bound_s: float,
              min_fraction: float = 0.97) -> bool:
    """A rate is sustained when (almost) every offered request completed, none failed, and the P99
    latency stayed under the bound: a queue that grows shows as a P99 that grows with the run."""
    return errors == 0 and completed >= min_fraction * offered and p99_s <= latency_bound_s


# --- the cluster ---------------------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    cls: str  # a CLASSES entry
    popen: subprocess.Popen[bytes]
    log_path: Path

    def cpu_s(self) -> float:
        try:
            return cpu_seconds_of_stat(Path(f"/proc/{self.popen.pid}/stat").read_text())
        except OSError:
            return 0.0

    def rss_bytes(self) -> int:
        try:
            for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0


@dataclass
class Cluster:
    run_dir: Path
    model: str
    sim_device: str
    pipeline: str
    max_running_requests: int
    procs: list[Proc] = field(default_factory=list)
    nats_url: str = ""
    monitor_url: str = ""
    gateway_urls: list[str] = field(default_factory=list)
    kv_secret: Path | None = None

    def _spawn(self, name: str, cls: str, argv: list[str]) -> Proc:
        path = self.run_dir / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        with path.open("wb") as log_file:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True, preexec_fn=functools.partial(start_child, None))
        proc = Proc(name, cls, popen, path)
        self.procs.append(proc)
        return proc

    async def start_nats(self) -> None:
        port, monitor = free_port(), free_port()
        self._spawn(NATS, NATS, [str(find_nats_server()), "-a", LOOPBACK, "-p", str(port), "-m", str(monitor)])
        self.nats_url = f"nats://{LOOPBACK}:{port}"
        self.monitor_url = f"http://{LOOPBACK}:{monitor}"
        self.kv_secret = self.run_dir / "kv-secret"
        self.kv_secret.write_text(os.urandom(16).hex() + "\n")
        self.kv_secret.chmod(0o600)
        async with aiohttp.ClientSession() as session:
            await _poll(lambda: _get_json(session, f"{self.monitor_url}/varz"), 10.0, "nats-server")

    def start_instances(self, counts: Mapping[str, int]) -> None:
        assert self.kv_secret is not None
        for role in ROLES:
            for i in range(counts[role]):
                argv = [sys.executable, "-m", f"services.{role}", "--nats-url", self.nats_url, "--model", self.model,
                        "--instance-id", f"{role}-{i}", "--engine", "sim", "--sim-device", self.sim_device,
                        "--torch-threads", "1", "--log-level", "WARNING", "--kv-secret-file", str(self.kv_secret)]
                if role != "prefill":
                    argv += ["--kv-host", LOOPBACK, "--kv-port", "0"]
                self._spawn(f"{role}-{i}", role, argv)

    def start_gateway(self) -> str:
        i, port = len(self.gateway_urls), free_port()
        self._spawn(f"gateway-{i}", "gateway", [
            sys.executable, "-m", "services.gateway", "--nats-url", self.nats_url, "--model", self.model,
            "--instance-id", f"gateway-{i}", "--host", LOOPBACK, "--port", str(port), "--pipeline", self.pipeline,
            "--max-running-requests", str(self.max_running_requests), "--log-level", "WARNING"])
        url = f"http://{LOOPBACK}:{port}"
        self.gateway_urls.append(url)
        return url

    async def wait_ready(self, counts: Mapping[str, int], timeout_s: float) -> None:
        """Every gateway has heard (and pinged) every instance."""
        async def ready(session: aiohttp.ClientSession, url: str) -> bool:
            self.check_alive()
            health = await _get_json(session, f"{url}/healthz")
            return health is not None and all(health["instances"].get(r, 0) >= counts[r] for r in ROLES)

        async with aiohttp.ClientSession() as session:
            for url in self.gateway_urls:
                await _poll(functools.partial(ready, session, url), timeout_s, f"{url}/healthz with all instances")

    def check_alive(self) -> None:
        for p in self.procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{log_tail(p.log_path, 2000)}")

    def cpu_by_class(self) -> dict[str, float]:
        totals = dict.fromkeys(CLASSES, 0.0)
        for p in self.procs:
            totals[p.cls] += p.cpu_s()
        usage = os.times()
        totals[CLIENT] = usage.user + usage.system
        return totals

    def rss_by_class(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for cls in CLASSES:
            rss = [p.rss_bytes() for p in self.procs if p.cls == cls]
            if rss:
                out[cls] = {"processes": len(rss), "mean_mib": statistics.mean(rss) / 2**20,
                            "total_mib": sum(rss) / 2**20}
        return out

    async def stop(self) -> None:
        order = ("gateway", "relay", "main", "prefill", NATS)
        for cls in order:
            stage = [p.popen for p in self.procs if p.cls == cls]
            for popen in stage:
                signal_group(popen, signal.SIGTERM)
            await wait_exited(stage, 10.0)
            for popen in stage:
                signal_group(popen, signal.SIGKILL, after_exit=True)
            await wait_exited(stage, 5.0)


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=3.0)) as resp:
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def _poll(probe: Callable[[], Awaitable[object]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await probe():
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{what} not ready within {timeout_s:.0f} s")


# --- counters -------------------------------------------------------------------------------------------------

VARZ_KEYS = ("in_msgs", "out_msgs", "in_bytes", "out_bytes")


async def nats_counters(session: aiohttp.ClientSession, monitor_url: str) -> dict[str, object]:
    """Server totals (/varz) and, per named connection, the messages it sent and received (/connz)."""
    varz = await _get_json(session, f"{monitor_url}/varz") or {}
    connz = await _get_json(session, f"{monitor_url}/connz?limit=1024") or {}
    by_name = {c.get("name", str(c.get("cid"))): {"in_msgs": c.get("in_msgs", 0), "out_msgs": c.get("out_msgs", 0)}
               for c in connz.get("connections", [])}
    return {"server": {k: varz.get(k, 0) for k in VARZ_KEYS}, "connections": by_name}


# --- load -----------------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    gateways: int
    rate_per_s: float
    duration_s: float
    offered: int
    completed: int
    errors: int
    latency_p50_s: float
    latency_p90_s: float
    latency_p99_s: float
    achieved_per_s: float
    sustained: bool
    load_avg_1m: float
    nats_msgs_per_request: dict[str, float]
    gateway_msgs_in_per_request: float  # what NATS delivered to all gateways together, per request
    cpu_ms_per_request: dict[str, float]
    # the same less what the idle control plane (heartbeats, pings) sends and spends in as long
    nats_msgs_per_request_net: dict[str, float]
    gateway_msgs_in_per_request_net: float
    cpu_ms_per_request_net: dict[str, float]
    cpu_cores_used: dict[str, float]
    error_samples: list[str]


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float) -> tuple[float, str]:
    started = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            text = await resp.text()
            if resp.status != 200:
                return time.perf_counter() - started, f"HTTP {resp.status}: {text[:200]}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return time.perf_counter() - started, f"{type(exc).__name__}: {exc}"
    return time.perf_counter() - started, ""


async def run_step(cluster: Cluster, session: aiohttp.ClientSession, rate_per_s: float, duration_s: float,
                   max_tokens: int, latency_bound_s: float, seed: int, idle: IdleRates | None = None) -> StepResult:
    """Poisson arrivals at `rate_per_s` for `duration_s`, round-robin over the gateways; counters
    from the first arrival to the last answer."""
    rng = random.Random(seed)
    urls = cluster.gateway_urls
    load_avg = os.getloadavg()[0]
    nats_before, cpu_before = await nats_counters(session, cluster.monitor_url), cluster.cpu_by_class()
    began = time.perf_counter()
    tasks: list[asyncio.Task[tuple[float, str]]] = []
    next_at, i = 0.0, 0
    while next_at < duration_s:
        delay = began + next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        body = {"messages": [{"role": "user", "content": prompt(rng)}], "max_tokens": max_tokens}
        tasks.append(asyncio.create_task(one_request(session, urls[i % len(urls)], body, latency_bound_s * 10)))
        i += 1
        next_at += rng.expovariate(rate_per_s)
    results = await asyncio.gather(*tasks)
    elapsed_s = time.perf_counter() - began
    cpu_after, nats_after = cluster.cpu_by_class(), await nats_counters(session, cluster.monitor_url)
    latencies = [lat for lat, err in results if not err]
    errors = [err for _, err in results if err]
    n = len(results)
    server = counter_delta(nats_before["server"], nats_after["server"], VARZ_KEYS)  # type: ignore[arg-type]
    conns_before: dict = nats_before["connections"]  # type: ignore[assignment]
    conns_after: dict = nats_after["connections"]  # type: ignore[assignment]
    gateway_in = gateway_msgs_in(conns_before, conns_after)
    cpu = counter_delta(cpu_before, cpu_after, CLASSES)
    p99 = percentile(latencies, 99)
    idle = idle or IdleRates({"in_msgs": 0.0, "out_msgs": 0.0}, 0.0, dict.fromkeys(CLASSES, 0.0))
    per_request = max(n, 1)
    return StepResult(
        gateways=len(urls), rate_per_s=rate_per_s, duration_s=duration_s, offered=n, completed=len(latencies),
        errors=len(errors), latency_p50_s=percentile(latencies, 50), latency_p90_s=percentile(latencies, 90),
        latency_p99_s=p99, achieved_per_s=len(latencies) / elapsed_s,
        sustained=sustained(n, len(latencies), len(errors), p99, latency_bound_s), load_avg_1m=load_avg,
        nats_msgs_per_request={"in": server["in_msgs"] / max(n, 1), "out": server["out_msgs"] / max(n, 1)},
        gateway_msgs_in_per_request=gateway_in / max(n, 1),
        cpu_ms_per_request={k: 1000 * v / max(n, 1) for k, v in cpu.items()},
        cpu_cores_used={k: v / elapsed_s for k, v in cpu.items()},
        nats_msgs_per_request_net={"in": net(server["in_msgs"], idle.nats_msgs_per_s["in_msgs"], elapsed_s, n),
                                   "out": net(server["out_msgs"], idle.nats_msgs_per_s["out_msgs"], elapsed_s, n)},
        gateway_msgs_in_per_request_net=net(gateway_in, idle.gateway_msgs_in_per_s, elapsed_s, n),
        cpu_ms_per_request_net={k: 1000 * net(v, idle.cpu_cores_used[k], elapsed_s, per_request)
                                for k, v in cpu.items()},
        error_samples=sorted(set(errors))[:3])


@dataclass
class IdleRates:
    """The control plane's cost with no request: heartbeats and liveness pings."""
    nats_msgs_per_s: dict[str, float]  # in_msgs, out_msgs
    gateway_msgs_in_per_s: float
    cpu_cores_used: dict[str, float]


async def idle_rates(cluster: Cluster, session: aiohttp.ClientSession, seconds: float) -> IdleRates:
    nats_before, cpu_before = await nats_counters(session, cluster.monitor_url), cluster.cpu_by_class()
    await asyncio.sleep(seconds)
    cpu_after, nats_after = cluster.cpu_by_class(), await nats_counters(session, cluster.monitor_url)
    server = counter_delta(nats_before["server"], nats_after["server"], VARZ_KEYS)  # type: ignore[arg-type]
    cpu = counter_delta(cpu_before, cpu_after, CLASSES)
    gateway_in = gateway_msgs_in(nats_before["connections"], nats_after["connections"])  # type: ignore[arg-type]
    return IdleRates({k: server[k] / seconds for k in ("in_msgs", "out_msgs")}, gateway_in / seconds,
                     {k: v / seconds for k, v in cpu.items()})


def gateway_msgs_in(conns_before: Mapping[str, Mapping[str, float]],
                    conns_after: Mapping[str, Mapping[str, float]]) -> float:
    """Messages NATS delivered to the gateways' connections (named gateway-<i>) between two /connz."""
    return sum(c["out_msgs"] - conns_before.get(name, {}).get("out_msgs", 0)
               for name, c in conns_after.items() if name.startswith("gateway-"))


# --- report ---------------------------------------------------------------------------------------------------


def table(steps: Sequence[StepResult]) -> str:
    """One row per step; messages and CPU per request net of the idle control plane's."""
    head = ("gw", "rate/s", "done/s", "err", "p50 ms", "p99 ms", "ok", "nats in/req", "nats out/req", "gw in/req",
            "gw ms/req", "nats ms/req", "P+RLD+MD ms/req", "client ms/req", "load")
    rows = [head]
    for s in steps:
        c = s.cpu_ms_per_request_net
        rows.append((str(s.gateways), f"{s.rate_per_s:g}", f"{s.achieved_per_s:.1f}", str(s.errors),
                     f"{1000 * s.latency_p50_s:.0f}", f"{1000 * s.latency_p99_s:.0f}", "yes" if s.sustained else "NO",
                     f"{s.nats_msgs_per_request_net['in']:.1f}", f"{s.nats_msgs_per_request_net['out']:.1f}",
                     f"{s.gateway_msgs_in_per_request_net:.1f}", f"{c['gateway']:.2f}", f"{c[NATS]:.2f}",
                     f"{c['prefill'] + c['relay'] + c['main']:.2f}", f"{c[CLIENT]:.2f}", f"{s.load_avg_1m:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows)


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


async def main_async(args: argparse.Namespace) -> int:
    counts = {"prefill": args.prefill, "relay": args.relay, "main": args.main}
    gateway_steps = parse_ints(args.gateways)
    run_dir = Path(tempfile.mkdtemp(prefix="pdd-control-plane-"))
    cluster = Cluster(run_dir, args.model, args.sim_device, args.pipeline, args.max_running_requests)
    flags = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report: dict[str, object] = {"args": flags, "counts": counts, "cpus": os.cpu_count(), "steps": [], "idle": {},
                                 "run_dir": str(run_dir)}
    steps: list[StepResult] = []
    try:
        started = time.monotonic()
        await cluster.start_nats()
        cluster.start_instances(counts)
        cluster.start_gateway()
        await cluster.wait_ready(counts, args.startup_timeout_s)
        report["startup_s"] = time.monotonic() - started
        print(f"{sum(counts.values())} instances and 1 gateway ready in {report['startup_s']:.0f} s "
              f"(logs in {run_dir})", flush=True)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for g in gateway_steps:
                while len(cluster.gateway_urls) < g:
                    cluster.start_gateway()
                await cluster.wait_ready(counts, args.startup_timeout_s)
                await asyncio.sleep(2.0)  # the new gateways' first pings settle
                idle = await idle_rates(cluster, session, args.idle_s)
                report["idle"][str(g)] = asdict(idle)  # type: ignore[index]
                await run_step(cluster, session, min(parse_floats(args.rates)), 3.0, args.max_tokens,
                               args.latency_bound_s, seed=0)  # warm-up: the gateways' first requests
                for rate in parse_floats(args.rates):
                    step = await run_step(cluster, session, rate, args.duration_s, args.max_tokens,
                                          args.latency_bound_s, seed=int(rate * 1000) + g, idle=idle)
                    steps.append(step)
                    print(table([step]).splitlines()[-1], flush=True)
                    cluster.check_alive()
                    if not step.sustained and not args.keep_going:
                        break
            report["rss"] = cluster.rss_by_class()
    finally:
        await cluster.stop()
    report["steps"] = [asdict(s) for s in steps]
    print()
    print(table(steps))
    print("RSS by class:", json.dumps(report.get("rss", {})))
    print("idle (heartbeats and pings):", json.dumps(report["idle"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", type=int, default=4)
    parser.add_argument("--relay", type=int, default=12)
    parser.add_argument("--main", type=int, default=24)
    parser.add_argument("--gateways", default="1,2,4", help="gateway counts to measure, in increasing order")
    parser.add_argument("--rates", default="10,20,40,80", help="offered requests/s, each a step")
    parser.add_argument("--duration-s", type=float, default=20.0, help="arrivals per step")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--latency-bound-s", type=float, default=2.0,
                        help="a step is sustained when its P99 latency stays under this (and nothing fails)")
    parser.add_argument("--keep-going", action="store_true", help="run every rate even past an unsustained one")
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sim-device", default="h100")
    parser.add_argument("--pipeline", default="auto")
    parser.add_argument("--max-running-requests", type=int, default=0, help="per gateway; 0: no limit")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(main_async(args))
    return 130


if __name__ == "__main__":
    sys.exit(main())
