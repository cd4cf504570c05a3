"""Service configuration: frozen dataclasses built from flags and PDD_* environment variables.

This module is the one place where flags are declared; every service's __main__ calls
`<Role>Config.from_argv()`. The launcher builds the same flags (see tools/launcher.py), so a
flag named there and not here fails at start.
"""
from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


def _env(name: str, default: str) -> str:
    return os.environ.get(f"PDD_{name}", default)


def _add_common(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--nats-url", default=_env("NATS_URL", DEFAULT_NATS_URL))
    parser.add_argument("--instance-id", default=_env("INSTANCE_ID", f"{role}-{uuid.uuid4().hex[:8]}"))
    parser.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    parser.add_argument("--otlp-endpoint", default=_env("OTLP_ENDPOINT", ""),
                        help="OTLP/HTTP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces; empty: off")
    parser.add_argument("--heartbeat-s", type=float, default=float(_env("HEARTBEAT_S", "1.0")))
    nats = parser.add_argument_group("NATS security", "user and password, and TLS with a client certificate "
                                     "(mutual TLS); each empty: off")
    nats.add_argument("--nats-user", default=_env("NATS_USER", ""))
    nats.add_argument("--nats-password-file", default=_env("NATS_PASSWORD_FILE", ""),
                      help="file holding --nats-user's password (credentials in --nats-url work too)")
    nats.add_argument("--nats-tls-ca", default=_env("NATS_TLS_CA", ""),
                      help="CA that signed the server's certificate; empty with a client certificate: the system's")
    nats.add_argument("--nats-tls-cert", default=_env("NATS_TLS_CERT", ""), help="client certificate (PEM)")
    nats.add_argument("--nats-tls-key", default=_env("NATS_TLS_KEY", ""), help="its private key (PEM)")


def _add_metrics(parser: argparse.ArgumentParser) -> None:
    """P, RLD and MD serve Prometheus metrics on a port of their own (the gateway on its API port)."""
    parser.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", "0")),
                        help="serve GET /metrics on this port; 0: off")
    parser.add_argument("--metrics-host", default=_env("METRICS_HOST", "127.0.0.1"),
                        help="address the metrics server binds")


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=_env("MODEL", "smollm2"),
                        help="'smollm2' (default), 'tiny', or a local Hugging Face checkpoint path")
    parser.add_argument("--dtype", default=_env("DTYPE", "float32"), choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default=_env("DEVICE", "auto"), help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--torch-threads", type=int, default=int(_env("TORCH_THREADS", "0")),
                        help="intra-op threads for the engine thread; 0 leaves torch's default")


def _add_kv_stall(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-stall-timeout-s", type=float, default=float(_env("KV_STALL_TIMEOUT_S", "10")),
                        help="a KV transfer fails when no frame moves for this long (cut or stuck link)")
    parser.add_argument("--kv-secret-file", default=_env("KV_SECRET_FILE", ""),
                        help="shared secret for the KV sockets' challenge-response handshake (P and decoders "
                             "must hold the same); empty: no authentication")


def read_secret(path: str) -> bytes | None:
    """The KV secret's bytes, or None when no file is configured; an empty file is an error."""
    if not path:
        return None
    secret = Path(path).read_bytes().strip()
    if not secret:
        raise SystemExit(f"--kv-secret-file {path} is empty")
    return secret


def _add_cache(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--cache-tokens", type=int, default=int(_env("CACHE_TOKENS", "1000000")),
                        help=f"{what}: capacity in tokens (0 disables the cache)")
    parser.add_argument("--cache-bytes", type=int, default=int(_env("CACHE_BYTES", str(1 << 30))),
                        help=f"{what}: capacity in bytes of KV")


def _add_engine(parser: argparse.ArgumentParser, kv_budget: bool) -> None:
    parser.add_argument("--max-batch-tokens", type=int, default=int(_env("MAX_BATCH_TOKENS", "512")),
                        help="tokens in one batched forward (decode steps, extend and prefill chunks together)")
    if kv_budget:
        parser.add_argument("--kv-budget-tokens", type=int, default=int(_env("KV_BUDGET_TOKENS", "65536")),
                            help="KV positions running requests may reserve together; new requests wait when "
                                 "full (0: no limit)")


@dataclass(frozen=True)
class EngineConfig:
    """The batch engine (shared/batch_engine.py)."""

    max_batch_tokens: int = 512  # tokens in one forward; longer work is split across steps
    kv_budget_tokens: int = 0  # KV positions all admitted requests may reserve together; 0: no limit
    gather_s: float = 0.005  # after a step, how long to wait for the requests it served to come back
    torch_threads: int = 0


def _engine(ns: argparse.Namespace) -> EngineConfig:
    return EngineConfig(ns.max_batch_tokens, getattr(ns, "kv_budget_tokens", 0), torch_threads=ns.torch_threads)


@dataclass(frozen=True)
class CacheConfig:
    tokens: int
    kv_bytes: int

    @property
    def enabled(self) -> bool:
        return self.tokens > 0 and self.kv_bytes > 0


@dataclass(frozen=True)
class HandoffConfig:
    """RLD's handoff policy (see services/relay/handoff.py)."""

    mode: str  # auto | one-shot | catch-up
    catch_up_threshold: int
    catch_up_max_running: int


@dataclass(frozen=True)
class NatsAuth:
    """How a service proves itself to NATS (paths; shared/bus.py reads the files when it connects)."""

    user: str = ""
    password_file: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

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
    nats_url: str
    instance_id: str
    log_level: str
    otlp_endpoint: str
    heartbeat_s: float
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: no metrics server (the gateway serves /metrics on its API port)
    nats_auth: NatsAuth = NatsAuth()


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: str
    device: str
    torch_threads: int


def _common(ns: argparse.Namespace) -> CommonConfig:
    nats_auth = NatsAuth(ns.nats_user, ns.nats_password_file, ns.nats_tls_ca, ns.nats_tls_cert, ns.nats_tls_key)
    return CommonConfig(ns.nats_url, ns.instance_id, ns.log_level, ns.otlp_endpoint, ns.heartbeat_s,
                        getattr(ns, "metrics_host", "127.0.0.1"), getattr(ns, "metrics_port", 0), nats_auth)


def _model(ns: argparse.Namespace) -> ModelConfig:
    return ModelConfig(ns.model, ns.dtype, ns.device, ns.torch_threads)


@dataclass(frozen=True)
class PrefillConfig:
    common: CommonConfig
    model: ModelConfig
    cache: CacheConfig
    chunk_tokens: int
    kv_queue_chunks: int
    kv_connect_timeout_s: float
    kv_connections: int
    kv_wire_dtype: str
    kv_stall_timeout_s: float
    kv_secret_file: str = ""
    engine: EngineConfig = EngineConfig()

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="python -m services.prefill", description="pdd Prefill (P)")
        _add_common(p, "prefill")
        _add_metrics(p)
        _add_model(p)
        _add_cache(p, "P's prefix cache")
        _add_kv_stall(p)
        p.add_argument("--chunk-tokens", type=int, default=int(_env("CHUNK_TOKENS", "256")),
                       help="prompt tokens computed per forward pass; KV streams out per chunk")
        p.add_argument("--kv-queue-chunks", type=int, default=int(_env("KV_QUEUE_CHUNKS", "0")),
                       help="chunks queued per KV path before P's compute waits for that link; 0 (default): "
                            "the whole prompt, which P holds anyway, so a slow WAN path never delays RLD's")
        p.add_argument("--kv-connect-timeout-s", type=float, default=float(_env("KV_CONNECT_TIMEOUT_S", "5")))
        p.add_argument("--kv-connections", type=int, default=int(_env("KV_CONNECTIONS", "1")),
                       help="parallel TCP connections per decoder; frames of a chunk spread across them")
        p.add_argument("--kv-wire-dtype", default=_env("KV_WIRE_DTYPE", ""), choices=("", "float32", "bfloat16", "float16"),
                       help="dtype of KV on the wire (default: the model's); the receiver converts")
        _add_engine(p, kv_budget=False)
        return p

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> PrefillConfig:
        ns = cls.parser().parse_args(argv)
        return cls(_common(ns), _model(ns), CacheConfig(ns.cache_tokens, ns.cache_bytes), ns.chunk_tokens, ns.kv_queue_chunks, ns.kv_connect_timeout_s,
                   ns.kv_connections, ns.kv_wire_dtype or ns.dtype, ns.kv_stall_timeout_s, ns.kv_secret_file,
                   _engine(ns))


@dataclass(frozen=True)
class DecoderConfig:
    """Shared by Relay Decode and Main Decode: both receive KV on their own TCP port."""

    common: CommonConfig
    model: ModelConfig
    role: str
    cache: CacheConfig  # MD's Decode-side RadixCache; RLD keeps no long-lived cache
    kv_host: str
    kv_port: int
    advertise_host: str
    advertise_port: int  # 0: the port the KV socket bound
    kv_stall_timeout_s: float
    handoff: HandoffConfig  # RLD only
    kv_secret_file: str = ""
    engine: EngineConfig = EngineConfig()

    @classmethod
    def parser(cls, role: str) -> argparse.ArgumentParser:
        title = {"relay": "Relay Decode (RLD)", "main": "Main Decode (MD)"}[role]
        p = argparse.ArgumentParser(prog=f"python -m services.{role}", description=f"pdd {title}")
        _add_common(p, role)
        _add_metrics(p)
        _add_model(p)
        if role == "main":
            _add_cache(p, "MD's Decode-side RadixCache (DRC)")
        if role == "relay":
            p.add_argument("--handoff-mode", default=_env("HANDOFF_MODE", "auto"),
                           choices=("auto", "one-shot", "catch-up"),
                           help="auto: Catch-Up while RLD runs at most --catch-up-max-running requests, else One-Shot")
            p.add_argument("--catch-up-threshold", type=int, default=int(_env("CATCH_UP_THRESHOLD", "64")),
                           help="Catch-Up cuts over once fewer eager tokens than this remain unsent")
            p.add_argument("--catch-up-max-running", type=int, default=int(_env("CATCH_UP_MAX_RUNNING", "4")))
        _add_kv_stall(p)
        p.add_argument("--kv-host", default=_env("KV_HOST", "127.0.0.1"), help="address the KV socket binds")
        p.add_argument("--kv-port", type=int, default=int(_env("KV_PORT", "0")), help="0 picks a free port")
        p.add_argument("--advertise-host", default=_env("ADVERTISE_HOST", ""),
                       help="address P should dial; defaults to --kv-host (or the hostname for 0.0.0.0)")
        p.add_argument("--advertise-port", type=int, default=int(_env("ADVERTISE_PORT", "0")),
                       help="port P should dial, when a proxy (e.g. the WAN emulator) stands in front; 0: --kv-port")
        _add_engine(p, kv_budget=True)
        return p

    @classmethod
    def from_argv(cls, role: str, argv: list[str] | None = None) -> DecoderConfig:
        ns = cls.parser(role).parse_args(argv)
        advertise = ns.advertise_host or (socket.gethostname() if ns.kv_host in ("0.0.0.0", "::") else ns.kv_host)
        cache = CacheConfig(ns.cache_tokens, ns.cache_bytes) if role == "main" else CacheConfig(0, 0)
        handoff = (HandoffConfig(ns.handoff_mode, ns.catch_up_threshold, ns.catch_up_max_running)
                   if role == "relay" else HandoffConfig("one-shot", 0, 0))
        return cls(_common(ns), _model(ns), role, cache, ns.kv_host, ns.kv_port, advertise, ns.advertise_port,
                   ns.kv_stall_timeout_s, handoff, ns.kv_secret_file, _engine(ns))


@dataclass(frozen=True)
class GatewayConfig:
    common: CommonConfig
    model: str
    host: str
    port: int
    default_pipeline: str
    request_timeout_s: float
    token_timeout_s: float
    max_body_bytes: int
    default_max_tokens: int
    ttft_slo_s: float = 2.0
    ttft_budget_fraction: float = 0.5
    skip_wan_max_tokens: int = 0
    wan_mbps_guess: float = 100.0
    prefill_tokens_per_s_guess: float = 1000.0
    decode_step_s_guess: float = 0.05
    route_load_penalty_tokens: int = 256
    max_running_requests: int = 0
    api_key_file: str = ""
    failure_policy: str = "recover"
    max_migrations: int = 2
    trace_store_traces: int = 500
    otlp_forward_endpoint: str = ""

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="python -m services.gateway", description="pdd gateway (OpenAI API)")
        _add_common(p, "gateway")
        p.add_argument("--model", default=_env("MODEL", "smollm2"),
                       help="model whose tokenizer and chat template the gateway uses; same as the workers'")
        p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
        p.add_argument("--port", type=int, default=int(_env("PORT", "8000")))
        p.add_argument("--pipeline", dest="default_pipeline", default=_env("PIPELINE", "auto"),
                       choices=("auto", "p-md", "p-rld-md"),
                       help="pipeline for requests that do not name one; auto: PDD's policy per request")
        p.add_argument("--request-timeout-s", type=float, default=float(_env("REQUEST_TIMEOUT_S", "300")))
        p.add_argument("--token-timeout-s", type=float, default=float(_env("TOKEN_TIMEOUT_S", "60")),
                       help="longest wait for the next token before the request fails")
        p.add_argument("--max-body-bytes", type=int, default=int(_env("MAX_BODY_BYTES", str(4 * 1024 * 1024))))
        p.add_argument("--default-max-tokens", type=int, default=int(_env("DEFAULT_MAX_TOKENS", "256")))
        p.add_argument("--ttft-slo-ms", type=float, default=float(_env("TTFT_SLO_MS", "2000")))
        p.add_argument("--ttft-budget-fraction", type=float, default=float(_env("TTFT_BUDGET_FRACTION", "0.5")),
                       help="auto picks P-MD when MD is predicted to be ready within this fraction of the SLO")
        p.add_argument("--skip-wan-max-tokens", type=int, default=int(_env("SKIP_WAN_MAX_TOKENS", "0")),
                       help="requests with at most this max_tokens that would go P-RLD-MD skip the WAN (0: off)")
        p.add_argument("--wan-mbps-guess", type=float, default=float(_env("WAN_MBPS_GUESS", "100")),
                       help="link rate assumed until P has measured one")
        p.add_argument("--prefill-tokens-per-s-guess", type=float,
                       default=float(_env("PREFILL_TOKENS_PER_S_GUESS", "1000")))
        p.add_argument("--decode-step-s-guess", type=float, default=float(_env("DECODE_STEP_S_GUESS", "0.05")),
                       help="one decode step on MD, to turn its queue into a wait")
        p.add_argument("--route-load-penalty-tokens", type=int,
                       default=int(_env("ROUTE_LOAD_PENALTY_TOKENS", "256")),
                       help="cache-aware MD routing: one running request costs as much as this many hit tokens")
        p.add_argument("--max-running-requests", type=int, default=int(_env("MAX_RUNNING_REQUESTS", "64")),
                       help="requests in flight before new ones get 429 with Retry-After (0: no limit)")
        p.add_argument("--api-key-file", default=_env("API_KEY_FILE", ""),
                       help="file holding the API key clients must send as a Bearer token; empty: open")
        p.add_argument("--failure-policy", default=_env("FAILURE_POLICY", "recover"), choices=("recover", "fail"),
                       help="when a tier is lost mid-request: recover (RLD finishes, MD takes over, or the request "
                            "moves to another instance) or fail with an error; a request may name its own")
        p.add_argument("--max-migrations", type=int, default=int(_env("MAX_MIGRATIONS", "2")),
                       help="times one request may be moved to other instances after losing one (recover policy)")
        p.add_argument("--trace-store-traces", type=int, default=int(_env("TRACE_STORE_TRACES", "500")),
                       help="the gateway's OTLP receiver (POST /v1/traces) keeps this many recent traces")
        p.add_argument("--otlp-forward-endpoint", default=_env("OTLP_FORWARD_ENDPOINT", ""),
                       help="also forward every OTLP/HTTP batch the gateway receives to this endpoint")
        return p

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> GatewayConfig:
        ns = cls.parser().parse_args(argv)
        return cls(_common(ns), ns.model, ns.host, ns.port, ns.default_pipeline, ns.request_timeout_s,
                   ns.token_timeout_s, ns.max_body_bytes, ns.default_max_tokens, ns.ttft_slo_ms / 1000.0,
                   ns.ttft_budget_fraction, ns.skip_wan_max_tokens, ns.wan_mbps_guess,
                   ns.prefill_tokens_per_s_guess, ns.decode_step_s_guess, ns.route_load_penalty_tokens,
                   ns.max_running_requests, ns.api_key_file, ns.failure_policy, ns.max_migrations,
                   trace_store_traces=ns.trace_store_traces, otlp_forward_endpoint=ns.otlp_forward_endpoint)
