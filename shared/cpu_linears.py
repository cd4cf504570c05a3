"""The linears of a bfloat16 model on a CPU: weights packed once for oneDNN, and a decoder's rows
computed so that a row's output never depends on how many rows share its call.

Packing. `F.linear` on a bfloat16 CPU tensor calls oneDNN, which reorders the weight into its
blocked layout on every call; at decode sizes that reorder is a third of the matmul's time (SmolLM2,
one thread, all linears of one forward: 35.8 against 21.7 ms at one row, 51.4 against 32.8 at
sixteen). `CpuLinear` does the reorder once, at load, and calls oneDNN's linear with the packed
weight. A shape is packed only where the probe at load finds the packed kernel giving F.linear's
bits at the row counts the layer will be called with; elsewhere it stays on F.linear, and oneDNN
builds without a bfloat16 reorder (CPUs without AVX-512, e.g. AVX2 only) pack nothing.

Rows alike. oneDNN picks its kernel by the call's shape, and kernels round differently: a row's
bits can depend on how many rows share the call. Then a request's tokens would depend on its batch,
and MD's one-pass recomputation of RLD's eager tokens would not give RLD's KV. What the load-time
probe found (SmolLM2's shapes, one thread; other CPUs emulated with ONEDNN_MAX_CPU_ISA):
- AMX (and AVX-512 BF16): every count from 1 to 32 rounds a row as a row alone; 33 and more do not.
- one CPU of that kind: a single row of the MLP down projection (1536 inputs) rounds apart from
  every count from 2 to 128, which agree with each other.
- AVX-512 without BF16: the one-row kernel rounds some rows apart from any larger call (about one
  in ten at 576 inputs, one in hundreds at 64), and counts above 3 switch kernels.
- AVX2 only (F.linear, nothing packed): every count from 1 to 64 alike.
So a decoder's layers all follow one `RowPlan`: calls of `pad_to` to `max_rows` rows (a smaller call
is padded, a larger one split), each row getting the bits it gets alone (`pad_to` 1) or padded to
two (`pad_to` 2), whichever the probe found every layer to agree with. Where nothing agrees, that is
one row per call: slower, and exact by construction. P's runner neither pads nor splits: its rows
are a prompt's, never compared with another tier's, and splitting a 512-row chunk costs two to three
times the call.

float32 models are left alone: transformers' float32 results are the reference there.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

PROBED_ROWS = 64  # counts probed for a decoder's layer; larger calls are always split
PROBES = 3  # random inputs per count: a rounding difference shows only on some values
P_PROBED_ROWS = (1, 3, 33, 100)  # counts at which P's packed layers must give F.linear's bits
DECODER_PROBED_ROWS = (1, 2, 3, 4, 8, 16, 32, 33, 64)  # likewise for a decoder's
CPU_PROBE_SHAPES = ((1536, 576),)  # (inputs, outputs) probed for every decoder's plan, besides its own

Matmul = Callable[[torch.Tensor], torch.Tensor]  # [rows, in_features] -> [rows, out_features]


@dataclass(frozen=True)
class RowPlan:
    """How a layer's calls are shaped. pad_to: calls of fewer rows are padded to this many;
    max_rows: calls of more rows are split into calls of at most this many (0: never split)."""
    pad_to: int = 1
    max_rows: int = 0

    def calls(self, rows: int) -> list[tuple[int, int]]:
        """(first row, rows) of each call a `rows`-row input is computed in."""
        step = self.max_rows or rows
        return [(start, min(step, rows - start)) for start in range(0, rows, step)]


class CpuLinear(nn.Module):
    """An `nn.Linear`'s forward on a CPU, its weight packed for oneDNN or not, its calls shaped by a RowPlan.

    The plain weight is kept when unpacked, or when another module shares it (a tied LM head and
    input embeddings), so packing does not double the model's memory.
    """

    def __init__(self, linear: nn.Linear, plan: RowPlan, packed: bool, keep_weight: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.plan = plan
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None) if packed else None
        if keep_weight or not packed:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == 0 or (rows >= self.plan.pad_to and (not self.plan.max_rows or rows <= self.plan.max_rows)):
            return self._matmul(x.contiguous())  # no row (a chunk that samples nothing) or a planned count
        flat = x.reshape(rows, self.in_features)
        parts = [self._padded(flat.narrow(0, start, n)) for start, n in self.plan.calls(rows)]
        return torch.cat(parts).reshape(*x.shape[:-1], self.out_features)

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        if n >= self.plan.pad_to:
            return self._matmul(rows.contiguous())
        filler = rows[:1].expand(self.plan.pad_to - n, -1)  # rows never mix in a matmul: any filler will do
        return self._matmul(torch.cat([rows, filler])).narrow(0, 0, n)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        packed = "packed" if self.packed is not None else "F.linear"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{packed}, pad_to={self.plan.pad_to}, max_rows={self.plan.max_rows}")


def can_pack(model: nn.Module) -> bool:
    """True for a bfloat16 model on a CPU whose torch's oneDNN can reorder bfloat16 weights here."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except (RuntimeError, AttributeError) as exc:  # no such op, or this CPU has no bfloat16 path for it
        log.info("packed linears: off, oneDNN cannot pack bfloat16 weights here: %s", exc)
        return False
    return True


Shape = tuple[int, int, bool]  # a linear's in_features, out_features, and whether it has a bias


def adapt_linears(model: nn.Module, row_invariant: bool = True, pack: bool = True) -> int:
    """Replace every nn.Linear of a bfloat16 CPU model with a CpuLinear, in place; how many were packed.

    `row_invariant`: a decoder's model, whose rows must come out alike at any count (see the module's
    docstring); P's passes False. `pack`: use the packed kernel where the probe finds it exact. The
    probes run on made-up weights of each shape (oneDNN picks its kernel by shape, not by values),
    once per process."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.bfloat16:
        return 0
    packing = pack and can_pack(model)
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    linears = [(parent, name, child) for parent in list(model.modules())
               for name, child in list(parent.named_children()) if type(child) is nn.Linear]
    shapes = sorted({_shape(child) for _, _, child in linears})
    packed = {shape: packing and packed_matches(shape, row_invariant) for shape in shapes}
    plan = decoder_plan(tuple(packed.items())) if row_invariant else RowPlan()
    for parent, name, child in linears:
        setattr(parent, name, CpuLinear(child, plan, packed[_shape(child)], keep_weight=owners[id(child.weight)] > 1))
    for (inputs, outputs, _), on in packed.items():
        if packing and not on:
            log.info("packed linears: off for %dx%d, where oneDNN's packed kernel rounds apart from F.linear",
                     inputs, outputs)
    count = sum(packed[_shape(child)] for _, _, child in linears)
    if row_invariant:
        log.info("linears: a row gets the bits it gets %s, in calls of at most %d rows (%d of %d packed)",
                 "alone" if plan.pad_to == 1 else f"among {plan.pad_to}", plan.max_rows, count, len(linears))
    return count


def _shape(linear: nn.Linear) -> Shape:
    return linear.in_features, linear.out_features, linear.bias is not None


@functools.cache
def packed_matches(shape: Shape, decoder: bool) -> bool:
    """Whether the packed kernel gives F.linear's bits at each count of rows a decoder's (or P's) calls have."""
    linear = _made_up_linear(shape)
    packed = CpuLinear(linear, RowPlan(), packed=True, keep_weight=False)
    counts = DECODER_PROBED_ROWS if decoder else P_PROBED_ROWS
    with torch.inference_mode():
        for seed in range(PROBES):
            x = _probe_input(max(counts), linear.in_features, seed)
            if not all(torch.equal(packed(x[:n]), F.linear(x[:n], linear.weight, linear.bias)) for n in counts):
                return False
    return True


@functools.cache
def decoder_plan(packed: tuple[tuple[Shape, bool], ...]) -> RowPlan:
    """The plan for a decoder whose layers have these shapes, packed or not; also probed on
    SmolLM2's MLP shapes, where a kernel's rounding shows on nearly every row (a small model's own
    shapes may show it on one row in hundreds)."""
    kinds = {on for _, on in packed}
    probed = [*packed, *(((inputs, outputs, False), on) for inputs, outputs in CPU_PROBE_SHAPES for on in kinds)]
    kernels = [(CpuLinear(_made_up_linear(shape), RowPlan(), on, keep_weight=False), shape[0])
               for shape, on in probed]
    return row_plan(kernels)


def _made_up_linear(shape: Shape) -> nn.Linear:
    inputs, outputs, bias = shape
    generator = torch.Generator().manual_seed(inputs * 7919 + outputs)
    linear = nn.Linear(inputs, outputs, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(outputs, inputs, generator=generator) * inputs ** -0.5)
        if linear.bias is not None:
            linear.bias.copy_(torch.randn(outputs, generator=generator) * 0.1)
    return linear


def row_plan(kernels: Sequence[tuple[Matmul, int]]) -> RowPlan:
    """One plan for all of a model's layers, under which every row gets one kernel's bits: a row
    padded to two where any layer rounds a row alone apart from the same row among others (the
    kernel for one row differs from the one for many: a CPU property, so decided once for all
    layers), and calls split above the smallest count up to which every layer's counts agree."""
    pad_to = 1
    alike = [_rows_alike(k, inputs, pad_to) for k, inputs in kernels]
    if 1 in alike:
        pad_to = 2
        alike = [_rows_alike(k, inputs, pad_to) for k, inputs in kernels]
    max_rows = min(alike)
    if max_rows < pad_to:  # a row's bits depend on its neighbours: one row a call
        return RowPlan(pad_to=1, max_rows=1)
    return RowPlan(pad_to=pad_to, max_rows=max_rows)


def _rows_alike(matmul: Matmul, in_features: int, pad_to: int) -> int:
    """The largest count N up to PROBED_ROWS such that every count from pad_to to N gives each row
    the bits it gets padded to pad_to rows (by copies of itself); 0 when not even pad_to does."""
    alike = PROBED_ROWS
    with torch.inference_mode():
        for seed in range(PROBES):
            x = _probe_input(alike, in_features, seed)
            alone = torch.cat([matmul(x[i:i + 1].expand(pad_to, -1).contiguous())[:1] for i in range(alike)])
            alike = next((n - 1 for n in range(pad_to, alike + 1) if not torch.equal(matmul(x[:n]), alone[:n])),
                         alike)
            if alike < pad_to:
                return 0
    return alike


def _probe_input(rows: int, in_features: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
