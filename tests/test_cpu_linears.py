"""A bfloat16 model's CPU linears: packing changes no bit, and a decoder's row comes out the same
whatever number of rows shares its call, on whichever CPU (and oneDNN ISA cap) the suite runs."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.cpu_linears import PROBED_ROWS, CpuLinear, RowPlan, adapt_linears, can_pack, row_plan
from shared.model_runner import ModelRunner
from shared.models import load_model

pytestmark = pytest.mark.exactness


def test_packing_changes_no_logit_of_a_decoder_or_of_p(tiny_path) -> None:
    """Packed where the probe found it exact (everywhere, on a CPU with AVX-512 BF16; nowhere where
    oneDNN cannot pack bfloat16): the logits are those of the same plan on F.linear."""
    ids = torch.tensor([[5, 17, 99, 3, 250, 8, 41]])
    for row_invariant in (True, False):
        plain = load_model(tiny_path, "bfloat16", "cpu")
        packed = load_model(tiny_path, "bfloat16", "cpu")
        linears = sum(type(m) is nn.Linear for m in packed.modules())
        assert adapt_linears(plain, row_invariant, pack=False) == 0
        packed_count = adapt_linears(packed, row_invariant)
        assert 0 <= packed_count <= linears and (packed_count > 0 or not can_pack(packed))
        assert not any(type(m) is nn.Linear for m in packed.modules())
        with torch.inference_mode():
            for rows in (ids[:, :1], ids):  # a decode-sized call and a prefill-sized one
                assert torch.equal(packed(rows).logits, plain(rows).logits)


def test_p_keeps_f_linears_arithmetic(tiny_path) -> None:
    """P neither pads nor splits: its logits are transformers' own, packed or not."""
    reference = load_model(tiny_path, "bfloat16", "cpu")
    model = load_model(tiny_path, "bfloat16", "cpu")
    adapt_linears(model, row_invariant=False)
    assert all(m.plan == RowPlan() for m in model.modules() if isinstance(m, CpuLinear))
    ids = torch.tensor([[5, 17, 99, 3, 250, 8, 41] * 10])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_packing_keeps_a_shared_weight_and_drops_the_others() -> None:
    embed = nn.Embedding(32, 16, dtype=torch.bfloat16)
    model = nn.Sequential(embed, nn.Linear(16, 16, dtype=torch.bfloat16), nn.Linear(16, 32, bias=False,
                                                                                     dtype=torch.bfloat16))
    model[2].weight = embed.weight  # a tied LM head
    packed = adapt_linears(model)
    assert all(isinstance(m, CpuLinear) for m in (model[1], model[2]))
    if packed:
        assert model[1].packed is None or not hasattr(model[1], "weight")
        assert model[1].bias is not None
    assert model[2].weight is embed.weight
    x = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert model(x).shape == (1, 3, 32)


def test_float32_models_are_left_as_transformers_runs_them(tiny_path) -> None:
    runner = ModelRunner(load_model(tiny_path, "float32", "cpu"))
    assert runner.packed_linears == 0
    assert not any(isinstance(m, CpuLinear) for m in runner.model.modules())


def test_a_bfloat16_model_on_torchs_attention_keeps_its_kv_in_float32_holding_bfloat16_values(tiny_path) -> None:
    """SDPA runs in float32 there anyway: the KV is kept upcast once, not on every step. Every value
    is still the model's own bfloat16 rounding, and what leaves the runner is bfloat16. (With pdd's
    decode kernel, which reads bfloat16, it stays bfloat16: tests/test_cpu_attention.py.)"""
    runner = ModelRunner(load_model(tiny_path, "bfloat16", "cpu"), decode_attention="sdpa")
    assert runner.kv_dtype == torch.float32
    kv = runner.new_kv(16)
    runner.forward(kv, [5, 17, 99, 3])
    out = kv.slice(0, 4)
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), kv.data[:, :, :, :4])
    received = torch.randn(runner.num_layers, 2, runner.kv_heads, 3, runner.head_dim)  # a float32 P's KV
    kept = runner.new_kv(8, [received])
    assert torch.equal(kept.data[:, :, :, :3], received.to(torch.bfloat16).float()), "rounded to the model's dtype"


@pytest.mark.parametrize("inputs,outputs", [(1536, 576), (576, 1536), (576, 192), (576, 49152)])
def test_a_row_comes_out_the_same_whatever_number_of_rows_shares_the_call(inputs, outputs) -> None:
    """SmolLM2's shapes: alone, or among 2 to 64 rows, a decoder's row is bit-identical, so a
    request's tokens do not depend on its batch. oneDNN picks its kernel by the row count, and on
    some CPUs one row, or calls of over 32 rows, or of over 2 to 14 rows round apart: the plan the
    probe makes (pad a call, split it) gives every row one kernel's bits."""
    torch.manual_seed(0)
    plain = nn.Linear(inputs, outputs, bias=False).to(torch.bfloat16)
    model = nn.Sequential(plain)
    adapt_linears(model)
    linear = model[0]
    assert isinstance(linear, CpuLinear)
    x = torch.randn(64, inputs, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([linear(x[i:i + 1]) for i in range(64)])
        for rows in (2, 3, 5, 16, 33, 64):
            assert torch.equal(torch.cat([linear(x[i:i + rows]) for i in range(0, 64, rows)]), alone), rows
        assert linear(x[:1].unsqueeze(0)).shape == (1, 1, outputs)
        assert linear(x[:50].unsqueeze(0)).shape == (1, 50, outputs)


def test_the_plan_pads_a_row_that_rounds_apart_alone_and_splits_above_what_agrees() -> None:
    """Made-up kernels with the faults seen on real CPUs: counts over 20 (or 40) rounding apart from
    those up to it; one row rounding apart from every other count (then a row is padded to two for
    every layer: which kernel serves one row is the CPU's, not a layer's, choice)."""
    def kernel(rounds_apart: Callable[[int], bool]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: x[:, :8] * 2 + (1e-3 if rounds_apart(x.shape[0]) else 0.0)

    def plan(*faults: Callable[[int], bool]) -> RowPlan:
        return row_plan([(kernel(fault), 16) for fault in faults])

    assert plan(lambda n: False) == RowPlan(pad_to=1, max_rows=PROBED_ROWS)
    assert plan(lambda n: False, lambda n: n > 20) == RowPlan(pad_to=1, max_rows=20)
    assert plan(lambda n: n == 1, lambda n: False) == RowPlan(pad_to=2, max_rows=PROBED_ROWS)
    assert plan(lambda n: n == 1, lambda n: n > 40) == RowPlan(pad_to=2, max_rows=40)
    assert plan(lambda n: n in (5, 9)) == RowPlan(pad_to=1, max_rows=4)
    assert RowPlan(pad_to=2, max_rows=5).calls(11) == [(0, 5), (5, 5), (10, 1)]


def test_a_padded_and_split_layer_gives_each_row_its_bits_alone() -> None:
    linear = nn.Linear(16, 8).to(torch.bfloat16)
    x = torch.randn(11, 16).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([F.linear(torch.cat([x[i:i + 1]] * 2), linear.weight, linear.bias)[:1] for i in range(11)])
        planned = CpuLinear(linear, RowPlan(pad_to=2, max_rows=5), packed=False, keep_weight=True)
        rows_of = [torch.cat([F.linear(x[a:a + n], linear.weight, linear.bias) if n >= 2 else alone[a:a + 1]])
                   for a, n in RowPlan(pad_to=2, max_rows=5).calls(11)]
        assert torch.equal(planned(x), torch.cat(rows_of))
        assert planned(x[None]).shape == (1, 11, 8)
        assert planned(x[:0][None]).shape == (1, 0, 8)  # an LM head over a chunk that samples nothing
