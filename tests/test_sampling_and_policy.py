"""Sampling that is reproducible by (seed, token index), and RLD's handoff decision."""
from __future__ import annotations

import pytest
import torch

from services.relay.handoff import HandoffMode, HandoffPlan, Step, choose_mode
from shared.errors import BadRequest
from shared.sampling import sample_token, sample_tokens
from shared.sampling_params import SamplingParams


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


def test_the_clients_stop_tokens_end_the_answer_even_when_eos_is_ignored() -> None:
    params = SamplingParams(eos_token_ids=(2,), stop_token_ids=(7,))
    assert params.is_stop(2) and params.is_stop(7) and not params.is_stop(3)
    ignoring = SamplingParams(eos_token_ids=(2,), stop_token_ids=(7,), ignore_eos=True)
    assert not ignoring.is_stop(2) and ignoring.is_stop(7)
    assert SamplingParams.from_dict(params.to_dict()) == params


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_keeps_ending_tokens_out_of_early_positions_whatever_the_batch(temperature: float) -> None:
    logits = torch.full((3, 10), -5.0)
    logits[:, 2] = 30.0  # EOS is by far the likeliest token
    logits[:, 7] = 9.0  # then the client's stop token
    params = SamplingParams(temperature=temperature, seed=1, eos_token_ids=(2,), stop_token_ids=(7,), min_tokens=4)
    other = SamplingParams(temperature=temperature, seed=1)  # no min_tokens, in the same batch
    # rows at positions 3 (held back), 4 (free) and, for another request, 3 (free)
    tokens = sample_tokens(logits, [params, params, other], [3, 4, 3])
    assert tokens[0] not in (2, 7) and tokens[1] == 2 and tokens[2] == 2
    # a row's token depends on its params and position only, not on what shares the step
    assert sample_tokens(logits[:1], [params], [3]) == tokens[:1]
    ignoring = SamplingParams(temperature=temperature, seed=1, eos_token_ids=(2,), stop_token_ids=(7,),
                              min_tokens=4, ignore_eos=True)
    assert sample_tokens(logits[:1], [ignoring], [3]) == [2]  # EOS ends nothing then: not held back


@pytest.mark.parametrize("kwargs", [{"max_tokens": -1}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2},
                                    {"min_tokens": -1}])
def test_bad_sampling_parameters_are_refused(kwargs: dict) -> None:
    with pytest.raises(BadRequest):
        SamplingParams(**kwargs)


def test_one_shot_cuts_at_mains_first_report() -> None:
    plan = HandoffPlan(HandoffMode.ONE_SHOT, threshold=64, handoff_at=None)
    assert plan.next(5).step is Step.DECODE
    plan.on_main_progress()
    decision = plan.next(7)
    assert (decision.step, decision.start, decision.end) == (Step.CUT, 0, 7)


def test_catch_up_sends_a_first_chunk_then_streams_each_token_until_main_holds_it() -> None:
    """MD reports before RLD streamed anything (RLD streams from its first token otherwise): the
    eager tokens so far go as one chunk, then each new one, until MD holds that chunk."""
    plan = HandoffPlan(HandoffMode.CATCH_UP, threshold=10, handoff_at=None)
    plan.on_main_progress(0)
    first = plan.next(100)
    assert (first.step, first.start, first.end) == (Step.SEND_CHUNK, 0, 100)
    assert plan.next(100).step is Step.DECODE, "nothing new to send: decode on"
    streamed = plan.next(101)
    assert (streamed.step, streamed.start, streamed.end) == (Step.SEND_CHUNK, 100, 101)
    plan.on_main_progress(99)  # a report from before the first chunk was all in: stream on
    assert plan.next(102).step is Step.SEND_CHUNK
    plan.on_main_progress(100)
    cut = plan.next(103)
    assert (cut.step, cut.start, cut.end) == (Step.CUT, 102, 103), "MD is a step behind: only the last token is left"
    assert plan.rounds == 4


def test_catch_up_with_too_few_tokens_to_stream_cuts_at_once() -> None:
    plan = HandoffPlan(HandoffMode.CATCH_UP, threshold=10, handoff_at=None)
    plan.on_main_progress(0)
    cut = plan.next(9)
    assert (cut.step, cut.start, cut.end) == (Step.CUT, 0, 9) and not plan.streaming


def test_a_stale_report_does_not_cut_while_main_still_recomputes_the_first_chunk() -> None:
    plan = HandoffPlan(HandoffMode.CATCH_UP, threshold=10, handoff_at=None)
    plan.on_main_progress(0)
    plan.next(50)
    for eager in range(51, 60):  # MD is slow: RLD streams on, one token a step
        plan.on_main_progress(0)
        decision = plan.next(eager)
        assert (decision.step, decision.start, decision.end) == (Step.SEND_CHUNK, eager - 1, eager)
    plan.on_main_progress(57)  # MD adopted the first chunk and some streamed tokens together
    assert plan.next(60).step is Step.CUT


def test_the_cut_can_be_pinned() -> None:
    plan = HandoffPlan(HandoffMode.ONE_SHOT, threshold=64, handoff_at=10)
    plan.on_main_progress()
    assert plan.next(3).step is Step.DECODE
    assert plan.next(10).step is Step.CUT
    waiting = HandoffPlan(HandoffMode.CATCH_UP, threshold=64, handoff_at=0)
    assert waiting.next(0).step is Step.WAIT_FOR_MAIN
    waiting.on_main_progress()
    cut = waiting.next(0)
    assert (cut.step, cut.start, cut.end) == (Step.CUT, 0, 0)


def test_the_cut_is_known_while_rld_still_makes_its_last_token() -> None:
    """RLD announces the cut to MD from would_cut while the step that ends it runs, from the report
    that just came in; it must agree with what next() then decides, and change nothing."""
    plan = HandoffPlan(HandoffMode.CATCH_UP, threshold=10, handoff_at=None)
    assert plan.would_cut(5), "before any chunk, fewer than the threshold left: the first report cuts"
    plan.on_main_progress(0)
    assert plan.next(100).step is Step.SEND_CHUNK
    assert not plan.would_cut(101), "MD has not reported the first chunk"
    assert not plan.would_cut(101, adopted_tokens=60)
    assert plan.would_cut(101, adopted_tokens=100), "this report means the step in flight ends it"
    assert plan.next(101).step is Step.SEND_CHUNK, "would_cut only looked"
    plan.on_main_progress(100)
    assert plan.next(102).step is Step.CUT
    pinned = HandoffPlan(HandoffMode.ONE_SHOT, threshold=64, handoff_at=10)
    assert not pinned.would_cut(9) and pinned.would_cut(10)
    one_shot = HandoffPlan(HandoffMode.ONE_SHOT, threshold=64, handoff_at=None)
    assert one_shot.would_cut(300)
    lost = HandoffPlan(HandoffMode.ONE_SHOT, threshold=64, handoff_at=None)
    lost.on_main_lost()
    assert not lost.would_cut(3)


def test_auto_mode_follows_relay_load() -> None:
    assert choose_mode("auto", running_requests=2, catch_up_max_running=4) is HandoffMode.CATCH_UP
    assert choose_mode("auto", running_requests=9, catch_up_max_running=4) is HandoffMode.ONE_SHOT
    assert choose_mode("one-shot", running_requests=0, catch_up_max_running=4) is HandoffMode.ONE_SHOT
