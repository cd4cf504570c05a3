"""What one `pdd bench` run is: frozen dataclasses for the stack, the load, the workloads, the WAN,
the SLOs and the hardware costs. Built from flags in `tools/bench/cli.py`; nothing here runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import default_of
from tools.stack_config import StackConfig

DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
WORKLOADS = ("agentic", "mooncake", "synthetic")


@dataclass(frozen=True)
class StackOptions:
    """The parts of StackConfig every mode shares."""

    model: str = default_of(StackConfig, "model")
    dtype: str = default_of(StackConfig, "dtype")
    torch_threads: int = 0  # 0: the launcher's default (a third of the cores each)
    chunk_tokens: int = default_of(StackConfig, "chunk_tokens")
    cache_bytes: int | None = None  # P's cache and MD's DRC; None: the services' default
    startup_timeout_s: float = 300.0
    log_dir: Path = Path("logs/bench")
    extra_args: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (role, flags), added in every mode
    gateway_datacenter: str = "a"  # two-dc modes: the gateway beside P and RLD (a) or beside MD (b)
    cpu_affinity: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (process, cores), the same in every mode
    engine: str = default_of(StackConfig, "engine")  # "sim": P, RLD and MD model their steps (docs/sim.md)
    sim_device: str = default_of(StackConfig, "sim_device")
    sim_profile: str = default_of(StackConfig, "sim_profile")
    sim_shape: str = default_of(StackConfig, "sim_shape")  # engine sim: a larger model's shape (docs/sim.md)
    kv_byte_scale: int = default_of(StackConfig, "kv_byte_scale")  # KV bytes and the WAN's line rate divided by it
    sim_devices: tuple[tuple[str, str], ...] = ()  # (role, device): a role's own --sim-device
    instances: tuple[tuple[str, int], ...] = ()  # (role, count) of P, RLD and MD; 1 each where not given


@dataclass(frozen=True)
class WanLink:
    """The emulated link between the datacenters (two-dc modes only)."""

    bandwidth_mbps: float = 100.0
    rtt_ms: float = 30.0
    jitter_ms: float = 0.0
    trace: Path | None = None  # a bandwidth trace file for the emulator; overrides bandwidth_mbps

    @property
    def delay_ms(self) -> float:
        """One-way delay: the emulator delays each direction by this much."""
        return self.rtt_ms / 2


@dataclass(frozen=True)
class LoadOptions:
    """How requests are sent: open-loop arrivals, bounded in flight, in count and in time."""

    request_rate: float = math.inf  # requests/s (Poisson); inf: all at once (bounded by max_concurrency)
    max_concurrency: int = 4
    max_requests: int = 40
    duration_s: float = 600.0  # no request is sent after this; in-flight ones finish (or time out)
    request_timeout_s: float = 300.0
    warmup_requests: int = 1  # small unmeasured requests per workload before the clock starts
    progress: bool = True


@dataclass(frozen=True)
class AgenticOptions:
    """Multi-turn agent sessions: each turn appends the last answer and a tool output to the history."""

    hit_rate: float = 0.9  # mean prefix hit rate over measured requests (an unbounded cache's)
    prefix_tokens: int = 512  # a session's first prompt, and a fresh request's prompt
    output_tokens: int = 16  # every answer (sent with ignore_eos, so lengths are exact)
    turns_per_session: int = 8
    high_hit: float = 0.95  # a long-running session's per-turn hit; fresh requests (hit 0) make up the rest
    max_context_tokens: int = 2048
    tool_call_share: float = 0.0  # of session turns, those answered by a short tool call instead
    tool_call_tokens: int = 8  # a tool call's length


@dataclass(frozen=True)
class MooncakeOptions:
    """The Mooncake conversation trace, scaled down: block size, prompt lengths and time; outputs keep
    the trace's lengths, capped."""

    path: Path = DEFAULT_TRACE
    block_tokens: int = 16  # the trace's blocks are 512 tokens; prompt lengths scale by block_tokens/512
    max_input_tokens: int = 1024
    max_output_tokens: int = 32
    time_scale: float = 4.0  # arrival times are multiplied by this (>1 slows the trace down)
    skip: int = 0  # start at this line of the trace


@dataclass(frozen=True)
class SyntheticOptions:
    input_tokens: int = 256
    output_tokens: int = 32


@dataclass(frozen=True)
class Slo:
    """A request is good when it meets every SLO that is set (None: not checked)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None


@dataclass(frozen=True)
class Costs:
    """Hardware cost of one instance of each tier, for BCR (goodput per unit of cost)."""

    prefill: float = 1.0
    relay: float = 1.0
    main: float = 1.0
    target: float = 1.0  # one server of another system (--target-url), on the same machine

    def of(self, instances: dict[str, int]) -> float:
        return sum(getattr(self, tier) * n for tier, n in instances.items())


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible server pdd did not start (a peer such as vLLM, or a pdd already running),
    measured by the same client with the same metric definitions."""

    name: str  # how the report names it, in the place of a mode
    url: str  # its API root, e.g. http://127.0.0.1:8100 (without /v1)
    model: str | None = None  # the `model` field its requests carry; None: left out (the server's default)


@dataclass(frozen=True)
class BenchConfig:
    modes: tuple[str, ...] = ("pd-local", "pd-wan", "pd-wan-drc", "pdd")
    workloads: tuple[str, ...] = ("agentic",)
    hit_rates: tuple[float, ...] = ()  # agentic sweep; empty: just agentic.hit_rate
    seed: int = 0
    out_dir: Path = Path("bench-results")
    stack: StackOptions = field(default_factory=StackOptions)
    load: LoadOptions = field(default_factory=LoadOptions)
    wan: WanLink = field(default_factory=WanLink)
    slo: Slo = field(default_factory=Slo)
    costs: Costs = field(default_factory=Costs)
    agentic: AgenticOptions = field(default_factory=AgenticOptions)
    mooncake: MooncakeOptions = field(default_factory=MooncakeOptions)
    synthetic: SyntheticOptions = field(default_factory=SyntheticOptions)
    targets: tuple[Target, ...] = ()  # replayed after the modes, each as it is
