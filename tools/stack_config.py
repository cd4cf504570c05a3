"""What a local pdd stack is: its processes' names and placement, `StackConfig` (the flags of `pdd up`,
`pdd demo` and `pdd bench`), and free loopback ports for them. Nothing here starts a process."""
from __future__ import annotations

import argparse
import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from shared.config import CommonConfig, GatewayConfig, ModelConfig, PrefillConfig, default_of, flag_help
from shared.names import AUTO, DType, Pipeline, Role, choices
from shared.step_timing import DEVICES

NATS = "nats"  # the only nats-server in one-dc; datacenter A's in two-dc
NATS_B = "nats-b"  # two-dc: datacenter B's nats-server
WAN = "wan"  # two-dc: the WAN emulator between the datacenters
SERVICES = (Role.PREFILL, Role.RELAY, Role.MAIN, "gateway")
MODEL_ROLES = tuple(Role)
PROCESSES = (*SERVICES, NATS, NATS_B, WAN)  # what a stack may start: the names --cpus takes
STOP_STAGES: tuple[tuple[str, ...], ...] = (
    ("gateway",), (Role.RELAY, Role.MAIN), (Role.PREFILL,), (NATS, NATS_B), (WAN,))
TOPOLOGIES = ("one-dc", "two-dc")
DATACENTER = {"gateway": "a", "prefill": "a", "relay": "a", "main": "b"}  # two-dc placement (the gateway: default)
DATACENTERS = ("a", "b")
# The emulator's routes in two-dc: P -> MD's KV port, and the NATS gateway link in both directions
# (a NATS gateway connection carries messages one way only: each server dials the other).
MD_KV_ROUTE = "md_kv"  # the first MD's; MD number i > 1 has md_kv_route(i)
NATS_GW_A_ROUTE = "nats_gw_a"  # dialled by nats-a: A -> B messages
NATS_GW_B_ROUTE = "nats_gw_b"  # dialled by nats-b: B -> A messages
LOOPBACK = "127.0.0.1"
NATS_USER = "pdd"  # --nats-auth: the one NATS user every service of the local stack connects as
NATS_AUTH_DIR = "nats-auth"  # --nats-auth: under log_dir, the password file and certificates (mode 0700)
KV_SECRET_FILE = "kv-secret"  # under log_dir: the KV sockets' shared secret, made fresh unless given (mode 0600)
KV_ROLES = (Role.PREFILL, Role.RELAY, Role.MAIN)  # the roles that speak on the KV sockets


class StackError(RuntimeError):
    """The stack could not start (a process exited, a port was taken, or a deadline passed)."""


PICKED_PORTS_FROM = 20000  # free_port picks from here up to the ephemeral range


def default_torch_threads() -> int:
    """Three model processes share the machine: give each a third of the cores, at least one."""
    return max(1, (os.cpu_count() or 1) // len(MODEL_ROLES))


@dataclass(frozen=True)
class StackConfig:
    # what the stack passes on to its services defaults to the services' own defaults (shared/config.py)
    model: str = default_of(ModelConfig, "model")
    dtype: str = default_of(ModelConfig, "dtype")
    device: str = default_of(ModelConfig, "device")
    engine: str = default_of(ModelConfig, "engine")  # "sim": P, RLD and MD model their steps (docs/sim.md)
    sim_device: str = default_of(ModelConfig, "sim_device")
    sim_profile: str = default_of(ModelConfig, "sim_profile")
    sim_shape: str = ""  # engine sim: serve this shape (shared/sim_shapes/ or a config.json), the model's tokenizer
    kv_byte_scale: int = 1  # engine sim: KV carries 1/N of the modelled bytes, the WAN's line rate is 1/N (docs/sim.md)
    nats_url: str | None = None  # None: start our own nats-server on a free loopback port
    host: str = default_of(GatewayConfig, "host")
    port: int = default_of(GatewayConfig, "port")  # 0: pick a free port
    pipeline: str = default_of(GatewayConfig, "default_pipeline")  # auto: the gateway's policy chooses per request
    log_dir: Path = Path("logs")
    log_level: str = default_of(CommonConfig, "log_level")
    torch_threads: int = field(default_factory=default_torch_threads)
    chunk_tokens: int = default_of(PrefillConfig, "chunk_tokens")
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
    kv_secret_file: Path | None = None  # the KV sockets' secret; None: a fresh one in log_dir/KV_SECRET_FILE
    api_key_file: Path | None = None  # the gateway's API key (clients send it as a Bearer token); None: open
    max_running_requests: int | None = None  # the gateway's limit before requests queue; None: its default
    gateway_datacenter: str = DATACENTER["gateway"]  # two-dc: "a" (beside P and RLD) or "b" (beside MD)
    cpu_affinity: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # process name -> the cores it may run on
    instances: Mapping[str, int] = field(default_factory=dict)  # model role -> how many (default 1 each)
    sim_devices: Mapping[str, str] = field(default_factory=dict)  # engine sim: model role -> its --sim-device

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if self.gateway_datacenter not in DATACENTERS:
            raise ValueError(f"gateway_datacenter must be one of {DATACENTERS}, got {self.gateway_datacenter!r}")
        unknown = set(self.cpu_affinity) - set(PROCESSES)
        if unknown:
            raise ValueError(f"cpu_affinity names no process of the stack: {sorted(unknown)}")
        if any(not cores for cores in self.cpu_affinity.values()):
            raise ValueError("cpu_affinity gives a process no core")
        if set(self.instances) - set(KV_ROLES) or any(n < 1 for n in self.instances.values()):
            raise ValueError(f"instances takes {', '.join(KV_ROLES)}, each at least 1: got {dict(self.instances)}")
        if set(self.sim_devices) - set(KV_ROLES):
            raise ValueError(f"sim_devices takes {', '.join(KV_ROLES)}: got {dict(self.sim_devices)}")
        if self.sim_devices and self.engine != "sim":
            raise ValueError("sim_devices sets the simulated engine's device per role: give engine 'sim'")
        if (self.sim_shape or self.kv_byte_scale != 1) and self.engine != "sim":
            raise ValueError("sim_shape and kv_byte_scale model a checkpoint the real engine does not have: "
                             "give engine 'sim'")
        if self.kv_byte_scale < 1:
            raise ValueError(f"kv_byte_scale must be a whole number >= 1, got {self.kv_byte_scale}")
        if self.kv_byte_scale != 1 and self.wan_trace is not None:
            raise ValueError("kv_byte_scale divides the WAN's line rate, and a bandwidth trace's rates are not "
                             "scaled: give wan_bandwidth_mbps instead")
        if self.nats_auth and self.nats_url:
            raise ValueError("nats_auth secures the nats-server the launcher starts; for your own server at "
                             "nats_url, give the services PDD_NATS_USER, PDD_NATS_PASSWORD_FILE, PDD_NATS_TLS_*")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """The flags of every command that starts a stack (`pdd up`, `pdd demo`, ...)."""
        d = StackConfig()
        parser.add_argument("--model", default=d.model, help=flag_help(ModelConfig, "model"))
        parser.add_argument("--dtype", default=d.dtype, choices=choices(DType))
        parser.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:N")
        add_engine_arguments(parser, d)
        parser.add_argument("--host", default=d.host, help="address the gateway binds")
        parser.add_argument("--port", type=int, default=d.port, help="gateway port; 0 picks a free one")
        parser.add_argument("--pipeline", default=d.pipeline, choices=choices(Pipeline.requestable(), AUTO),
                            help="pipeline for requests that do not name one; auto: the gateway's policy")
        parser.add_argument("--nats-url", default=None, help="use this NATS server instead of starting one")
        parser.add_argument("--nats-auth", action="store_true",
                            help="start nats-server with a user, a password and mutual TLS (throwaway certificates "
                                 f"in <log-dir>/{NATS_AUTH_DIR}) and connect every service with them")
        parser.add_argument("--kv-secret-file", type=Path, default=None,
                            help="shared secret file for the KV sockets of P, RLD and MD (default: a fresh random "
                                 f"one in <log-dir>/{KV_SECRET_FILE})")
        parser.add_argument("--api-key-file", type=Path, default=None,
                            help="file holding the API key clients must send as a Bearer token (default: open)")
        parser.add_argument("--max-running-requests", type=int, default=None,
                            help="requests the gateway runs at once before new ones queue (default: the gateway's, "
                                 f"{default_of(GatewayConfig, 'max_running_requests')}; 0: no limit)")
        parser.add_argument("--cpus", dest="cpu_affinity", type=parse_cpu_affinity, action="append", default=[],
                            metavar="NAME[,NAME]=CORES",
                            help="pin processes to cores, e.g. prefill=0 or relay,main=1-3 (names: "
                                 f"{', '.join(PROCESSES)}); repeatable; default: unpinned (an extra instance "
                                 "takes its role's cores)")
        parser.add_argument("--instances", type=parse_instances, default={}, metavar="ROLE=N[,ROLE=N]",
                            help="instances of a model role, e.g. prefill=2,main=4 (roles: "
                                 f"{', '.join(KV_ROLES)}; default 1 each); in two-dc each MD has its own WAN route")
        parser.add_argument("--log-dir", type=Path, default=d.log_dir, help="one log file per process")
        parser.add_argument("--log-level", default=d.log_level, help="log level of the services")
        parser.add_argument("--torch-threads", type=int, default=d.torch_threads,
                            help=f"intra-op threads per model process (default here: {d.torch_threads})")
        parser.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens,
                            help=flag_help(PrefillConfig, "chunk_tokens"))
        parser.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
        wan = parser.add_argument_group("two datacenters", "--topology two-dc puts MD and a second nats-server "
                                        "in datacenter B, behind the WAN emulator (docs/wan.md)")
        wan.add_argument("--topology", default=d.topology, choices=TOPOLOGIES)
        wan.add_argument("--gateway-dc", dest="gateway_datacenter", default=d.gateway_datacenter, choices=DATACENTERS,
                         help="the gateway's datacenter: a, beside P and RLD (default), or b, beside MD (the "
                              "handoff then loses the round trip, RLD's tokens cross the WAN instead)")
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
            model=ns.model, dtype=ns.dtype, device=ns.device, engine=ns.engine, sim_device=ns.sim_device,
            sim_profile=ns.sim_profile, sim_shape=ns.sim_shape, kv_byte_scale=ns.kv_byte_scale,
            nats_url=ns.nats_url, host=ns.host,
            port=ns.port, pipeline=ns.pipeline, log_dir=ns.log_dir, log_level=ns.log_level,
            torch_threads=ns.torch_threads, chunk_tokens=ns.chunk_tokens,
            startup_timeout_s=ns.startup_timeout_s, topology=ns.topology,
            wan_bandwidth_mbps=ns.wan_bandwidth_mbps, wan_delay_ms=ns.wan_delay_ms,
            wan_jitter_ms=ns.wan_jitter_ms, wan_trace=ns.wan_trace, wan_control_port=ns.wan_control_port,
            nats_auth=ns.nats_auth, kv_secret_file=ns.kv_secret_file, api_key_file=ns.api_key_file,
            max_running_requests=ns.max_running_requests, gateway_datacenter=ns.gateway_datacenter,
            cpu_affinity=merge_cpu_affinity(ns.cpu_affinity), instances=ns.instances, sim_devices=ns.sim_devices,
        )

    @property
    def two_dc(self) -> bool:
        return self.topology == "two-dc"

    @property
    def wan_line_mbps(self) -> float:
        """The emulator's line rate: the modelled one divided by kv_byte_scale, as the KV bytes are."""
        return self.wan_bandwidth_mbps / self.kv_byte_scale

    def datacenter_of(self, process: str) -> str:
        """Where a service runs in two-dc: its fixed place, or the gateway's configured one."""
        return self.gateway_datacenter if process == "gateway" else DATACENTER[role_of(process)]

    def count_of(self, role: str) -> int:
        return self.instances.get(role, 1)

    def service_processes(self) -> list[str]:
        """Every service's process name, in start order: a role's first instance is named for the role
        (what kill, restart and the logs have always called it), the others `<role>-<i>` from 2."""
        return [instance_name(role, i) for role in SERVICES for i in range(1, self.count_of(role) + 1)]

    def sim_device_of(self, role: str) -> str:
        return self.sim_devices.get(role, self.sim_device)


def instance_name(role: str, number: int) -> str:
    """The process name of a role's `number`th instance (1 is the role's own name)."""
    return role if number == 1 else f"{role}-{number}"


def role_of(process: str) -> str:
    """The role an instance's process name belongs to: `main-3` -> `main`, `main` -> `main`."""
    role, _, number = process.rpartition("-")
    return role if role in SERVICES and number.isdigit() else process


def md_kv_route(number: int) -> str:
    """The emulator's route to MD number `number`'s KV port in two-dc (1: MD_KV_ROUTE)."""
    return MD_KV_ROUTE if number == 1 else f"{MD_KV_ROUTE}_{number}"


def parse_role_values(text: str, roles: Sequence[str] = KV_ROLES) -> dict[str, str]:
    """`prefill=2,main=4` -> {"prefill": "2", "main": "4"}: the value of one per-role flag."""
    values: dict[str, str] = {}
    for part in text.split(","):
        role, sep, value = (s.strip() for s in part.partition("="))
        if not sep or role not in roles or not value:
            raise argparse.ArgumentTypeError(f"expected ROLE=VALUE[,ROLE=VALUE] with ROLE one of "
                                             f"{', '.join(roles)}, got {text!r}")
        values[role] = value
    return values


def parse_instances(text: str) -> dict[str, int]:
    """`prefill=2,main=4` -> {"prefill": 2, "main": 4}: the value of --instances."""
    values = parse_role_values(text)
    if not all(v.isdigit() and int(v) >= 1 for v in values.values()):
        raise argparse.ArgumentTypeError(f"instances must be whole numbers >= 1, got {text!r}")
    return {role: int(v) for role, v in values.items()}


def parse_sim_devices(text: str) -> dict[str, str]:
    """`prefill=h800,main=h20` -> {role: device}: the value of --sim-devices."""
    values = parse_role_values(text)
    unknown = set(values.values()) - set(DEVICES)
    if unknown:
        raise argparse.ArgumentTypeError(f"no simulated device {', '.join(sorted(unknown))}; "
                                         f"one of {', '.join(DEVICES)}")
    return values


def parse_cpu_affinity(text: str) -> dict[str, tuple[int, ...]]:
    """`prefill=0`, `relay,main=1-3`, `gateway=0,2` -> {name: cores}: the value of one --cpus flag."""
    names, sep, cores_text = text.partition("=")
    if not sep or not names.strip() or not cores_text.strip():
        raise argparse.ArgumentTypeError(f"expected NAME[,NAME]=CORES (e.g. prefill=0), got {text!r}")
    cores: list[int] = []
    try:
        for part in cores_text.split(","):
            low, dash, high = part.partition("-")
            first, last = int(low), int(high) if dash else int(low)
            if first < 0 or last < first:
                raise ValueError(part)
            cores.extend(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"cores must be like 0, 1-3 or 0,2: got {cores_text!r}") from None
    affinity = {name.strip(): tuple(sorted(set(cores))) for name in names.split(",")}
    unknown = set(affinity) - set(PROCESSES)
    if unknown:
        raise argparse.ArgumentTypeError(f"no process of the stack is named {', '.join(sorted(unknown))}")
    return affinity


def merge_cpu_affinity(flags: Sequence[Mapping[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    """Several --cpus flags into one mapping; a name given twice keeps its last cores."""
    merged: dict[str, tuple[int, ...]] = {}
    for flag in flags:
        merged.update(flag)
    return merged


_handed_out: set[int] = set()  # the ports free_port has returned in this process


def free_port(host: str = LOOPBACK) -> int:
    """A port free now, for a process started later to bind. It is picked below the kernel's
    ephemeral range, so no bind to port 0 and no outgoing connection can take it in between
    (the WAN emulator binds its routes to port 0 while the nats-servers' ports wait), and never
    one it returned before: a stack picks all its ports before anything binds them, and two equal
    picks (nats-b's client port and MD's KV port, once) leave the second process unable to bind."""
    low, _ = _ephemeral_port_range()
    candidates = range(PICKED_PORTS_FROM, low) if low - PICKED_PORTS_FROM >= 1000 else range(0)
    for port in secrets.SystemRandom().sample(candidates, min(64, len(candidates))):
        if port not in _handed_out and port_is_free(host, port):
            _handed_out.add(port)
            return port
    for _ in range(64):  # no room below the range: any port the kernel gives, but not one handed out
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(f"no free port on {host} that was not handed out already")


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


class EngineDefaults(Protocol):
    """What add_engine_arguments takes its defaults from: a StackConfig or pdd bench's StackOptions."""

    @property
    def engine(self) -> str: ...
    @property
    def sim_device(self) -> str: ...
    @property
    def sim_profile(self) -> str: ...
    @property
    def sim_shape(self) -> str: ...
    @property
    def kv_byte_scale(self) -> int: ...


def add_engine_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, d: EngineDefaults) -> None:
    """--engine and the simulated engine's flags (docs/sim.md), for every command that starts stacks."""
    parser.add_argument("--engine", default=d.engine, choices=("real", "sim"), help=flag_help(ModelConfig, "engine"))
    parser.add_argument("--sim-device", default=d.sim_device, help=flag_help(ModelConfig, "sim_device"))
    parser.add_argument("--sim-devices", type=parse_sim_devices, default={}, metavar="ROLE=DEVICE[,ROLE=DEVICE]",
                        help="--engine sim: a role's own --sim-device, e.g. prefill=h800 (the paper: prefill on "
                             "compute-dense GPUs, decoding on memory-dense ones); the others keep --sim-device")
    parser.add_argument("--sim-profile", default=d.sim_profile, help=flag_help(ModelConfig, "sim_profile"))
    parser.add_argument("--sim-shape", default=d.sim_shape,
                        help="--engine sim: serve this model shape (a name in shared/sim_shapes/, e.g. llama-70b, "
                             "or a config.json) with --model's tokenizer; its KV crosses the sockets and the WAN "
                             "(docs/sim.md)")
    parser.add_argument("--kv-byte-scale", type=int, default=d.kv_byte_scale,
                        help="--engine sim: KV carries 1/N of the modelled bytes per token and the WAN's line rate "
                             "is --wan-bandwidth-mbps/N, so transfers take the modelled time; tables report the "
                             "bytes carried (default 1)")
