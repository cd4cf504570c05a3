"""The linears of a float32 model on a CPU, made faster where timing at load shows a faster way,
without touching a row that is computed alone.

A float32 model's results are transformers' own: the token-exact tests hold a request decoded
alone to `generate`, whose steps are one-row `F.linear` calls (MKL). So a one-row call always stays
`F.linear` on the plain weight. A call of more rows has no such reference: MKL already rounds a row
apart by the call's row count (on this AVX-512 EPYC: one row; two or three; four to eight), so a
row among others never had transformers' bits, and its call may take whatever kernel is fastest.
For a decoder, whose steps are calls of a few rows, two ways are timed per shape at load (the
fastest of TIMING_REPEATS calls at 1 to MAX_ROWS rows, once per shape and thread count in a process):
- oneDNN's linear on a weight packed once at load (its float32 kernel is 2-6x MKL's at 2 to 8 rows
  here: SmolLM2's LM head 6-8 ms against 17-34), taken where it agrees with F.linear to rounding
  (AGREEMENT) and its calls of 2 to MAX_ROWS rows take at most GAIN of their time on F.linear;
  the plain weight is kept for one-row calls, so such a layer's weight is held twice;
- F.linear.
Either way with padding: a kernel may compute a few rows slower than a few more (MKL here: the LM
head 9, 22, 34 and 17 ms at 1 to 4 rows; oneDNN 7.2, 8.6, 6.6 ms at 1 to 3), so calls of pad_from to
pad_to - 1 rows are padded to pad_to where each takes at least 1 / GAIN as long (`faster_padding`).
P's model (`decoder=False`) is only padded, never packed: its chunks' bits stay MKL's. A CPU where
neither way is faster keeps F.linear everywhere.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shared.cpu_linears import CpuLinear, RowPlan, Shape, shape_of

log = logging.getLogger(__name__)

MAX_ROWS = 8  # calls are timed at 1 to this many rows; padding goes at most this far
GAIN = 0.8  # a way is taken where it takes at most this share of F.linear's time
AGREEMENT = 1e-4  # the packed kernel's largest difference from F.linear, as a share of the largest output
TIMING_REPEATS = 5  # timed calls per count (the fastest counts: the kernel's own speed), after one untimed


def adapt_float32_linears(model: nn.Module, decoder: bool = True) -> tuple[int, int]:
    """Replace each nn.Linear of a float32 CPU model that is faster another way (module docstring)
    with a CpuLinear; (how many packed, how many padded)."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return 0, 0
    can_pack = decoder and _can_pack_float32()
    linears = [(parent, name, child) for parent in list(model.modules())
               for name, child in list(parent.named_children()) if type(child) is nn.Linear]
    plans: dict[Shape, tuple[RowPlan, bool]] = {}
    packed_count = padded_count = 0
    for parent, name, child in linears:
        shape = shape_of(child)
        if shape not in plans:
            plans[shape] = _plan(shape, torch.get_num_threads(), can_pack, child)
        plan, packed = plans[shape]
        if plan != RowPlan():
            setattr(parent, name, CpuLinear(child, plan, packed=packed, keep_weight=True))
            packed_count += packed
            padded_count += not packed
    ways = [f"{i}x{o}: " + ("packed" if packed else "F.linear") + (
        f", {plan.pad_from}-{plan.pad_to - 1} rows padded to {plan.pad_to}" if plan.pad_to > plan.pad_from else "")
            for (i, o, _), (plan, packed) in plans.items() if plan != RowPlan()]
    log.info("float32 linears: %d of %d packed for calls of 2 rows or more, %d padded (%s)", packed_count,
             len(linears), padded_count, ", ".join(ways) or "F.linear is the fastest here")
    return packed_count, padded_count


_plans: dict[tuple[Shape, int, bool], tuple[RowPlan, bool]] = {}


def _plan(shape: Shape, threads: int, can_pack: bool, linear: nn.Linear) -> tuple[RowPlan, bool]:
    """(the layer's plan, whether it is packed), timed once per shape, thread count and packing."""
    key = (shape, threads, can_pack)
    if key not in _plans:
        plain = _call_times(lambda x: F.linear(x, linear.weight, linear.bias), linear.in_features)
        packed = None
        if can_pack:
            weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

            def on_packed(x: torch.Tensor) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(x, weight, linear.bias, "none", [], "")

            if agrees_with_f_linear(on_packed, linear):
                packed = _call_times(on_packed, linear.in_features)
            else:
                log.warning("float32 linears: oneDNN's packed kernel disagrees with F.linear for %dx%d beyond "
                            "rounding; not packed", linear.in_features, linear.out_features)
        _plans[key] = choose_plan(plain, packed)
    return _plans[key]


def choose_plan(plain: Sequence[float], packed: Sequence[float] | None) -> tuple[RowPlan, bool]:
    """From the times of calls of 1 to MAX_ROWS rows on F.linear and on the packed weight (None:
    not packable): packed, one row on F.linear, where its calls of 2 rows and more take at most
    GAIN of F.linear's, each way with its best padding; else F.linear with its padding."""
    padding = faster_padding(plain)
    if packed is not None:
        packed_padding = faster_padding(packed)
        if sum(_padded_times(packed, packed_padding)) <= GAIN * sum(_padded_times(plain, padding)):
            return dataclasses.replace(packed_padding, plain_rows=1), True
    return padding, False


def _padded_times(times: Sequence[float], plan: RowPlan) -> list[float]:
    """The time of a call of 2 to len(times) rows under `plan`'s padding."""
    return [times[plan.pad_to - 1] if plan.pad_from <= n < plan.pad_to else times[n - 1]
            for n in range(2, len(times) + 1)]


def faster_padding(times: Sequence[float]) -> RowPlan:
    """The padding that saves the most, from times[n - 1], a call of n rows: calls of pad_from to
    pad_to - 1 rows padded to pad_to where each of them takes at least 1 / GAIN times as long as
    pad_to rows; one row is never padded. RowPlan() when nothing is faster padded."""
    best, best_saving = RowPlan(), 0.0
    for pad_to in range(3, len(times) + 1):
        padded_s = times[pad_to - 1]
        pad_from = pad_to
        while pad_from > 2 and padded_s <= GAIN * times[pad_from - 2]:
            pad_from -= 1
        saving = sum(times[n - 1] - padded_s for n in range(pad_from, pad_to))
        if saving > best_saving:
            best, best_saving = RowPlan(pad_to=pad_to, pad_from=pad_from), saving
    return best


def _can_pack_float32() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16), None)
    except (RuntimeError, AttributeError) as exc:
        log.info("float32 linears: oneDNN cannot pack float32 weights here: %s", exc)
        return False
    return True


def agrees_with_f_linear(matmul: Callable[[torch.Tensor], torch.Tensor], linear: nn.Linear) -> bool:
    """Whether `matmul` gives F.linear's results to float32 rounding (here about 1e-6 of the largest
    output; a kernel that computes something else is off by far more) at 2 to MAX_ROWS rows."""
    x = torch.randn(MAX_ROWS, linear.in_features, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for n in range(2, MAX_ROWS + 1):
            expected = F.linear(x[:n], linear.weight, linear.bias)
            if not (matmul(x[:n]) - expected).abs().max() <= AGREEMENT * expected.abs().max():
                return False
    return True


def _call_times(matmul: Callable[[torch.Tensor], torch.Tensor], in_features: int) -> list[float]:
    """The fastest of TIMING_REPEATS calls of `matmul` on 1 to MAX_ROWS rows, the counts taken in
    turn: on a busy host the slower calls measure the host, the fastest the kernel."""
    x = torch.randn(MAX_ROWS, in_features, generator=torch.Generator().manual_seed(0))
    runs: list[list[float]] = [[] for _ in range(MAX_ROWS)]
    with torch.inference_mode():
        for _ in range(TIMING_REPEATS + 1):
            for n in range(1, MAX_ROWS + 1):
                started = time.perf_counter()
                matmul(x[:n])
                runs[n - 1].append(time.perf_counter() - started)
    return [min(run[1:]) for run in runs]
