"""Deployment modes: each is a StackConfig (topology, pipeline, caches) plus the `pdd` fields its
requests carry, and the tier instances it pays for. A mode whose feature pdd lacks says why and
is skipped; it is never stood in for by another.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from shared.config import GatewayConfig
from shared.messages import DecodeAssign
from tools.bench.config import BenchConfig
from tools.stack_config import StackConfig

POLICY = "auto"  # the gateway's per-request pipeline choice


@dataclass(frozen=True)
class Mode:
    name: str
    description: str
    pipeline: str  # "p-md", "p-rld-md", or POLICY (falls back to p-rld-md where the gateway has none)
    two_dc: bool
    drc: bool
    relay: bool  # does it use (and pay for) an RLD instance
    handoff_mode: str | None = None  # None: RLD's own choice

    def instances(self, stack: StackConfig) -> dict[str, int]:
        """The instances of each tier the mode pays for: its stack's, less RLD where it uses none."""
        return {"prefill": stack.count_of("prefill"), "relay": stack.count_of("relay") if self.relay else 0,
                "main": stack.count_of("main")}


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("pd-local", "one datacenter, P-MD, no WAN", "p-md", two_dc=False, drc=True, relay=False),
    Mode("pd-wan", "two datacenters, P-MD, MD's DRC off: the whole KV crosses the WAN", "p-md",
         two_dc=True, drc=False, relay=False),
    Mode("pd-wan-drc", "two datacenters, P-MD, MD's DRC on", "p-md", two_dc=True, drc=True, relay=False),
    Mode("pdd", "two datacenters, everything: the gateway's pipeline policy, RLD's handoff choice, DRC",
         POLICY, two_dc=True, drc=True, relay=True),
    Mode("pdd-oneshot", "as pdd, every handoff One-Shot", POLICY, two_dc=True, drc=True, relay=True,
         handoff_mode="one-shot"),
    Mode("pdd-catchup", "as pdd, every handoff Catch-Up", POLICY, two_dc=True, drc=True, relay=True,
         handoff_mode="catch-up"),
)}

# Modes the issue names that pdd cannot run honestly, and why.
NOT_AVAILABLE: dict[str, str] = {
    "colocated": "pdd has no single-process (non-disaggregated) server to compare against",
}


@cache
def _gateway_options() -> dict[str, tuple[str, ...] | None]:
    """The gateway's flags and their choices, so modes use only what the gateway in this tree has."""
    actions = GatewayConfig.parser()._actions
    return {opt: tuple(a.choices) if a.choices else None for a in actions for opt in a.option_strings}


def two_dc_supported() -> bool:
    return "topology" in {f.name for f in dataclasses.fields(StackConfig)}


def policy_supported() -> bool:
    return POLICY in (_gateway_options().get("--pipeline") or ())


def handoff_mode_supported() -> bool:
    return "handoff_mode" in {f.name for f in dataclasses.fields(DecodeAssign)}


def pipeline_of(mode: Mode) -> str:
    """The pipeline the gateway runs by default in this mode."""
    if mode.pipeline == POLICY and not policy_supported():
        return "p-rld-md"
    return mode.pipeline


def unavailable_reason(name: str) -> str | None:
    """None when the mode can run here; otherwise why not."""
    if name in NOT_AVAILABLE:
        return NOT_AVAILABLE[name]
    mode = MODES.get(name)
    if mode is None:
        return f"unknown mode; known: {', '.join([*MODES, *NOT_AVAILABLE])}"
    if mode.two_dc and not two_dc_supported():
        return "the launcher has no two-datacenter topology (WAN emulator between A and B)"
    if mode.handoff_mode and not handoff_mode_supported():
        return "requests cannot choose their handoff mode (no Catch-Up handoff)"
    return None


def stack_config(mode: Mode, cfg: BenchConfig, log_dir: Path) -> StackConfig:
    s = cfg.stack
    extra: dict[str, list[str]] = {role: list(flags) for role, flags in s.extra_args}
    cache_flags = ["--cache-bytes", str(s.cache_bytes)] if s.cache_bytes is not None else []
    extra.setdefault("prefill", []).extend(cache_flags)
    extra.setdefault("relay", []).extend(cache_flags)
    extra.setdefault("main", []).extend(cache_flags if mode.drc else ["--cache-tokens", "0"])
    if pipeline_of(mode) == POLICY and cfg.slo.ttft_ms is not None and "--ttft-slo-ms" in _gateway_options():
        extra.setdefault("gateway", []).extend(["--ttft-slo-ms", str(cfg.slo.ttft_ms)])
    fields: dict[str, object] = {
        "model": s.model, "dtype": s.dtype, "port": 0, "pipeline": pipeline_of(mode), "log_dir": log_dir,
        "chunk_tokens": s.chunk_tokens, "startup_timeout_s": s.startup_timeout_s, "extra_args": extra,
        "cpu_affinity": dict(s.cpu_affinity), "engine": s.engine, "sim_device": s.sim_device,
        "sim_profile": s.sim_profile, "sim_shape": s.sim_shape, "kv_byte_scale": s.kv_byte_scale,
        "sim_devices": dict(s.sim_devices), "instances": dict(s.instances)}
    if s.torch_threads:
        fields["torch_threads"] = s.torch_threads
    if mode.two_dc:
        w = cfg.wan
        fields.update(topology="two-dc", wan_bandwidth_mbps=w.bandwidth_mbps, wan_delay_ms=w.delay_ms,
                      wan_jitter_ms=w.jitter_ms, wan_trace=w.trace, gateway_datacenter=s.gateway_datacenter)
    return StackConfig(**fields)  # type: ignore[arg-type]


def request_fields(mode: Mode) -> dict[str, object]:
    """The `pdd` object every request of this mode carries: nothing that overrides the policy."""
    pipeline = pipeline_of(mode)
    fields: dict[str, object] = {} if pipeline == POLICY else {"pipeline": pipeline}
    if mode.handoff_mode:
        fields["handoff_mode"] = mode.handoff_mode
    return fields
