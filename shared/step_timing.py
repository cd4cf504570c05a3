"""How long one packed engine step takes on a device, for the simulated engine (shared/sim_runner.py).

Two models behind one interface, `StepTiming.step_s(rows)`: a roofline from the model's config and a
device's public peak numbers (`Roofline`), and a profile measured on our own engine
(`ProfiledTiming`, written by scripts/profile_engine.py). Pure arithmetic: nothing here sleeps.
docs/sim.md gives the devices' sources and the efficiency factors.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

PROFILES_DIR = Path(__file__).parent / "sim_profiles"


@dataclass(frozen=True)
class StepRow:
    """One request's part of a step: `new_tokens` appended after `past_tokens` already in its KV."""

    past_tokens: int
    new_tokens: int
    logits: int = 1  # positions whose logits the step computes (the LM head runs on these only)


@dataclass(frozen=True)
class ModelShape:
    """What a step's cost depends on, read from a Hugging Face config.json."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, config: Mapping[str, Any], dtype_bytes: int = 2) -> ModelShape:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(layers=int(config["num_hidden_layers"]), hidden=hidden, heads=heads,
                   kv_heads=int(config.get("num_key_value_heads") or heads),
                   head_dim=int(config.get("head_dim") or hidden // heads),
                   intermediate=int(config["intermediate_size"]), vocab=int(config["vocab_size"]),
                   dtype_bytes=dtype_bytes)

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: q, k, v, o projections and a gated MLP (norms are negligible)."""
        attention = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        return attention + 3 * self.hidden * self.intermediate

    @property
    def body_params(self) -> int:
        return self.layers * self.layer_params

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class DeviceSpec:
    """A device's peak dense compute and memory bandwidth, and the fractions a serving engine reaches."""

    name: str
    peak_flops: float  # dense half-precision FLOP/s, no sparsity
    memory_bytes_per_s: float
    compute_efficiency: float  # of peak_flops reached by a step's matmuls (MFU)
    memory_efficiency: float  # of memory_bytes_per_s reached streaming weights and KV
    step_overhead_s: float  # per step: launches, scheduling, sampling, that neither roofline sees
    source: str


# Numbers from NVIDIA's data sheets (docs/sim.md); efficiency factors as docs/sim.md explains.
DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (
    DeviceSpec("h100", 989e12, 3.35e12, 0.6, 0.8, 0.002,
               "NVIDIA H100 Tensor Core GPU data sheet, SXM5: BF16 1,979 TFLOPS with sparsity (989 dense), "
               "HBM3 3.35 TB/s"),
    DeviceSpec("h800", 989e12, 3.35e12, 0.6, 0.8, 0.002,
               "NVIDIA H800 SXM5 (H100's export variant): the same SMs and HBM3 as H100 SXM5, 989 dense BF16 "
               "TFLOPS and 3.35 TB/s; only NVLink (400 GB/s) and FP64 are cut, which one device does not use"),
    DeviceSpec("h20", 148e12, 4.0e12, 0.6, 0.8, 0.002,
               "NVIDIA HGX H20 (export variant, 96 GB HBM3): 296 TFLOPS FP8 / 148 TFLOPS BF16 dense, 4.0 TB/s"),
)}


class StepTiming(Protocol):
    def step_s(self, rows: Sequence[StepRow]) -> float: ...


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float


def step_cost(model: ModelShape, rows: Sequence[StepRow]) -> StepCost:
    """FLOPs and memory traffic of one packed forward: every weight read once, each row's KV read once
    (past and new positions) and its new KV written; 2 FLOPs per weight per token, QK^T and AV over each
    new token's causal prefix."""
    tokens = sum(r.new_tokens for r in rows)
    logits = sum(r.logits for r in rows)
    # token i of a row attends over past + i + 1 positions
    attended = sum(r.new_tokens * r.past_tokens + r.new_tokens * (r.new_tokens + 1) // 2 for r in rows)
    flops = (2 * model.body_params * tokens + 2 * model.head_params * logits
             + 4 * model.layers * model.heads * model.head_dim * attended)
    kv_read = sum(r.past_tokens + r.new_tokens for r in rows) * model.kv_bytes_per_token
    weights = (model.body_params + model.head_params) * model.dtype_bytes
    return StepCost(flops, weights + kv_read + tokens * model.kv_bytes_per_token)


@dataclass(frozen=True)
class Roofline:
    model: ModelShape
    device: DeviceSpec

    def step_s(self, rows: Sequence[StepRow]) -> float:
        cost = step_cost(self.model, rows)
        compute_s = cost.flops / (self.device.peak_flops * self.device.compute_efficiency)
        memory_s = cost.bytes / (self.device.memory_bytes_per_s * self.device.memory_efficiency)
        return self.device.step_overhead_s + max(compute_s, memory_s)


PROFILE_FEATURES = ("step", "rows", "tokens", "attended_short", "attended_long", "tail_tokens")
LINEAR_BLOCK_TOKENS = 4  # the float32 matmuls measured here run 4 rows at a time; 2 or 3 left over are slow


def profile_features(rows: Sequence[StepRow], short_row_tokens: int) -> list[float]:
    """What a measured step's time is fitted on: a constant, rows, new tokens, the positions attended
    by short rows (of up to short_row_tokens: attended a query token at a time, memory bound) and by long
    ones (blocked, many queries per K and V read), which cost differently per position on our runner,
    and the tokens the linears take beyond one in a last, partial block of LINEAR_BLOCK_TOKENS: on this
    CPU a float32 linear of 2 or 3 rows costs more than one of 4 (SmolLM2's LM head, one thread: 11, 27,
    38 and 18 ms at 1 to 4 rows), so a step of 2 or 3 decode rows is slower than one of 4."""
    short = long = 0
    for r in rows:
        attended = r.new_tokens * r.past_tokens + r.new_tokens * (r.new_tokens + 1) // 2
        if r.new_tokens <= short_row_tokens:
            short += attended
        else:
            long += attended
    tokens = sum(r.new_tokens for r in rows)
    tail = max(0, tokens % LINEAR_BLOCK_TOKENS - 1)
    return [1.0, float(len(rows)), float(tokens), float(short), float(long), float(tail)]


@dataclass(frozen=True)
class ProfiledTiming:
    """A linear fit of measured step times: seconds per step, per row, per new token, per attended position
    (of short rows, of long rows), per token in the linears' partial block beyond one."""

    model: str
    device: str
    coefficients: tuple[float, ...]  # in PROFILE_FEATURES order, each >= 0
    short_row_tokens: int  # rows the measured runner attended token by token: 64 with its CPU kernel, else 1
    samples: tuple[tuple[float, ...], ...] = ()  # (PROFILE_FEATURES but step..., measured_s), for the record

    def step_s(self, rows: Sequence[StepRow]) -> float:
        return sum(c * x for c, x in zip(self.coefficients, profile_features(rows, self.short_row_tokens)))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({**asdict(self), "features": PROFILE_FEATURES}, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> ProfiledTiming:
        data = json.loads(path.read_text())
        if tuple(data["features"]) != PROFILE_FEATURES:
            raise ValueError(f"{path}: fitted on {data['features']}, not {PROFILE_FEATURES}")
        return cls(data["model"], data["device"], tuple(data["coefficients"]), data["short_row_tokens"],
                   tuple(tuple(s) for s in data["samples"]))


def fit_profile(model: str, device: str, short_row_tokens: int,
                samples: Sequence[tuple[Sequence[StepRow], float]]) -> ProfiledTiming:
    """Least squares of the relative error over (step's rows, measured seconds), so a 60 ms decode step
    counts as much as a 2 s prefill chunk, refitted without any feature whose coefficient comes out
    negative, so no step is ever modelled faster by being bigger."""
    import torch

    x = torch.tensor([profile_features(rows, short_row_tokens) for rows, _ in samples], dtype=torch.float64)
    y = torch.tensor([[s] for _, s in samples], dtype=torch.float64)
    x, y = x / y, torch.ones_like(y)  # each sample's row divided by its time: the residual is relative
    kept = list(range(len(PROFILE_FEATURES)))
    while True:
        solution = torch.linalg.lstsq(x[:, kept], y).solution[:, 0].tolist()
        negative = [k for k, c in zip(kept, solution) if c < 0]
        if not negative:
            break
        kept.remove(negative[0])
    coefficients = [0.0] * len(PROFILE_FEATURES)
    for k, c in zip(kept, solution):
        coefficients[k] = c
    records = tuple((*profile_features(rows, short_row_tokens)[1:], s) for rows, s in samples)
    return ProfiledTiming(model, device, tuple(coefficients), short_row_tokens, records)


def timing_for(model_config: Mapping[str, Any], dtype_bytes: int, device: str, profile: str) -> StepTiming:
    """`profile` (a path, or a name under shared/sim_profiles/) if given, else the roofline of `device`."""
    if profile:
        path = Path(profile)
        if not path.exists():
            path = PROFILES_DIR / (profile if profile.endswith(".json") else profile + ".json")
        return ProfiledTiming.load(path)
    if device not in DEVICES:
        raise ValueError(f"--sim-device {device!r}: one of {', '.join(DEVICES)} (or give --sim-profile)")
    return Roofline(ModelShape.from_config(model_config, dtype_bytes), DEVICES[device])
