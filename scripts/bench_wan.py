"""Benchmark the WAN emulator: top throughput unlimited, and achieved rate at set bandwidths/delays.

Runs `python -m wan` as its own process (as in deployment), drives it from blocking
sockets on threads (cheap next to the emulator), changes the link over the control API between
cases, and prints a markdown table; `--out FILE` also writes the results as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CHUNK_BYTES = 1024 * 1024
CONTROL_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Case:
    name: str
    bandwidth_mbps: float  # 0: unlimited
    delay_ms: float
    connections: int
    direct: bool = False  # bypass the emulator: the load generator's own ceiling


@dataclass(frozen=True)
class Result:
    case: str
    bandwidth_mbps: float
    delay_ms: float
    connections: int
    achieved_mbps: float
    idle_rtt_ms: float
    emulator_cpu_pct: float | None


DEFAULT_CASES = (
    Case("direct (no emulator)", 0, 0, 1, direct=True),
    Case("unlimited", 0, 0, 1),
    Case("unlimited", 0, 0, 4),
    Case("1 Gbit/s", 1000, 0, 1),
    Case("100 Mbit/s", 100, 0, 1),
    Case("100 Mbit/s", 100, 15, 1),
    Case("100 Mbit/s", 100, 50, 1),
    Case("100 Mbit/s", 100, 15, 4),
)


class Upstream:
    """Threaded loopback server: 'sink' counts bytes, 'echo' sends them back."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.received_bytes = 0  # only grows; read without a lock is fine for a bench
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = bytearray(CHUNK_BYTES)
        with conn:
            try:
                while n := conn.recv_into(buf):
                    self.received_bytes += n
                    if self.mode == "echo":
                        conn.sendall(buf[:n])
            except OSError:
                return

    def close(self) -> None:
        self._sock.close()


def _control(base_url: str, path: str, body: dict[str, object] | None = None) -> dict[str, object]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base_url + path, data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=CONTROL_TIMEOUT_S) as resp:
        reply: dict[str, object] = json.loads(resp.read())
        return reply


def _start_emulator(sink_port: int, echo_port: int) -> tuple[subprocess.Popen[str], dict[str, int], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "wan", "--route", f"bulk=127.0.0.1:0->127.0.0.1:{sink_port}",
         "--route", f"echo=127.0.0.1:0->127.0.0.1:{echo_port}", "--control-port", "0", "--log-level", "WARNING"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    ports = {name: int(port) for name, port in re.findall(r"(\w+)=127\.0\.0\.1:(\d+)->", banner)}
    control = re.search(r"control=(http://\S+)", banner)
    if not ports or control is None:
        proc.kill()
        raise RuntimeError(f"emulator did not start: {banner!r}")
    return proc, ports, control.group(1)


def _cpu_s(pid: int) -> float | None:
    """User+system CPU seconds of a process (Linux /proc); None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_quiet(sink: Upstream, quiet_s: float = 0.3, limit_s: float = 15.0) -> None:
    """Let bytes left in socket buffers from the last case drain, so the RTT is an idle one."""
    deadline = time.monotonic() + limit_s
    last = -1
    while sink.received_bytes != last and time.monotonic() < deadline:
        last = sink.received_bytes
        time.sleep(quiet_s)


def _idle_rtt_ms(port: int, pings: int = 10) -> float:
    rtts = []
    with socket.create_connection(("127.0.0.1", port), timeout=CONTROL_TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(pings):
            t0 = time.perf_counter()
            sock.sendall(b"p" * 64)
            got = 0
            while got < 64:
                got += len(sock.recv(64 - got))
            rtts.append((time.perf_counter() - t0) * 1000)
    return statistics.median(rtts)


def _send_until(port: int, stop: threading.Event) -> None:
    payload = memoryview(bytes(CHUNK_BYTES))
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
        while not stop.is_set():
            try:
                sock.sendall(payload)
            except OSError:  # includes the timeout: blocked by backpressure after stop
                return


def _measure(port: int, sink: Upstream, case: Case, warmup_s: float, duration_s: float,
             emulator_pid: int | None) -> tuple[float, float | None]:
    stop = threading.Event()
    senders = [threading.Thread(target=_send_until, args=(port, stop)) for _ in range(case.connections)]
    for t in senders:
        t.start()
    time.sleep(warmup_s)
    bytes0, t0 = sink.received_bytes, time.perf_counter()
    cpu0 = _cpu_s(emulator_pid) if emulator_pid else None
    time.sleep(duration_s - warmup_s)
    bytes1, t1 = sink.received_bytes, time.perf_counter()
    cpu1 = _cpu_s(emulator_pid) if emulator_pid else None
    stop.set()
    for t in senders:
        t.join(timeout=10)
    cpu_pct = 100 * (cpu1 - cpu0) / (t1 - t0) if cpu0 is not None and cpu1 is not None else None
    return (bytes1 - bytes0) * 8 / (t1 - t0) / 1e6, cpu_pct


def run_cases(cases: tuple[Case, ...], warmup_s: float, duration_s: float) -> list[Result]:
    sink, echo = Upstream("sink"), Upstream("echo")
    proc, ports, control = _start_emulator(sink.port, echo.port)
    results = []
    try:
        for case in cases:
            if case.direct:
                rtt = _idle_rtt_ms(echo.port)
                mbps, cpu = _measure(sink.port, sink, case, warmup_s, duration_s, None)
            else:
                _control(control, "/link", {"bandwidth_mbps": case.bandwidth_mbps, "delay_ms": case.delay_ms})
                _wait_quiet(sink)
                rtt = _idle_rtt_ms(ports["echo"])
                mbps, cpu = _measure(ports["bulk"], sink, case, warmup_s, duration_s, proc.pid)
            results.append(Result(case.name, case.bandwidth_mbps, case.delay_ms, case.connections, mbps, rtt, cpu))
            print(f"  {case.name}, {case.delay_ms:g} ms, {case.connections} conn: {mbps:.0f} Mbit/s",
                  file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        sink.close()
        echo.close()
    return results


def markdown(results: list[Result]) -> str:
    lines = ["| case | one-way delay (ms) | conns | achieved (Mbit/s) | of set rate | idle RTT (ms) | emulator CPU |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        share = f"{100 * r.achieved_mbps / r.bandwidth_mbps:.0f}%" if r.bandwidth_mbps else "-"
        cpu = f"{r.emulator_cpu_pct:.0f}%" if r.emulator_cpu_pct is not None else "-"
        lines.append(f"| {r.case} | {r.delay_ms:g} | {r.connections} | {r.achieved_mbps:,.0f} | {share} "
                     f"| {r.idle_rtt_ms:.2f} | {cpu} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Benchmark the pdd WAN emulator")
    p.add_argument("--duration-s", type=float, default=3.0, help="seconds of load per case")
    p.add_argument("--warmup-s", type=float, default=0.5, help="seconds at the start of each case not counted")
    p.add_argument("--out", default="", help="also write the results as JSON to this file")
    args = p.parse_args(argv)
    results = run_cases(DEFAULT_CASES, args.warmup_s, args.duration_s)
    print(markdown(results))
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
