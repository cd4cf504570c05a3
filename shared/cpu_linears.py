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

    def __init__(self, linear: nn.Linear, keep_weight: bool, single_row_as_two: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias
        self.single_row_as_two = single_row_as_two
        if keep_weight:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` with a PackedLinear, in place; how many were replaced."""
    if not can_pack(model):
        return 0
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    replaced = 0
    rounds_one_row_apart: dict[tuple[int, int, bool], bool] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                shape = (child.in_features, child.out_features, child.bias is not None)
                if shape not in rounds_one_row_apart:
                    rounds_one_row_apart[shape] = one_row_rounds_apart(child)
                setattr(parent, name, PackedLinear(child, keep_weight=owners[id(child.weight)] > 1,
                                                   single_row_as_two=rounds_one_row_apart[shape]))
                replaced += 1
    return replaced


def one_row_rounds_apart(linear: nn.Linear) -> bool:
    """Whether oneDNN rounds a row alone differently from the same row among others for this
    linear's shape (a probe of random rows; the kernel oneDNN picks depends on the shape)."""
    probe = PackedLinear(linear, keep_weight=True)
    x = torch.randn(64, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)
    with torch.inference_mode():
        together = probe(x)
        return not all(torch.equal(probe(x[i:i + 1]), together[i:i + 1]) for i in range(64))


def _linear_of(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear
