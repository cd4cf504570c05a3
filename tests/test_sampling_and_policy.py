"""Sampling that is reproducible by (seed, token index), and RLD's handoff decision."""
from __future__ import annotations

import pytest
import torch

from shared.errors import BadRequest
from shared.sampling import SamplingParams, sample_token
from services.relay.handoff import RelayAction, next_action


def test_sampled_token_depends_only_on_seed_and_index() -> None:
    logits = torch.randn(1000)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7)
    first = [sample_token(logits, params, i) for i in range(20)]
    assert first == [sample_token(logits, params, i) for i in range(20)]
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=8)
    assert first != [sample_token(logits, other_seed, i) for i in range(20)]


def test_top_k_one_and_greedy_agree() -> None:
    logits = torch.randn(500)
    assert sample_token(logits, SamplingParams(temperature=1.0, top_k=1, seed=3), 0) == int(logits.argmax())
    assert sample_token(logits, SamplingParams(), 0) == int(logits.argmax())


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.tensor([10.0, 9.9, -5.0, -5.0, -5.0])
    params = SamplingParams(temperature=1.0, top_p=0.5, seed=1)
    assert {sample_token(logits, params, i) for i in range(50)} <= {0, 1}


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}])
def test_bad_sampling_parameters_are_refused(kwargs: dict) -> None:
    with pytest.raises(BadRequest):
        SamplingParams(**kwargs)


def test_relay_hands_off_as_soon_as_main_is_ready() -> None:
    assert next_action(0, False, None) is RelayAction.DECODE
    assert next_action(5, True, None) is RelayAction.HAND_OFF


def test_relay_handoff_point_can_be_pinned() -> None:
    assert next_action(3, True, 10) is RelayAction.DECODE
    assert next_action(10, False, 10) is RelayAction.WAIT_FOR_MAIN
    assert next_action(10, True, 10) is RelayAction.HAND_OFF
    assert next_action(0, False, 0) is RelayAction.WAIT_FOR_MAIN
