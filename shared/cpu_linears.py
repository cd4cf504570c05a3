"""oneDNN-prepacked linears for a bfloat16 model on a CPU.

`F.linear` on a bfloat16 CPU tensor calls oneDNN, which reorders the weight into its blocked
layout on every call; at decode sizes that reorder is a third of the matmul's time (SmolLM2,
one thread, all linears of one forward: 35.8 against 21.7 ms at one row, 51.4 against 32.8 at
sixteen). `pack_linears` does the reorder once, at load, and calls oneDNN's linear with the
packed weight, which computes bit-identical outputs (the same kernel; checked at start-up on a
probe). float32 models are left alone: there the packed kernel rounds differently from MKL's,
and transformers' float32 results stay the reference.

For the shapes where oneDNN rounds a row alone differently from the same row among others
(probed at load; of SmolLM2's, only the MLP down projection, 1536 inputs: there a single row
differs in the last bit where every count from 2 to 128 agrees), a single row is computed as the
first of two copies of it. Without that, a request's outputs would depend on whether it had its
step to itself, and MD's one-pass recomputation of RLD's eager tokens would not give RLD's KV.
Two rows cost about what one does there (46 against 45 µs); doing it for every linear cost 4 ms of
a 34 ms step, so the others are left alone.

Some CPUs of the same kind switch kernels at a row count as well: on one, every shape of
SmolLM2's rounds rows differently in calls of 33 rows or more than in calls of 32 or fewer. The load-time probe finds the largest count up to which every probed count
rounds like a row alone (`rows_per_call`); a decoder's calls with more rows are split into calls
of at most that many, so its rows still come out alike whatever shares the step. P's runner does
not split: its rows are a prompt's, never compared with another tier's, and splitting a 512-row
chunk costs two to three times the call.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """A `nn.Linear`'s forward with its weight in oneDNN's layout.

    The plain weight is kept only when another module shares it (a tied LM head and input
    embeddings), so packing does not double the model's memory.
    """

    def __init__(self, linear: nn.Linear, keep_weight: bool, single_row_as_two: bool = False,
                 rows_per_call: int = 0) -> None:
        """`rows_per_call`: split calls with more rows into calls of at most that many (0: never)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias
        self.single_row_as_two = single_row_as_two
        self.rows_per_call = rows_per_call
        if keep_weight:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.rows_per_call and rows > self.rows_per_call:  # see the module's docstring
            flat = x.reshape(rows, self.in_features)
            parts = [self._call(flat[i:i + self.rows_per_call]) for i in range(0, rows, self.rows_per_call)]
            return torch.cat(parts).reshape(*x.shape[:-1], self.out_features)
        return self._call(x)

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        if self.single_row_as_two and x.numel() == self.in_features:  # see the module's docstring
            two = torch.cat([x, x], dim=-2).contiguous()
            return torch.ops.mkldnn._linear_pointwise(two, self.packed, self.bias, "none", [], "").narrow(-2, 0, 1)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(model: nn.Module) -> bool:
    """True for a bfloat16 model on a CPU whose torch has oneDNN and whose packed linear matches F.linear."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.randn(96, 64).to(torch.bfloat16)
        x = torch.randn(1, 3, 64).to(torch.bfloat16)
        probe = PackedLinear(_linear_of(weight), keep_weight=False)
        with torch.inference_mode():
            return torch.equal(probe(x), F.linear(x, weight))
    except (RuntimeError, AttributeError) as exc:  # a torch built without these ops
        log.info("packed linears unavailable: %s", exc)
        return False


def pack_linears(model: nn.Module, split_rows: bool = True) -> int:
    """Replace every nn.Linear of `model` with a PackedLinear, in place; how many were replaced.
    `split_rows`: calls with more rows than the probe found alike are split (decoders; not P)."""
    if not can_pack(model):
        return 0
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    replaced = 0
    probed: dict[tuple[int, int, bool], tuple[bool, int]] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                shape = (child.in_features, child.out_features, child.bias is not None)
                if shape not in probed:
                    probed[shape] = (one_row_rounds_apart(child), rows_alike(child) if split_rows else 0)
                single_row_as_two, rows_per_call = probed[shape]
                setattr(parent, name, PackedLinear(child, keep_weight=owners[id(child.weight)] > 1,
                                                   single_row_as_two=single_row_as_two, rows_per_call=rows_per_call))
                replaced += 1
    split = {shape: rows for shape, (_, rows) in probed.items() if rows}
    if split:
        log.info("packed linears: calls split above these row counts, where oneDNN rounds apart: %s", split)
    return replaced


PROBED_ROWS = 64
PROBES = 3  # inputs to probe with: a rounding difference shows only on some values


def rows_alike(linear: nn.Linear) -> int:
    """The largest row count up to which every count rounds each row as a row alone does (one row
    as two), probed up to PROBED_ROWS on PROBES random inputs; 0 when all of them do (no split)."""
    probe = PackedLinear(linear, keep_weight=True, single_row_as_two=True)
    alike = PROBED_ROWS
    with torch.inference_mode():
        for seed in range(PROBES):
            x = torch.randn(alike, linear.in_features, generator=torch.Generator().manual_seed(seed))
            x = x.to(linear.weight.dtype)
            alone = torch.cat([probe(x[i:i + 1]) for i in range(alike)])
            alike = next((rows - 1 for rows in range(2, alike + 1) if not torch.equal(probe(x[:rows]), alone[:rows])),
                         alike)
    return 0 if alike == PROBED_ROWS else alike


def one_row_rounds_apart(linear: nn.Linear) -> bool:
    """Whether oneDNN rounds a row alone differently from the same row among others for this
    linear's shape (a probe of random rows; the kernel oneDNN picks depends on the shape). 32 rows:
    a call that a decoder may split still compares with the kernel its parts use."""
    probe = PackedLinear(linear, keep_weight=True)
    x = torch.randn(32, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)
    with torch.inference_mode():
        together = probe(x)
        return not all(torch.equal(probe(x[i:i + 1]), together[i:i + 1]) for i in range(32))


def _linear_of(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear
