"""The sampling options (penalties, logit_bias, min_p) as vLLM defines them, and the request history
they read, which every tier (RLD, MD after a handoff, a migrated attempt) sees alike."""
from __future__ import annotations

import orjson
import pytest
import torch

from shared.errors import BadRequest
from shared.model_runner import DecodeSequence
from shared.sampling import apply_options, sample_rows
from shared.sampling_params import SamplingParams, SamplingRow


def test_penalties_follow_vllms_definitions() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0, -1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = SamplingRow(params, 3, prompt_ids=[0, 1], output_ids=[2, 2, 3])
    adjusted = apply_options(logits, [row])[0].tolist()
    # prompt tokens: repetition only (a positive logit divided, a negative one multiplied)
    assert adjusted[:2] == [1.0, -4.0]
    # output tokens: repetition, then frequency per occurrence and presence once
    assert adjusted[2] == pytest.approx(1.0 / 2 - 0.5 * 2 - 0.25)
    assert adjusted[3] == pytest.approx(0.5 / 2 - 0.5 * 1 - 0.25)
    assert adjusted[4:] == [3.0, -1.0]  # tokens never seen are untouched
    assert logits[0, 0] == 2.0  # the model's logits are not changed in place


def test_presence_and_frequency_penalties_read_only_the_output() -> None:
    logits = torch.tensor([[1.0, 0.0, 0.0]])
    params = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)
    row = SamplingRow(params, 0, prompt_ids=[0, 0, 0], output_ids=[])
    assert apply_options(logits, [row])[0].tolist() == [1.0, 0.0, 0.0]


def test_a_penalty_turns_greedy_away_from_a_repeated_token() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    plain = SamplingRow(SamplingParams(), 2, output_ids=[0, 0])
    penalized = SamplingRow(SamplingParams(frequency_penalty=1.0), 2, output_ids=[0, 0])
    assert [s.token_id for s in sample_rows(logits.repeat(2, 1), [plain, penalized])] == [0, 1]


def test_logit_bias_is_added_to_the_logits_and_can_ban_or_force_a_token() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    biased = SamplingParams(logit_bias={0: -100.0, 3: 1.5})
    assert apply_options(logits, [SamplingRow(biased, 0)])[0].tolist() == [-97.0, 2.0, 1.0, 1.5]
    assert sample_rows(logits, [SamplingRow(biased, 0)])[0].token_id == 1
    forced = SamplingParams(temperature=1.0, seed=5, logit_bias={2: 100.0})
    assert {sample_rows(logits, [SamplingRow(forced, i)])[0].token_id for i in range(30)} == {2}


def test_min_p_keeps_tokens_at_least_min_p_times_as_likely_as_the_likeliest() -> None:
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    logits = probs.log().unsqueeze(0)
    params = SamplingParams(temperature=1.0, min_p=0.25, seed=3)  # threshold 0.125: keeps tokens 0 and 1
    drawn = {sample_rows(logits, [SamplingRow(params, i)])[0].token_id for i in range(200)}
    assert drawn == {0, 1}
    unfiltered = SamplingParams(temperature=1.0, seed=3)
    assert {sample_rows(logits, [SamplingRow(unfiltered, i)])[0].token_id for i in range(200)} == {0, 1, 2, 3}


def test_min_p_is_relative_to_the_distribution_after_temperature() -> None:
    logits = torch.tensor([[2.0, 0.0]])  # p1/p0 = e^-2 = 0.135 at temperature 1, e^-1 = 0.37 at 2
    for temperature, expected in ((1.0, {0}), (2.0, {0, 1})):
        params = SamplingParams(temperature=temperature, min_p=0.2, seed=1)
        assert {sample_rows(logits, [SamplingRow(params, i)])[0].token_id for i in range(100)} == expected


def test_a_row_without_options_costs_nothing_extra() -> None:
    logits = torch.randn(3, 50)
    rows = [SamplingRow(SamplingParams(), 0), SamplingRow(SamplingParams(temperature=0.7, seed=1), 4)]
    assert apply_options(logits, rows) is logits  # no copy, no float32 conversion


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_rows_token_does_not_depend_on_what_shares_its_step(temperature: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    rows = [SamplingRow(SamplingParams(temperature=temperature, seed=9, presence_penalty=1.5, repetition_penalty=1.3,
                                       logit_bias={7: 4.0}), 6, [1, 2, 3], [int(logits[0].argmax()), 7, 7]),
            SamplingRow(SamplingParams(), 0),
            SamplingRow(SamplingParams(temperature=1.0, seed=2, min_p=0.05), 3),
            SamplingRow(SamplingParams(frequency_penalty=-1.0), 2, (), [5, 5])]
    together = sample_rows(logits, rows)
    assert together == [sample_rows(logits[i:i + 1], [row])[0] for i, row in enumerate(rows)]


def test_sampling_options_round_trip_as_json() -> None:
    params = SamplingParams(max_tokens=9, temperature=0.7, presence_penalty=-0.5, frequency_penalty=1.25,
                            repetition_penalty=1.1, logit_bias={50256: -100.0, 3: 2.5}, min_p=0.05, logprobs=5,
                            seed=4, eos_token_ids=(2,))
    wire = orjson.loads(orjson.dumps(params.to_dict()))
    assert wire["logit_bias"] == {"50256": -100.0, "3": 2.5}  # JSON keys are strings
    back = SamplingParams.from_dict(wire)
    assert back == params and list(back.logit_bias) == [50256, 3]
    old = {k: v for k, v in wire.items() if k not in ("presence_penalty", "logit_bias", "logprobs", "min_p")}
    assert SamplingParams.from_dict(old).logprobs is None  # a message from before the options still decodes


@pytest.mark.parametrize("kwargs", [{"presence_penalty": 2.5}, {"frequency_penalty": -2.1},
                                    {"repetition_penalty": 0.0}, {"repetition_penalty": float("inf")},
                                    {"logit_bias": {1: 101.0}}, {"logit_bias": {-1: 1.0}}, {"min_p": 1.5},
                                    {"logprobs": 21}, {"logprobs": -1}])
def test_options_out_of_range_are_refused(kwargs: dict) -> None:
    with pytest.raises(BadRequest):
        SamplingParams(**kwargs)


# --- the history the penalties read, on every tier ----------------------------------------------

PROMPT = [11, 12, 13, 14]
OUTPUT = [21, 22, 23, 24, 25, 26]
PENALIZED = SamplingParams(max_tokens=20, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)


def test_a_migrated_prompt_ends_with_output_tokens_not_prompt() -> None:
    migrated = DecodeSequence("r", PROMPT + OUTPUT[:4], PENALIZED, 100, output_ids=OUTPUT[4:], first_index=4)
    assert migrated.request_prompt_ids == PROMPT
    assert migrated.request_output_ids == OUTPUT
    fresh = DecodeSequence("r", list(PROMPT), PENALIZED, 100, output_ids=list(OUTPUT))
    assert fresh.request_prompt_ids == PROMPT and fresh.request_output_ids == OUTPUT


def test_every_tier_hands_the_sampler_the_same_row() -> None:
    one_tier = DecodeSequence("r", list(PROMPT), PENALIZED, 100, output_ids=list(OUTPUT))
    # MD after a handoff: RLD's eager tokens adopted into output_ids
    after_handoff = DecodeSequence("r", list(PROMPT), PENALIZED, 100, output_ids=OUTPUT[:3])
    after_handoff.output_ids.extend(OUTPUT[3:])
    # a migration after 2 tokens: they end the new attempt's prompt
    migrated = DecodeSequence("r", PROMPT + OUTPUT[:2], PENALIZED, 100, output_ids=OUTPUT[2:], first_index=2)
    rows = [seq.sampling_row() for seq in (one_tier, after_handoff, migrated)]
    assert all((row.token_index, list(row.prompt_ids), list(row.output_ids)) == (6, PROMPT, OUTPUT) for row in rows)
    logits = torch.randn(1, 40)
    assert len({sample_rows(logits, [row])[0].token_id for row in rows}) == 1


def test_a_request_without_penalties_gives_the_sampler_no_history() -> None:
    row = DecodeSequence("r", list(PROMPT), SamplingParams(logit_bias={1: 1.0}), 100, output_ids=list(OUTPUT),
                         ).sampling_row()
    assert row.token_index == 6 and row.prompt_ids == () and row.output_ids == ()
    no_repetition = DecodeSequence("r", list(PROMPT), SamplingParams(presence_penalty=1.0), 100,
                                   output_ids=list(OUTPUT)).sampling_row()
    assert no_repetition.prompt_ids == () and list(no_repetition.output_ids) == OUTPUT
