"""MD's half of the handoff (services/main/takeover.py): what MD adopts, feeds and reports."""
from __future__ import annotations

import pytest

from services.main.takeover import Move, Pass, Takeover
from shared.errors import ProtocolError
from shared.messages import Handoff

LAST_PROMPT_ID = 7


def handoff(eager_ids: list[int], start: int = 0, final: bool = True, mode: str = "one-shot") -> Handoff:
    return Handoff("r1", eager_ids, finished=False, start=start, final=final, mode=mode)


def test_one_shot_feeds_the_last_prompt_token_and_every_eager_token_at_the_cut() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    cut = takeover.adopt(handoff([10, 11, 12]))
    assert (cut.move, cut.new_ids, cut.feed_ids) == (Move.CUT, [10, 11, 12], [LAST_PROMPT_ID, 10, 11, 12])
    stats = takeover.stats("r1", kv_wait_s=0.5, handoff_s=0.25)
    assert (stats.eager_tokens, stats.mode, stats.chunks, stats.kv_wait_s, stats.handoff_s) == (
        3, "one-shot", 1, 0.5, 0.25)


def test_catch_up_passes_feed_every_adopted_token_and_the_cut_feeds_only_what_came_since() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    first = takeover.adopt(handoff([10, 11, 12], final=False, mode="catch-up"))
    assert (first.move, first.new_ids, first.feed_ids) == (Move.EXTEND, [10, 11, 12], [])
    assert takeover.adopted == 3
    assert takeover.take_unfed() == [LAST_PROMPT_ID, 10, 11, 12], "a pass recomputes the newest token too"
    assert takeover.take_unfed() == []
    takeover.adopt(handoff([13, 14], start=3, final=False, mode="catch-up"))
    assert takeover.take_unfed() == [13, 14]
    cut = takeover.adopt(handoff([15], start=5, mode="catch-up"))
    assert (cut.move, cut.new_ids, cut.feed_ids, cut.unfeed) == (Move.CUT, [15], [15], 0)
    stats = takeover.stats("r1", 0.0, 0.0)
    assert (stats.eager_tokens, stats.mode, stats.chunks) == (6, "catch-up", 3)


def test_a_cut_with_nothing_new_after_a_pass_feeds_the_newest_token_again_after_dropping_its_kv() -> None:
    """Every adopted token is in MD's KV: the cut's pass needs logits after the newest, so it drops
    that token's KV and feeds it again (one token, as a decode step)."""
    takeover = Takeover(LAST_PROMPT_ID)
    takeover.adopt(handoff([10, 11], final=False, mode="catch-up"))
    takeover.take_unfed()
    cut = takeover.adopt(handoff([], start=2, mode="catch-up"))
    assert (cut.move, cut.new_ids, cut.feed_ids, cut.unfeed) == (Move.CUT, [], [11], 1)


def test_a_cut_before_any_pass_with_nothing_adopted_feeds_the_last_prompt_token() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    cut = takeover.adopt(handoff([]))
    assert (cut.feed_ids, cut.unfeed) == ([LAST_PROMPT_ID], 0)


def test_every_eager_token_is_fed_exactly_once_in_order() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    takeover.adopt(handoff([1, 2], final=False))
    fed = takeover.take_unfed()
    takeover.adopt(handoff([3], start=2, final=False))  # collected: no pass before the cut
    fed += takeover.adopt(handoff([4, 5], start=3)).feed_ids
    assert fed == [LAST_PROMPT_ID, 1, 2, 3, 4, 5]


def test_a_recovery_handoff_repeating_adopted_tokens_adopts_only_the_new_ones() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    takeover.adopt(handoff([10, 11, 12], final=False, mode="catch-up"))
    takeover.take_unfed()
    recovery = takeover.adopt(handoff([10, 11, 12, 13, 14], start=0, mode="recovery"))
    assert (recovery.move, recovery.new_ids, recovery.feed_ids, recovery.unfeed) == (Move.CUT, [13, 14], [13, 14], 0)
    assert takeover.adopted == 5 and takeover.mode == "recovery"


def test_a_recovery_handoff_with_nothing_new_still_cuts_on_the_newest_token() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    takeover.adopt(handoff([10, 11], final=False, mode="catch-up"))
    takeover.take_unfed()
    recovery = takeover.adopt(handoff([10], mode="recovery"))
    assert (recovery.move, recovery.new_ids, recovery.feed_ids, recovery.unfeed) == (Move.CUT, [], [11], 1)
    assert takeover.adopted == 2


def test_a_handoff_that_leaves_a_gap_is_a_protocol_error() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    takeover.adopt(handoff([10, 11], final=False, mode="catch-up"))
    with pytest.raises(ProtocolError, match="starts at 3, MD holds 2"):
        takeover.adopt(handoff([13], start=3))


def test_relay_finishing_first_ends_the_takeover_with_nothing_to_feed() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    takeover.adopt(handoff([10], final=False, mode="catch-up"))
    done = takeover.adopt(Handoff("r1", [], finished=True, mode="catch-up"))
    assert (done.move, done.new_ids, done.feed_ids, done.unfeed) == (Move.RELAY_FINISHED, [], [], 0)
    assert takeover.adopted == 1


def test_no_handoff_is_adopted_after_the_cut() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    takeover.adopt(handoff([10]))
    with pytest.raises(ProtocolError, match="after its takeover ended"):
        takeover.adopt(handoff([10, 11]))


def test_catch_up_reports_holding_once_recomputes_on_then_collects_once_the_cut_is_announced() -> None:
    """RLD streamed 4 tokens while MD's KV crossed: MD recomputes them and reports once (RLD cuts at
    that report); a token streamed before the cut is announced is recomputed without a report, so the
    cut's pass stays short; once announced, tokens wait for the cut's pass, which feeds them in order."""
    takeover = Takeover(LAST_PROMPT_ID)
    fed: list[int] = []
    takeover.adopt(handoff([10, 11, 12, 13], final=False, mode="catch-up"))
    assert takeover.catch_up_pass(cut_announced=False) is Pass.REPORT
    fed += takeover.take_unfed()
    takeover.reported()
    assert takeover.reported_holding
    takeover.adopt(handoff([14], start=4, final=False, mode="catch-up"))
    assert takeover.catch_up_pass(cut_announced=False) is Pass.RECOMPUTE, "no second report"
    fed += takeover.take_unfed()
    takeover.adopt(handoff([15], start=5, final=False, mode="catch-up"))
    assert takeover.catch_up_pass(cut_announced=True) is Pass.COLLECT
    cut = takeover.adopt(handoff([16], start=6, mode="catch-up"))
    assert cut.feed_ids == [15, 16], "the cut's pass: the collected token, then the cut's"
    fed += cut.feed_ids
    assert fed == [LAST_PROMPT_ID, 10, 11, 12, 13, 14, 15, 16], "every token fed once, in order"


def test_a_report_of_holding_nothing_leaves_the_next_chunk_to_be_reported() -> None:
    """MD's KV is in before RLD sent anything: KVReady(0); the chunk RLD answers with is recomputed and
    reported (RLD cuts at that report, or at a pinned count), whatever was announced."""
    takeover = Takeover(LAST_PROMPT_ID)
    takeover.reported()
    assert not takeover.reported_holding
    takeover.adopt(handoff([10, 11, 12], final=False, mode="catch-up"))
    assert takeover.catch_up_pass(cut_announced=True) is Pass.REPORT
