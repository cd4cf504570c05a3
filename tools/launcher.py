"""Start and stop a local pdd stack (nats-server, P, RLD, MD, gateway) as child processes.

Owns only the processes it starts: each runs in its own session, logs to `<log_dir>/<role>.log`
(a role's extra instances, `config.instances`, to `<role>-<i>.log`, each with its own KV port),
and is stopped in order (gateway, decoders, prefill, nats-servers, WAN emulator) with a deadline
per stage. With `topology="two-dc"` it also starts a second nats-server for datacenter B and the
WAN emulator between them (see docs/wan.md). With `nats_auth`, its nats-servers demand a user, a
password and a client certificate, made fresh under `<log_dir>/nats-auth`, and every service gets
the flags to match. The KV sockets always authenticate: P, RLD and MD get the operator's secret
file, or one made fresh under `<log_dir>/kv-secret`. It never speaks NATS itself; it polls the
gateway's /healthz and talks to the emulator's control API. With PDD_FORK_SERVER=1 in its environment
(the test suite sets it), it forks the Python services from a fork server that has imported them
once (tools/fork_server.py) instead of starting a fresh interpreter for each.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from types import TracebackType

import aiohttp

from shared.config import DEFAULT_MAX_PAYLOAD_BYTES, NatsAuth
from shared.models import resolve_model
from shared.sim_checkpoint import sim_checkpoint
from tools.fork_server import ForkedChild, ForkServer, ForkServerError, fork_server_for
from tools.nats_certs import NatsCerts, make_nats_certs
from tools.nats_config import (
    NATS_USER,
    find_nats_server,
    nats_auth_argv,
    nats_client_auth_conf,
    nats_gateway_conf,
    write_private,
)
from tools.processes import POLL_S, ChildProcess, log_tail, signal_group, start_child, wait_exited
from tools.stack_config import (
    KV_ROLES,
    KV_SECRET_FILE,
    LOOPBACK,
    MODEL_ROLES,
    NATS,
    NATS_B,
    NATS_GW_A_ROUTE,
    NATS_GW_B_ROUTE,
    STOP_STAGES,
    WAN,
    StackConfig,
    StackError,
    free_port,
    md_kv_route,
    port_is_free,
    role_of,
)
from tools.wan_control import WanControl

log = logging.getLogger(__name__)

STATE_FILE = "stack.json"
NATS_AUTH_DIR = "nats-auth"  # --nats-auth: under log_dir, the password file and certificates (mode 0700)
_WAN_BANNER = "wan_emulator listening:"
FORK_SERVER_ENV = "PDD_FORK_SERVER"  # "1": fork the Python services from a fork server


class LocalStack:
    """A pdd stack on this machine: `async with LocalStack(config) as stack: stack.api_url`."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.log_dir = config.log_dir.resolve()
        self.processes: dict[str, ChildProcess] = {}
        self.log_paths: dict[str, Path] = {}
        self.model_path: Path | None = None
        self.nats_url: str = config.nats_url or ""  # two-dc: datacenter A's (gateway, P, RLD)
        self.nats_url_b: str = ""  # two-dc: datacenter B's (MD)
        self.wan_control_url: str = ""  # two-dc: the emulator's control API
        self.wan_ports: dict[str, int] = {}  # two-dc: route name -> the emulator's listening port
        self.md_kv_ports: dict[int, int] = {}  # two-dc: MD number -> the port it binds (its route dials it)
        self.port: int = config.port
        self.nats_auth: NatsAuth | None = None  # --nats-auth: what a client of our nats-server(s) presents
        self.kv_secret_file: Path | None = None  # what P, RLD and MD authenticate their KV sockets with
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
    def md_kv_port(self) -> int:
        """two-dc: the port the first MD binds (the emulator's md_kv route dials it)."""
        return self.md_kv_ports.get(1, 0)

    @property
    def md_kv_routes(self) -> list[str]:
        """two-dc: the emulator's routes to the MDs' KV ports, one per MD."""
        return [md_kv_route(i) for i in range(1, self.config.count_of("main") + 1)]

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
        forks = self._fork_server()  # it imports while the nats-servers start and the model resolves
        if self.port == 0:
            self.port = free_port(self.config.host)
        elif not port_is_free(self.config.host, self.port):
            raise StackError(f"port {self.port} on {self.config.host} is in use; pass --port 0 for a free one")
        if self.config.nats_auth:
            await asyncio.to_thread(self._make_nats_credentials)
        self.kv_secret_file = self._kv_secret()
        self._check_cpu_affinity()
        if self.config.two_dc:
            if self.config.nats_url:
                raise StackError("--topology two-dc starts its own two nats-servers; drop --nats-url")
            await self._start_two_datacenters()
        elif not self.config.nats_url:
            await self._start_nats()
        log.info("resolving model %r", self.config.model)
        try:
            self.model_path = (await asyncio.to_thread(resolve_model, self.config.model)).resolve()
            if self.config.sim_shape or self.config.kv_byte_scale != 1:  # a shape and a KV layout, no weights
                self.model_path = await asyncio.to_thread(sim_checkpoint, self.model_path, self.config.sim_shape,
                                                          self.config.kv_byte_scale)
        except (FileNotFoundError, ValueError) as exc:
            raise StackError(str(exc)) from exc
        if forks is not None:
            try:
                await asyncio.to_thread(forks.wait_ready)
            except ForkServerError as exc:
                log.warning("%s; starting each service in a fresh interpreter instead", exc)
        for name in self.config.service_processes():
            self._argv[name] = self._service_argv(name)
            self._spawn(name, self._argv[name])
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
        write_private(password_file, self._nats_password + "\n")
        c = self._nats_certs
        self.nats_auth = NatsAuth(NATS_USER, str(password_file), str(c.ca), str(c.client_cert), str(c.client_key))

    def _kv_secret(self) -> Path:
        """The operator's KV secret file, or a fresh random one only we can read."""
        if self.config.kv_secret_file is not None:
            path = self.config.kv_secret_file.resolve()
            if not path.is_file():
                raise StackError(f"--kv-secret-file {path} does not exist")
            return path
        path = self.log_dir / KV_SECRET_FILE
        write_private(path, secrets.token_hex(32) + "\n")
        return path

    def _nats_client_conf(self) -> str:
        """The nats-server config lines that make clients log in (empty without --nats-auth)."""
        return nats_client_auth_conf(self._nats_password, self._nats_certs) if self._nats_certs else ""

    async def _start_nats(self) -> None:
        port = free_port()
        conf = self.log_dir / "nats-server.conf"
        write_private(conf, f"listen: {LOOPBACK}:{port}\nmax_payload: {DEFAULT_MAX_PAYLOAD_BYTES}\n"
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
        self.md_kv_ports = {i: free_port() for i in range(1, self.config.count_of("main") + 1)}
        await self._start_wan(gateway_ports)
        # The emulator's route into each datacenter's gateway port: the other side dials it, and the
        # server advertises it, so gossip never hands out an address that skips the WAN.
        into = {"a": self.wan_ports[NATS_GW_B_ROUTE], "b": self.wan_ports[NATS_GW_A_ROUTE]}
        for dc, role in (("a", NATS), ("b", NATS_B)):
            conf = self.log_dir / f"nats-{dc}.conf"
            write_private(conf, nats_gateway_conf(dc, nats_ports[dc], gateway_ports[dc], into, self._nats_certs)
                           + self._nats_client_conf())
            self._argv[role] = [str(find_nats_server()), "-c", str(conf)]
            self._spawn(role, self._argv[role])
        self.nats_url = f"nats://{LOOPBACK}:{nats_ports['a']}"
        self.nats_url_b = f"nats://{LOOPBACK}:{nats_ports['b']}"
        for dc, role in (("a", NATS), ("b", NATS_B)):
            await self._wait_port(role, LOOPBACK, nats_ports[dc], timeout_s=10.0)

    async def _start_wan(self, gateway_ports: Mapping[str, int]) -> None:
        c = self.config
        routes = [*(f"{md_kv_route(i)}={LOOPBACK}:0->{LOOPBACK}:{port}" for i, port in self.md_kv_ports.items()),
                  f"{NATS_GW_A_ROUTE}={LOOPBACK}:0->{LOOPBACK}:{gateway_ports['b']}",
                  f"{NATS_GW_B_ROUTE}@b={LOOPBACK}:0->{LOOPBACK}:{gateway_ports['a']}"]
        argv = [sys.executable, "-m", "wan", *(a for r in routes for a in ("--route", r)),
                "--bandwidth-mbps", str(c.wan_line_mbps), "--delay-ms", str(c.wan_delay_ms),
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
            await asyncio.sleep(POLL_S)
        self.wan_ports = {name: int(port) for name, port in re.findall(r"(\w+)(?:@b)?=[^\s=]+:(\d+)->", banner)}
        control = re.search(r"control=(http://\S+)", banner)
        if control is None or set(self.wan_ports) != {*self.md_kv_routes, NATS_GW_A_ROUTE, NATS_GW_B_ROUTE}:
            raise StackError(f"unexpected WAN emulator banner: {banner!r}")
        self.wan_control_url = control.group(1)

    def _check_cpu_affinity(self) -> None:
        """The machine's cores, not the launcher's own affinity: `taskset -c 1 pdd up --cpus prefill=0` may
        keep everything but P off core 0."""
        cores_here = set(range(os.cpu_count() or 1))
        for name, cores in self.config.cpu_affinity.items():
            if not set(cores) <= cores_here:
                raise StackError(f"--cpus {name}: cores {sorted(set(cores) - cores_here)} are not among this "
                                 f"machine's cores 0-{max(cores_here)}")

    def _nats_url_for(self, role: str) -> str:
        return self.nats_url_b if self.config.two_dc and self.config.datacenter_of(role) == "b" else self.nats_url

    def _service_argv(self, name: str) -> list[str]:
        c = self.config
        role = role_of(name)
        number = 1 if name == role else int(name.rpartition("-")[2])
        argv = [sys.executable, "-m", f"services.{role}", "--nats-url", self._nats_url_for(role),
                "--log-level", c.log_level, "--model", str(self.model_path)]
        if number > 1:  # the first keeps the service's own random id, as a one-instance stack always had
            argv += ["--instance-id", f"{name}-{secrets.token_hex(4)}"]
        if role in MODEL_ROLES:
            argv += ["--dtype", c.dtype, "--device", c.device, "--torch-threads", str(c.torch_threads)]
            if c.engine != "real":  # the real engine's argv stays as it was
                argv += ["--engine", c.engine, "--sim-device", c.sim_device_of(role), "--sim-profile", c.sim_profile]
        if role == "prefill":
            argv += ["--chunk-tokens", str(c.chunk_tokens)]
        if role == "main" and c.two_dc:  # P dials the emulator's route, which dials MD's own port
            argv += ["--kv-host", LOOPBACK, "--kv-port", str(self.md_kv_ports[number]),
                     "--advertise-host", LOOPBACK, "--advertise-port", str(self.wan_ports[md_kv_route(number)])]
        elif role in ("relay", "main"):
            argv += ["--kv-host", LOOPBACK, "--kv-port", "0"]
        if role in KV_ROLES and self.kv_secret_file is not None:
            argv += ["--kv-secret-file", str(self.kv_secret_file)]
        if role == "gateway":
            argv += ["--host", c.host, "--port", str(self.port), "--pipeline", c.pipeline]
            if c.api_key_file is not None:
                argv += ["--api-key-file", str(c.api_key_file)]
            if c.max_running_requests is not None:
                argv += ["--max-running-requests", str(c.max_running_requests)]
        if self.nats_auth is not None:
            argv += nats_auth_argv(self.nats_auth)
        return argv + list(c.extra_args.get(role, ()))

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.config.torch_threads > 0:
            env.setdefault("OMP_NUM_THREADS", str(self.config.torch_threads))
        return env

    def _spawn(self, role: str, argv: list[str], *, append: bool = False) -> ChildProcess:
        path = self.log_dir / self._log_name(role)
        with path.open("ab" if append else "wb") as log_file:
            if append:
                log_file.write(f"\n--- restarted by the launcher at {time.ctime()} ---\n".encode())
                log_file.flush()
            proc: ChildProcess | None = self._fork(role, argv, path)
            if proc is None:
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    env=self._child_env(), start_new_session=True,
                    preexec_fn=functools.partial(start_child, self._cores_of(role)),
                )
        self.processes[role] = proc
        self.log_paths[role] = path
        log.info("started %s (pid %d), log %s", role, proc.pid, path)
        return proc

    def _cores_of(self, process: str) -> tuple[int, ...] | None:
        """A process's --cpus cores: its own, else its role's (an extra instance shares its first's)."""
        affinity = self.config.cpu_affinity
        return affinity.get(process, affinity.get(role_of(process)))

    def _fork_server(self) -> ForkServer | None:
        """This process's fork server for the services' environment, when PDD_FORK_SERVER=1."""
        return fork_server_for(self._child_env()) if os.environ.get(FORK_SERVER_ENV) == "1" else None

    def _fork(self, role: str, argv: list[str], log_path: Path) -> ForkedChild | None:
        """`python -m <module> ...` forked from the fork server; None: spawn it (no fork server, another
        program, or a fork server that failed)."""
        forks = self._fork_server()
        if forks is None or argv[:2] != [sys.executable, "-m"]:
            return None
        try:
            return forks.spawn(argv[2], argv[3:], log_path, self._cores_of(role))
        except ForkServerError as exc:
            log.warning("%s; starting %s in a fresh interpreter instead", exc, role)
            return None

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
                await asyncio.sleep(POLL_S)

    async def wait_healthy(self, timeout_s: float = 60.0) -> dict[str, object]:
        """Poll /healthz until 200 (every role announced) and the gateway counts every instance the
        config starts; fail fast if a process exits."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            while True:
                self._check_alive()
                try:
                    async with session.get(f"{self.api_url}/healthz") as resp:
                        body = await resp.text()
                        if resp.status != 200:
                            last = f"HTTP {resp.status}: {body.strip()[:300]}"
                        elif missing := self._instances_missing(health := json.loads(body)):
                            last = f"HTTP 200, instances not yet announced: {missing}"
                        else:
                            return health
                except (aiohttp.ClientError, TimeoutError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    raise StackError(f"{self.api_url}/healthz not ready within {timeout_s:.0f} s; last: {last}")
                await asyncio.sleep(0.25)

    def _instances_missing(self, health: Mapping[str, object]) -> dict[str, int]:
        """Roles with fewer instances in the gateway's /healthz than the config starts: role -> short by."""
        seen = health.get("instances")
        counts = seen if isinstance(seen, dict) else {}
        short = {role: self.config.count_of(role) - int(counts.get(role, 0)) for role in MODEL_ROLES}
        return {role: n for role, n in short.items() if n > 0 and self.config.count_of(role) > 1}

    def _write_state(self) -> None:
        state: dict[str, object] = {
            "api_url": self.api_url, "nats_url": self.nats_url, "model": str(self.model_path),
            "topology": self.config.topology, "launcher_pid": os.getpid(),
            "pids": {r: p.pid for r, p in self.processes.items()}}
        if self.config.two_dc:
            state.update(nats_url_b=self.nats_url_b, wan_control_url=self.wan_control_url, wan_ports=self.wan_ports,
                         gateway_datacenter=self.config.gateway_datacenter)
        if self.nats_auth is not None:
            state["nats_auth"] = asdict(self.nats_auth)
        if self.kv_secret_file is not None:
            state["kv_secret_file"] = str(self.kv_secret_file)
        self.state_path.write_text(json.dumps(state, indent=2) + "\n")

    def kill(self, role: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one role's process group (fault tests); `restart` brings it back."""
        signal_group(self.processes[role], sig)

    async def restart(self, role: str, extra_args: Sequence[str] = ()) -> ChildProcess:
        """Kill `role` if it still runs, then start it again with the same flags (log appended).

        `extra_args` are appended to its flags from now on (the last of a repeated flag wins), so
        a test can change one role's setting without a new stack.
        """
        proc = self.processes[role]
        if proc.poll() is None:
            self.kill(role, signal.SIGKILL)
            if not await wait_exited([proc], self.config.stop_timeout_s):
                raise StackError(f"{role} (pid {proc.pid}) survived SIGKILL")
        self._argv[role] = [*self._argv[role], *extra_args]
        new = self._spawn(role, self._argv[role], append=True)
        self._write_state()
        return new

    async def watch(self, restart: bool, max_restarts: int = 3, poll_s: float = 0.5) -> str:
        """Reap children as they exit and say so in the log; with `restart`, start one again (its log
        appended), up to `max_restarts` times per role. Returns the role that ended the watch: one
        that exited without a restart (or past its restarts). `pdd up` runs this; tests that kill
        roles on purpose do not."""
        restarts: dict[str, int] = {}
        while True:
            for role, proc in list(self.processes.items()):
                if self._stopped or proc.poll() is None:
                    continue
                log.error("%s (pid %d) exited with code %s; tail of %s:\n%s", role, proc.pid, proc.returncode,
                          self.log_paths[role], log_tail(self.log_paths[role], 1500))
                if not restart or restarts.get(role, 0) >= max_restarts:
                    return role
                restarts[role] = restarts.get(role, 0) + 1
                log.warning("restarting %s (%d of %d)", role, restarts[role], max_restarts)
                await self.restart(role)
            await asyncio.sleep(poll_s)

    def kill_all(self, reap_timeout_s: float = 2.0) -> None:
        """SIGKILL every process group at once and reap them; for a forced exit (second Ctrl-C)."""
        for proc in self.processes.values():
            signal_group(proc, signal.SIGKILL)
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
                roles = [p for p in self.processes if role_of(p) in stage]
                killed += await self._stop_stage(roles)
            codes = ", ".join(f"{r} {p.returncode}" for r, p in self.processes.items())
            log.info("pdd stack stopped in %.1f s (exit codes: %s; killed: %s)",
                     time.monotonic() - began, codes, ", ".join(killed) or "none")
            self.state_path.unlink(missing_ok=True)

    async def _stop_stage(self, roles: list[str]) -> list[str]:
        procs = [self.processes[r] for r in roles]
        for proc in procs:
            signal_group(proc, signal.SIGTERM)
        await wait_exited(procs, self.config.stop_timeout_s)
        killed = [r for r, p in zip(roles, procs) if p.poll() is None]
        for proc in procs:  # the stragglers, and anything a service left behind in its group
            signal_group(proc, signal.SIGKILL, after_exit=True)
        await wait_exited(procs, self.config.stop_timeout_s)
        return killed
