"""A float32 model's CPU linears: a row computed alone keeps transformers' bits, whichever way the
timing at load chose for calls of more rows (oneDNN's packed kernel, padding, or F.linear), and the
choice follows the times it is given."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.cpu_linears import CpuLinear, RowPlan
from shared.float32_linears import adapt_float32_linears, agrees_with_f_linear, choose_plan, faster_padding
from shared.model_runner import ModelRunner
from shared.models import load_model

pytestmark = pytest.mark.exactness

PACKED = RowPlan(plain_rows=1)  # one row on F.linear, the rest on the packed weight


@pytest.mark.parametrize("decoder", [True, False])
def test_a_row_alone_keeps_transformers_bits_and_more_rows_stay_within_rounding(tiny_path, decoder) -> None:
    reference = load_model(tiny_path, "float32", "cpu")
    runner = ModelRunner(load_model(tiny_path, "float32", "cpu"), row_invariant=decoder)
    adapted = [m for m in runner.model.modules() if isinstance(m, CpuLinear)]
    assert len(adapted) == runner.padded_linears + runner.packed_linears
    assert all(m.plan.plain_rows == 1 for m in adapted if m.packed is not None)
    assert decoder or runner.packed_linears == 0, "P's chunks keep MKL's bits: nothing packed"
    assert all(m.plan.plain_rows >= 1 or m.plan.pad_from >= 2 for m in adapted)
    ids = torch.tensor([[5, 17, 99, 3, 250, 8, 41]])
    with torch.inference_mode():
        assert torch.equal(runner.model(ids[:, :1]).logits, reference(ids[:, :1]).logits)
        torch.testing.assert_close(runner.model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_packed_float32_layer_runs_one_row_on_f_linear_and_more_on_the_packed_weight() -> None:
    linear = nn.Linear(32, 24)
    x = torch.randn(9, 32)
    layer = CpuLinear(linear, PACKED, packed=True, keep_weight=True)
    packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def on_packed(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, linear.bias, "none", [], "")

    with torch.inference_mode():
        assert torch.equal(layer(x[:1]), F.linear(x[:1], linear.weight, linear.bias))
        for n in (2, 5, 9):
            assert torch.equal(layer(x[:n]), on_packed(x[:n]))
        padded = CpuLinear(linear, RowPlan(plain_rows=1, pad_from=2, pad_to=3), packed=True, keep_weight=True)
        assert torch.equal(padded(x[:1]), F.linear(x[:1], linear.weight, linear.bias))
        assert torch.equal(padded(x[:2]), on_packed(torch.cat([x[:2], x[:1]]))[:2])
        assert torch.equal(padded(x[:5]), on_packed(x[:5]))
        assert layer(x[None]).shape == (1, 9, 24)
        assert layer(x[:0][None]).shape == (1, 0, 24)


def test_a_float32_layer_padded_from_two_rows_leaves_one_row_alone() -> None:
    linear = nn.Linear(16, 8)
    x = torch.randn(7, 16)
    planned = CpuLinear(linear, RowPlan(pad_to=4, pad_from=2), packed=False, keep_weight=True)
    with torch.inference_mode():
        assert torch.equal(planned(x[:1]), F.linear(x[:1], linear.weight, linear.bias))
        for n in (2, 3):
            filler = x[:1].expand(4 - n, -1)
            assert torch.equal(planned(x[:n]), F.linear(torch.cat([x[:n], filler]), linear.weight, linear.bias)[:n])
        assert torch.equal(planned(x), F.linear(x, linear.weight, linear.bias))
        assert planned(x[:3][None]).shape == (1, 3, 8)


def test_padding_is_taken_where_it_saves_time_and_only_there() -> None:
    """SmolLM2's LM head on MKL here (ms at 1 to 8 rows): 2 and 3 rows padded to 4. Times that grow
    with the rows, or a step under the gain asked, pad nothing; a row alone never is."""
    assert faster_padding([9, 22, 34, 17, 16, 18, 18, 19]) == RowPlan(pad_from=2, pad_to=4)
    assert faster_padding([9, 10, 30, 31, 32, 12, 40, 41]) == RowPlan(pad_from=3, pad_to=6)
    assert faster_padding([1, 2, 3, 4, 5, 6, 7, 8]) == RowPlan()
    assert faster_padding([10, 10, 10, 10, 10, 10, 10, 10]) == RowPlan()
    assert faster_padding([10, 11, 11, 10, 10, 10, 10, 10]) == RowPlan()  # 10 against 11: under the gain
    assert faster_padding([1, 30, 30, 2]).pad_from == 2  # one row is never padded, however slow


def test_the_packed_kernel_is_taken_only_where_it_beats_f_linear_with_its_best_padding() -> None:
    lm_head = [9, 22, 34, 17, 16, 18, 18, 19]
    # SmolLM2's LM head here: packed, its 2-row calls padded to 3 (oneDNN: 7.2, 8.6, 6.6 ms at 1 to 3 rows)
    assert choose_plan(lm_head, [7, 8, 6, 6, 5, 6, 8, 8]) == (RowPlan(plain_rows=1, pad_from=2, pad_to=3), True)
    assert choose_plan(lm_head, [7, 6, 6, 6, 5, 6, 8, 8]) == (PACKED, True)
    assert choose_plan(lm_head, None) == (RowPlan(pad_from=2, pad_to=4), False)  # oneDNN cannot pack
    assert choose_plan(lm_head, [1, 15, 15, 15, 15, 15, 15, 15]) == (RowPlan(pad_from=2, pad_to=4), False)
    flat = [10.0] * 8
    assert choose_plan(flat, [1.0] + [9.0] * 7) == (RowPlan(), False)  # 0.9x: under the gain
    assert choose_plan(flat, [50.0] + [7.0] * 7) == (PACKED, True)  # a slow packed single row is never used


def test_a_model_off_the_cpu_or_in_another_dtype_is_left_alone() -> None:
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16))
    assert adapt_float32_linears(model) == (0, 0)
    assert type(model[0]) is nn.Linear


def test_a_packed_kernel_that_computes_something_else_is_never_taken() -> None:
    """The agreement check at load: a kernel off by more than rounding is refused, whatever its speed."""
    linear = nn.Linear(64, 32)
    packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def on_packed(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, linear.bias, "none", [], "")

    assert agrees_with_f_linear(on_packed, linear)
    assert not agrees_with_f_linear(lambda x: on_packed(x) * 1.001, linear)
    assert not agrees_with_f_linear(lambda x: on_packed(x.flip(0)), linear)  # rows mixed up
