"""Service configuration: frozen dataclasses built from flags and PDD_* environment variables.

A config field that is also a flag says so with `flag(default, help)`: its default is the flag's, and
`PDD_<FLAG_NAME>` overrides it, so a default is written once. Every service's __main__ calls
`<Role>Config.from_argv()`; the launcher passes the same flags by name (tools/launcher.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import typing
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.names import (
    AUTO,
    DType,
    FailurePolicy,
    HandoffMode,
    Pipeline,
    Role,
    choices,
)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
DEFAULT_MODEL = "smollm2"
ENV_PREFIX = "PDD_"
SIM_WAITS = ("sleep", "cpu")  # --sim-wait: how a simulated step takes its time (shared/sim_runner.py)
_FLAG = "pdd.flag"


@dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line."""

    name: str | None  # without the leading --; None: the field's name with '-' for '_'
    help: str | None
    choices: tuple[str, ...] | None
    scale: float  # the flag's value is the field's times this (e.g. ms on the command line, s in the config)


def flag(default: Any, help: str | None = None, *, name: str | None = None,
         choices: tuple[str, ...] | None = None, scale: float = 1) -> Any:
    """A config field that is also a flag (and a PDD_* variable) whose default is the field's."""
    return field(default=default, metadata={_FLAG: Flag(name, help, choices, scale)})


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata[_FLAG].name or f.name.replace("_", "-")


def env_name(f: dataclasses.Field) -> str:
    return ENV_PREFIX + flag_name(f).upper().replace("-", "_")


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a config class that are flags."""
    return [f for f in dataclasses.fields(cls) if _FLAG in f.metadata]


def flag_default(f: dataclasses.Field) -> Any:
    """The field's default as its flag gives it (scaled)."""
    spec: Flag = f.metadata[_FLAG]
    default: Any = f.default  # every flag field has one (flag() sets it)
    return default * spec.scale if spec.scale != 1 else default


def default_of(cls: type, name: str) -> Any:
    """The default of `cls`'s field `name`, for a tool that offers the same setting (tools/stack_config.py),
    so the default stays written once, here."""
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if f is None or f.default is dataclasses.MISSING:
        raise AttributeError(f"{cls.__name__} has no field {name!r} with a default")
    return f.default


def flag_help(cls: type, name: str) -> str | None:
    """The help of `cls`'s flag field `name`."""
    f = next(f for f in flag_fields(cls) if f.name == name)
    help_text: str | None = f.metadata[_FLAG].help
    return help_text


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
              exclude: tuple[str, ...] = (), help_prefix: str = "") -> None:
    """One option per flag field of `cls`; its default is the field's unless PDD_<NAME> is set."""
    types = typing.get_type_hints(cls)
    for f in flag_fields(cls):
        if f.name in exclude:
            continue
        spec: Flag = f.metadata[_FLAG]
        convert = types[f.name]
        raw = os.environ.get(env_name(f))  # converted here, so a bad value fails at start
        default = convert(flag_default(f)) if raw is None else convert(raw)
        help_text = f"{help_prefix}: {spec.help}" if help_prefix and spec.help else spec.help
        parser.add_argument(f"--{flag_name(f)}", type=convert, default=default, choices=spec.choices,
                            help=help_text)


def from_flags(cls: type, ns: argparse.Namespace, **given: Any) -> Any:
    """`cls` from the parsed flags its parser has (the rest keep their defaults), `given` taking precedence."""
    values = {}
    for f in flag_fields(cls):
        dest = flag_name(f).replace("-", "_")
        if hasattr(ns, dest):
            value = getattr(ns, dest)
            values[f.name] = value / f.metadata[_FLAG].scale if f.metadata[_FLAG].scale != 1 else value
    return cls(**{**values, **given})


def read_secret(path: str) -> bytes | None:
    """The KV secret's bytes, or None when no file is configured; an empty file is an error."""
    if not path:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise SystemExit(f"--kv-secret-file {path}: {exc.strerror}: P, RLD and MD each need the same secret "
                         "file (docs/deploy.md, \"Secrets\")") from exc
    if not secret:
        raise SystemExit(f"--kv-secret-file {path} is empty")
    return secret


def _kv_stall_timeout_s() -> Any:
    return flag(10.0, "a KV transfer fails when no frame moves for this long (cut or stuck link)")


def _kv_secret_file() -> Any:
    return flag("", "shared secret for the KV sockets' challenge-response handshake (P and decoders must hold "
                    "the same); empty: no authentication")


@dataclass(frozen=True)
class NatsAuth:
    """How a service proves itself to NATS (paths; shared/bus.py reads the files when it connects)."""

    user: str = flag("", name="nats-user")
    password_file: str = flag("", "file holding --nats-user's password (credentials in --nats-url work too)",
                              name="nats-password-file")
    tls_ca: str = flag("", "CA that signed the server's certificate; empty with a client certificate: the system's",
                       name="nats-tls-ca")
    tls_cert: str = flag("", "client certificate (PEM)", name="nats-tls-cert")
    tls_key: str = flag("", "its private key (PEM)", name="nats-tls-key")

    def __post_init__(self) -> None:
        if bool(self.user) != bool(self.password_file):
            raise ValueError("--nats-user and --nats-password-file go together")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together")

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)


@dataclass(frozen=True)
class CommonConfig:
    nats_url: str = flag(DEFAULT_NATS_URL)
    instance_id: str = flag("", "empty: <role>-<8 random hex digits>")
    log_level: str = flag("INFO")
    otlp_endpoint: str = flag("", "OTLP/HTTP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces; empty: off")
    heartbeat_s: float = flag(1.0)
    # P, RLD and MD serve Prometheus metrics on a port of their own (the gateway on its API port)
    metrics_host: str = flag("127.0.0.1", "address the metrics server binds")
    metrics_port: int = flag(0, "serve GET /metrics on this port; 0: off")
    gc_freeze: str = flag("on", "once started, freeze what start-up left on Python's heap (gc.freeze), so a full "
                                "garbage collection walks only what requests made (with SmolLM2 loaded here: 0.2-0.4 s "
                                "per full collection before, under 1 ms after)", choices=("on", "off"))
    nats_auth: NatsAuth = NatsAuth()


def _add_common(parser: argparse.ArgumentParser, metrics: bool) -> None:
    add_flags(parser, CommonConfig, exclude=() if metrics else ("metrics_host", "metrics_port"))
    nats = parser.add_argument_group("NATS security", "user and password, and TLS with a client certificate "
                                     "(mutual TLS); each empty: off")
    add_flags(nats, NatsAuth)


def _common(ns: argparse.Namespace, role: str) -> CommonConfig:
    return from_flags(CommonConfig, ns, instance_id=ns.instance_id or f"{role}-{uuid.uuid4().hex[:8]}",
                      nats_auth=from_flags(NatsAuth, ns))


@dataclass(frozen=True)
class ModelConfig:
    model: str = flag(DEFAULT_MODEL, f"'{DEFAULT_MODEL}' (default), 'tiny', or a local Hugging Face checkpoint path")
    dtype: str = flag(DType.FLOAT32.value, choices=choices(DType))
    device: str = flag("auto", "auto, cpu, cuda, cuda:N")
    torch_threads: int = flag(0, "intra-op threads for the engine thread; 0 leaves torch's default")
    decode_attention: str = flag("auto", "one-token attention on a CPU: 'kernel' (pdd's, built for this CPU at "
                                         "first start; fails if it cannot be), 'sdpa' (torch's), or 'auto' (the "
                                         "kernel for a half-precision model if it builds, else sdpa)",
                                 choices=("auto", "kernel", "sdpa"))
    engine: str = flag("real", "'real' (the model's forward) or 'sim' (no model: each step sleeps its modelled "
                               "time and makes deterministic tokens; docs/sim.md)", choices=("real", "sim"))
    sim_device: str = flag("h100", "--engine sim: the device whose roofline times each step (h100, h800, h20)")
    sim_profile: str = flag("", "--engine sim: a measured step-time profile (a path, or a name in "
                                "shared/sim_profiles/) instead of --sim-device's roofline")
    sim_wait: str = flag("sleep", "--engine sim: how a step takes its modelled time: 'sleep' (each tier on a "
                                  "device of its own) or 'cpu' (that much CPU time spent on the engine thread, "
                                  "so tiers that share cores slow each other as real engines do: for checking "
                                  "the sim against real engines on the same host)", choices=SIM_WAITS)


@dataclass(frozen=True)
class EngineConfig:
    """The batch engine (shared/batch_engine.py)."""

    max_batch_tokens: int = flag(512, "tokens in one batched forward (decode steps, extend and prefill chunks "
                                      "together)")  # longer work is split across steps
    kv_budget_tokens: int = flag(65536, "KV positions running requests may hold together; new requests wait "
                                        "when full (0: no limit)")
    kv_grow_tokens: int = flag(256, "a decoding request's KV grows this many positions at a time (or a quarter "
                                    "of what it holds, if more), up to its prompt plus max_tokens; when the "
                                    "budget cannot give them, the newest request is preempted and the gateway "
                                    "restarts it (0: reserve it all at admission)")
    fill_slice_bytes: int = flag(4 << 20, "KV arriving for an admitted request (MD's DRC prefix, what P sent) is "
                                          "copied into the engine between two steps in slices of this many bytes "
                                          "(0: all at once)")
    fill_step_share: float = flag(0.25, "between two steps, copy such slices for up to this share of a step's "
                                        "time (at least one slice), so a long prefix delays the others' next "
                                        "token by at most that share and is in after a few steps (0: one slice "
                                        "a gap)")
    gather_s: float = 0.005  # after a step, how long to wait for the requests it served to come back
    hold_steps: float = flag(0.5, "how long, in steps, the engine may hold its next step for work announced to "
                                  "arrive (MD: RLD's cut), so the handoff's last pass does not wait a whole step "
                                  "(0: never hold)")
    hold_grace_s: float = flag(0.0, "how late announced work may come and still end a hold, in seconds (0: a "
                                    "quarter of a step, at least 5 ms); never past --hold-steps")
    timeline_path: str = flag("", "append the engine's timeline (each step, KV copy and hold, in wall-clock ns) to "
                                  "this JSON-lines file, for latency debugging (docs/observability.md)",
                              name="engine-timeline")
    torch_threads: int = 0  # from ModelConfig's --torch-threads
    long_work_by_admission: bool = False  # P: prompts' chunks in the order the prompts came, not queue order
    attention_cost_tokens: int = 0  # P's --attention-cost-tokens; 0: the budget counts tokens only


def _engine(ns: argparse.Namespace, **given: Any) -> EngineConfig:
    return from_flags(EngineConfig, ns, torch_threads=ns.torch_threads, **given)


@dataclass(frozen=True)
class CacheConfig:
    """A prefix cache: P's, or MD's Decode-side RadixCache (DRC)."""

    tokens: int = flag(1_000_000, "capacity in tokens (0 disables the cache)", name="cache-tokens")
    kv_bytes: int = flag(1 << 30, "capacity in bytes of KV", name="cache-bytes")

    @property
    def enabled(self) -> bool:
        return self.tokens > 0 and self.kv_bytes > 0


@dataclass(frozen=True)
class HandoffConfig:
    """RLD's handoff policy (see services/relay/handoff.py)."""

    mode: str = flag(AUTO, f"{AUTO}: Catch-Up while RLD runs at most --catch-up-max-running requests, else One-Shot",
                     name="handoff-mode", choices=choices(HandoffMode, AUTO))
    catch_up_threshold: int = flag(4, "Catch-Up cuts at once (as One-Shot) when MD's KV is in before RLD made "
                                      "this many eager tokens")
    catch_up_max_running: int = flag(4)


@dataclass(frozen=True)
class PrefillConfig:
    common: CommonConfig
    model: ModelConfig
    cache: CacheConfig
    chunk_tokens: int = flag(256, "prompt tokens computed per forward pass; KV streams out per chunk")
    kv_queue_chunks: int = flag(0, "chunks queued per KV path before P's compute waits for that link; 0 (default): "
                                   "the whole prompt, which P holds anyway, so a slow WAN path never delays RLD's")
    kv_connect_timeout_s: float = flag(5.0)
    kv_connections: int = flag(1, "parallel TCP connections per decoder; frames of a chunk spread across them")
    kv_wire_dtype: str = flag("", "dtype of KV on the wire (default: the model's); the receiver converts",
                              choices=choices(DType, ""))
    kv_stall_timeout_s: float = _kv_stall_timeout_s()
    kv_secret_file: str = _kv_secret_file()
    attention_cost_tokens: int = flag(1024, "a step's --max-batch-tokens counts a prompt token over a cached "
                                            "context of n positions as 1 + n / this, for every prompt but the "
                                            "oldest one in the step (whose chunk goes whole), so a later "
                                            "prompt's long-context tokens cannot slow an earlier prompt's chunk "
                                            "(attention over about 1,000 positions costs as much as the rest of a "
                                            "token's forward on a CPU: raise it on a GPU; 0: count tokens only)")
    engine: EngineConfig = EngineConfig()

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=f"python -m services.{Role.PREFILL}", description="pdd Prefill (P)")
        _add_common(p, metrics=True)
        add_flags(p, ModelConfig)
        add_flags(p, CacheConfig, help_prefix="P's prefix cache")
        add_flags(p, cls)
        add_flags(p, EngineConfig, exclude=("kv_budget_tokens", "kv_grow_tokens"))
        return p

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> PrefillConfig:
        ns = cls.parser().parse_args(argv)
        model = from_flags(ModelConfig, ns)
        return from_flags(cls, ns, common=_common(ns, Role.PREFILL), model=model, cache=from_flags(CacheConfig, ns),
                          kv_wire_dtype=ns.kv_wire_dtype or model.dtype,
                          # no KV limit: P's prompts are sized up front; their chunks in the order they came
                          engine=_engine(ns, kv_budget_tokens=0, kv_grow_tokens=0, long_work_by_admission=True,
                                         attention_cost_tokens=ns.attention_cost_tokens))


@dataclass(frozen=True)
class KVLimits:
    """What a decoder's KV port tolerates from its peers (DecoderConfig's flags of the same names)."""

    idle_timeout_s: float = 60.0  # a connection that starts no frame while it carries no open transfer
    read_window_s: float = 10.0  # inside a frame, each window this long must bring read_min_bytes
    read_min_bytes: int = 16 * 1024
    max_connections: int = 256  # authenticated ones: a connection counts once its hello passes
    max_connections_per_peer: int = 64  # authenticated ones, per peer IP address


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """What Relay Decode and Main Decode both take: each receives KV on its own TCP port."""

    common: CommonConfig
    model: ModelConfig
    kv_host: str = flag("127.0.0.1", "address the KV socket binds")
    kv_port: int = flag(0, "0 picks a free port")
    advertise_host: str = flag("", "address P should dial; defaults to --kv-host (or the hostname for 0.0.0.0)")
    advertise_port: int = flag(0, "port P should dial, when a proxy (e.g. the WAN emulator) stands in front; "
                                  "0: --kv-port")
    kv_stall_timeout_s: float = _kv_stall_timeout_s()
    kv_secret_file: str = _kv_secret_file()
    kv_idle_timeout_s: float = flag(KVLimits.idle_timeout_s, "close a KV connection that starts no frame for this "
                                    "long while it carries no open transfer (P dials again); 0: never")
    kv_read_window_s: float = flag(KVLimits.read_window_s, "inside a KV frame, each window this long must bring "
                                   "--kv-read-min-bytes (or the frame's rest), else the connection closes; 0: off")
    kv_read_min_bytes: int = flag(KVLimits.read_min_bytes)
    kv_max_connections: int = flag(KVLimits.max_connections, "authenticated KV connections at once (one still "
                                   "in its handshake does not count); more are refused")
    kv_max_connections_per_peer: int = flag(KVLimits.max_connections_per_peer, "authenticated KV connections at once "
                                            "from one peer address")
    engine: EngineConfig = EngineConfig()

    @staticmethod
    def _parser(role: Role, title: str) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=f"python -m services.{role}", description=f"pdd {title}")
        _add_common(p, metrics=True)
        add_flags(p, ModelConfig)
        add_flags(p, DecoderConfig)
        add_flags(p, EngineConfig)
        return p

    @property
    def kv_limits(self) -> KVLimits:
        return KVLimits(self.kv_idle_timeout_s, self.kv_read_window_s, self.kv_read_min_bytes,
                        self.kv_max_connections, self.kv_max_connections_per_peer)

    @staticmethod
    def _parts(ns: argparse.Namespace, role: Role) -> dict[str, Any]:
        advertise = ns.advertise_host or (socket.gethostname() if ns.kv_host in ("0.0.0.0", "::") else ns.kv_host)
        return {"common": _common(ns, role), "model": from_flags(ModelConfig, ns), "advertise_host": advertise,
                "engine": _engine(ns)}


@dataclass(frozen=True, kw_only=True)
class RelayConfig(DecoderConfig):
    """Relay Decode (RLD): decides when to hand off; keeps what it computed in its own prefix cache."""

    handoff: HandoffConfig = HandoffConfig()
    cache: CacheConfig = CacheConfig()

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = cls._parser(Role.RELAY, "Relay Decode (RLD)")
        add_flags(p, HandoffConfig)
        add_flags(p, CacheConfig, help_prefix="RLD's prefix cache (P sends RLD only what it lacks)")
        return p

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> RelayConfig:
        ns = cls.parser().parse_args(argv)
        return from_flags(cls, ns, **cls._parts(ns, Role.RELAY), handoff=from_flags(HandoffConfig, ns),
                          cache=from_flags(CacheConfig, ns))


@dataclass(frozen=True, kw_only=True)
class MainConfig(DecoderConfig):
    """Main Decode (MD): keeps finished requests' KV in its Decode-side RadixCache (DRC)."""

    cache: CacheConfig = CacheConfig()

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = cls._parser(Role.MAIN, "Main Decode (MD)")
        add_flags(p, CacheConfig, help_prefix="MD's Decode-side RadixCache (DRC)")
        return p

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> MainConfig:
        ns = cls.parser().parse_args(argv)
        return from_flags(cls, ns, **cls._parts(ns, Role.MAIN), cache=from_flags(CacheConfig, ns))


@dataclass(frozen=True)
class GatewayConfig:
    common: CommonConfig
    model: str = flag(DEFAULT_MODEL, "model whose tokenizer and chat template the gateway uses; same as the workers'")
    host: str = flag("127.0.0.1")
    port: int = flag(8000)
    default_pipeline: str = flag(AUTO, f"pipeline for requests that do not name one; {AUTO}: PDD's policy per request",
                                 name="pipeline", choices=choices(Pipeline.requestable(), AUTO))
    request_timeout_s: float = flag(300.0)
    token_timeout_s: float = flag(60.0, "longest wait for the next token before the request fails")
    instance_wait_s: float = flag(10.0, "a request that finds no live instance of a role it needs (one restarting, "
                                        "a NATS reconnect) waits this long for one before 503 (0: refuse at once)")
    max_body_bytes: int = flag(4 * 1024 * 1024)
    header_timeout_s: float = flag(10.0, "a connection must send a whole request head within this many seconds of "
                                         "opening or of its last response, else it is closed (also the idle "
                                         "keep-alive limit)")
    body_timeout_s: float = flag(10.0, "a request body must arrive whole within this many seconds of its head, else "
                                       "408 and the connection is closed")
    max_prompt_bytes_per_token: int = flag(256, "a prompt of more UTF-8 bytes than the context's tokens times this "
                                                "cannot fit: refused with 400 before tokenising")
    tokenizer_threads: int = flag(2, "threads that render the chat template and tokenise, off the event loop")
    default_max_tokens: int = flag(0, "max_tokens of a request that gives none, capped by the context; 0: the "
                                      "rest of the context, as vLLM (decoders grow a request's KV as it decodes, "
                                      "--kv-grow-tokens)")
    ttft_slo_s: float = flag(2.0, name="ttft-slo-ms", scale=1000)
    relay_min_gain_fraction: float = flag(0.05, "auto picks P-RLD-MD only when RLD's first token is predicted "
                                                "earlier than MD's by more than this fraction of the TTFT SLO (a "
                                                "handoff costs a recompute and a stall)")
    wan_mbps_guess: float = flag(100.0, "link rate assumed until P has measured one")
    backfill_link_share: float = flag(0.0, "when RLD finishes a request before MD has its KV, P still sends MD that "
                                           "KV for its DRC (so the session's next turn hits MD), as background "
                                           "traffic: only while no other transfer to MD is open, at most this "
                                           "share of MD's link rate, e.g. 0.5 (0: P drops it, the paper's filter)")
    prefill_tokens_per_s_guess: float = flag(1000.0)
    decode_step_s_guess: float = flag(0.05, "one decode step on RLD or MD until the gaps between their tokens "
                                            "were measured")
    warm_prefill_tokens: int = flag(32, "every this many tokens of a running answer, P computes the answer so far "
                                        "into its prefix cache, so the session's next turn hits it there too "
                                        "(0: off)")
    route_load_penalty_tokens: int = flag(256, "cache-aware routing (P, RLD, MD): one running request costs "
                                               "as much as this many hit tokens")
    max_running_requests: int = flag(64, "requests in flight before new ones queue (0: no limit)")
    max_queued_requests: int = flag(256, "requests that wait, first come first served and each until its deadline, "
                                         "for one in flight to end; past them, 429 with Retry-After (0: refuse at "
                                         "once)")
    api_key_file: str = flag("", "file holding the API key clients must send as a Bearer token; empty: open")
    failure_policy: str = flag(FailurePolicy.RECOVER.value,
                               "when a tier is lost mid-request: recover (RLD finishes, MD takes over, or the request "
                               "moves to another instance) or fail with an error; a request may name its own",
                               choices=choices(FailurePolicy))
    max_migrations: int = flag(2, "times one request may be moved to other instances after losing one (recover "
                                  "policy)")
    trace_store_traces: int = flag(500, "the gateway's OTLP receiver (POST /v1/traces) keeps this many recent "
                                        "traces")
    otlp_forward_endpoint: str = flag("", "also forward every OTLP/HTTP batch the gateway receives to this endpoint")

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="python -m services.gateway", description="pdd gateway (OpenAI API)")
        _add_common(p, metrics=False)
        add_flags(p, cls)
        return p

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> GatewayConfig:
        ns = cls.parser().parse_args(argv)
        return from_flags(cls, ns, common=_common(ns, "gateway"))
