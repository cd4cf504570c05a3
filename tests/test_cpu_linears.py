"""Packed linears: a bfloat16 model computes the same logits with its weights reordered once."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from shared.cpu_linears import PackedLinear, one_row_rounds_apart, pack_linears, rows_alike
from shared.model_runner import ModelRunner
from shared.models import load_model


def test_a_bfloat16_model_gives_bit_identical_logits_after_packing(tiny_path) -> None:
    plain = load_model(tiny_path, "bfloat16", "cpu")
    packed = load_model(tiny_path, "bfloat16", "cpu")
    linears = sum(type(m) is nn.Linear for m in packed.modules())
    assert pack_linears(packed) == linears > 0
    assert not any(type(m) is nn.Linear for m in packed.modules())
    ids = torch.tensor([[5, 17, 99, 3, 250, 8, 41]])
    with torch.inference_mode():
        for rows in (ids[:, :1], ids):  # a decode-sized call and a prefill-sized one
            assert torch.equal(packed(rows).logits, plain(rows).logits)


def test_packing_keeps_a_shared_weight_and_drops_the_others() -> None:
    embed = nn.Embedding(32, 16, dtype=torch.bfloat16)
    model = nn.Sequential(embed, nn.Linear(16, 16, dtype=torch.bfloat16), nn.Linear(16, 32, bias=False,
                                                                                     dtype=torch.bfloat16))
    model[2].weight = embed.weight  # a tied LM head
    assert pack_linears(model) == 2
    assert not hasattr(model[1], "weight") and model[1].bias is not None
    assert model[2].weight is embed.weight
    x = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert model(x).shape == (1, 3, 32)


def test_float32_models_are_left_as_transformers_runs_them(tiny_path) -> None:
    runner = ModelRunner(load_model(tiny_path, "float32", "cpu"))
    assert runner.packed_linears == 0
    assert not any(isinstance(m, PackedLinear) for m in runner.model.modules())


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


@pytest.mark.parametrize("inputs,outputs", [(1536, 576), (576, 1536), (576, 192)])
def test_a_row_comes_out_the_same_whatever_number_of_rows_shares_the_call(inputs, outputs) -> None:
    """SmolLM2's shapes: alone, or among 2 to 64 rows, a row's output is bit-identical, so a
    request's tokens do not depend on its batch (oneDNN rounds one row differently at 1536 inputs,
    and on some CPUs calls of more than 32 rows differently: the probes find both)."""
    torch.manual_seed(0)
    plain = nn.Linear(inputs, outputs, bias=False).to(torch.bfloat16)
    linear = PackedLinear(plain, keep_weight=False, single_row_as_two=one_row_rounds_apart(plain),
                          rows_per_call=rows_alike(plain))
    x = torch.randn(64, inputs).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([linear(x[i:i + 1]) for i in range(64)])
        for rows in (2, 5, 33, 64):
            assert torch.equal(torch.cat([linear(x[i:i + rows]) for i in range(0, 64, rows)]), alone), rows
        assert linear(x[:1].unsqueeze(0)).shape == (1, 1, outputs)
        assert linear(x[:50].unsqueeze(0)).shape == (1, 50, outputs)
