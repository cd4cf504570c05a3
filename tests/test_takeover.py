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


def test_catch_up_extends_each_chunk_but_its_newest_token_and_cuts_with_the_rest() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    first = takeover.adopt(handoff([10, 11, 12], final=False, mode="catch-up"))
    assert (first.move, first.new_ids, first.feed_ids) == (Move.EXTEND, [10, 11, 12], [LAST_PROMPT_ID, 10, 11])
    assert takeover.adopted == 3
    second = takeover.adopt(handoff([13, 14], start=3, final=False, mode="catch-up"))
    assert (second.move, second.feed_ids) == (Move.EXTEND, [12, 13])
    cut = takeover.adopt(handoff([15], start=5, mode="catch-up"))
    assert (cut.move, cut.new_ids, cut.feed_ids) == (Move.CUT, [15], [14, 15])
    stats = takeover.stats("r1", 0.0, 0.0)
    assert (stats.eager_tokens, stats.mode, stats.chunks) == (6, "catch-up", 3)


def test_every_eager_token_is_fed_exactly_once_in_order() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    fed = takeover.adopt(handoff([1, 2], final=False)).feed_ids
    fed += takeover.adopt(handoff([3], start=2, final=False)).feed_ids
    fed += takeover.adopt(handoff([4, 5], start=3)).feed_ids
    assert fed == [LAST_PROMPT_ID, 1, 2, 3, 4, 5]


def test_a_recovery_handoff_repeating_adopted_tokens_adopts_only_the_new_ones() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    takeover.adopt(handoff([10, 11, 12], final=False, mode="catch-up"))
    recovery = takeover.adopt(handoff([10, 11, 12, 13, 14], start=0, mode="recovery"))
    assert (recovery.move, recovery.new_ids, recovery.feed_ids) == (Move.CUT, [13, 14], [12, 13, 14])
    assert takeover.adopted == 5 and takeover.mode == "recovery"


def test_a_recovery_handoff_with_nothing_new_still_cuts_on_the_newest_token() -> None:
    takeover = Takeover(LAST_PROMPT_ID)
    takeover.adopt(handoff([10, 11], final=False, mode="catch-up"))
    recovery = takeover.adopt(handoff([10], mode="recovery"))
    assert (recovery.move, recovery.new_ids, recovery.feed_ids) == (Move.CUT, [], [11])
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
    assert (done.move, done.new_ids, done.feed_ids) == (Move.RELAY_FINISHED, [], [])
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
    early = takeover.adopt(handoff([10, 11, 12, 13], final=False, mode="catch-up"))
    assert takeover.catch_up_pass(cut_announced=False) is Pass.REPORT
    fed += early.feed_ids
    takeover.reported()
    assert takeover.reported_holding
    more = takeover.adopt(handoff([14], start=4, final=False, mode="catch-up"))
    assert takeover.catch_up_pass(cut_announced=False) is Pass.RECOMPUTE, "no second report"
    fed += more.feed_ids
    collected = takeover.adopt(handoff([15], start=5, final=False, mode="catch-up"))
    assert takeover.catch_up_pass(cut_announced=True) is Pass.COLLECT
    cut = takeover.adopt(handoff([16], start=6, mode="catch-up"))
    fed += collected.feed_ids + cut.feed_ids  # the cut's pass: the collected tokens, then the cut's
    assert fed == [LAST_PROMPT_ID, 10, 11, 12, 13, 14, 15, 16], "every token fed once, in order"


def test_a_report_of_holding_nothing_leaves_the_next_chunk_to_be_reported() -> None:
    """MD's KV is in before RLD sent anything: KVReady(0); the chunk RLD answers with is recomputed and
    reported (RLD cuts at that report, or at a pinned count), whatever was announced."""
    takeover = Takeover(LAST_PROMPT_ID)
    takeover.reported()
    assert not takeover.reported_holding
    takeover.adopt(handoff([10, 11, 12], final=False, mode="catch-up"))
    assert takeover.catch_up_pass(cut_announced=True) is Pass.REPORT
