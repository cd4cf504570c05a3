"""The engine's scheduler without a model: decode rows before longer work, one row per request, long
work cut to the token budget (and, with an attention cost, to what a long context costs), in queue
or admission order with background work last; feed-only work joined by the request's next work;
work that unfeeds more than its request holds fails without taking budget; a step held for announced
work until it comes, its grace ends or the hold's reach, and never for work due past that."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from shared.config import EngineConfig
from shared.scheduler import Scheduler, Scoring, StepHolds, Work


@dataclass
class Held:
    """An admitted request as the scheduler sees it."""

    kv_length: int = 0
    background: bool = False


def work(key: str, tokens: int, sample: bool = False, return_kv: bool = False, **options: object) -> Work:
    return Work(key, list(range(100, 100 + tokens)), sample, return_kv, asyncio.get_running_loop().create_future(),
                **options)  # type: ignore[arg-type]


def rows_of(schedule) -> list[tuple[str, int]]:
    return [(w.key, take) for w, take in schedule.rows]


async def test_decode_rows_go_first_and_long_work_is_cut_to_the_token_budget() -> None:
    scheduler = Scheduler(EngineConfig(max_batch_tokens=10))
    queue = [work("prompt", 20), work("a", 1, sample=True), work("b", 1, sample=True)]
    schedule = scheduler.schedule(queue, {"prompt": Held(), "a": Held(5), "b": Held(7)})
    assert rows_of(schedule) == [("a", 1), ("b", 1), ("prompt", 8)]
    assert schedule.failed == []


async def test_decode_rows_past_the_budget_wait_for_the_next_step() -> None:
    scheduler = Scheduler(EngineConfig(max_batch_tokens=2))
    queue = [work(key, 1, sample=True) for key in "abc"] + [work("prompt", 4)]
    schedule = scheduler.schedule(queue, {key: Held() for key in ("a", "b", "c", "prompt")})
    assert rows_of(schedule) == [("a", 1), ("b", 1)]


async def test_one_row_per_request_its_oldest_work() -> None:
    scheduler = Scheduler(EngineConfig(max_batch_tokens=64))
    first, second = work("a", 3, sample=True), work("a", 1, sample=True)
    schedule = scheduler.schedule([first, second, work("b", 2)], {"a": Held(), "b": Held()})
    assert [(w, take) for w, take in schedule.rows if w.key == "a"] == [(first, 3)]
    assert rows_of(schedule) == [("a", 3), ("b", 2)]


async def test_long_work_in_queue_order_unless_by_admission_and_background_last() -> None:
    admitted = {"warm": Held(background=True), "old": Held(), "new": Held()}  # in admission order
    queue = [work("warm", 6), work("new", 6), work("old", 6)]
    by_queue = Scheduler(EngineConfig(max_batch_tokens=9)).schedule(queue, admitted)
    assert rows_of(by_queue) == [("new", 6), ("old", 3)]
    by_admission = Scheduler(EngineConfig(max_batch_tokens=9, long_work_by_admission=True)).schedule(queue, admitted)
    assert rows_of(by_admission) == [("old", 6), ("new", 3)]
    everyone = Scheduler(EngineConfig(max_batch_tokens=64, long_work_by_admission=True)).schedule(queue, admitted)
    assert rows_of(everyone) == [("old", 6), ("new", 6), ("warm", 6)]


async def test_a_later_prompt_over_a_long_context_gets_what_its_attention_cost_fits() -> None:
    scheduler = Scheduler(EngineConfig(max_batch_tokens=512, attention_cost_tokens=1024))
    admitted = {"first": Held(0), "deep": Held(1024), "shallow": Held(0)}
    schedule = scheduler.schedule([work("first", 256), work("deep", 256), work("shallow", 256)], admitted)
    (first, first_take), (deep, deep_take), *rest = schedule.rows
    assert (first.key, first_take) == ("first", 256), "the first long row is cut by tokens alone"
    left = 512 - scheduler.cost(256, 0, 256)
    assert left == 512 - 256 * 1.125
    assert 0 < deep_take < 256 and deep.key == "deep"
    assert scheduler.cost(256, 1024, deep_take) <= left < scheduler.cost(256, 1024, deep_take + 1)
    assert rest == [] or scheduler.cost(256, 1024, deep_take) + scheduler.cost(256, 0, rest[0][1]) <= left


async def test_a_later_row_that_fits_nothing_is_skipped_not_the_rest() -> None:
    scheduler = Scheduler(EngineConfig(max_batch_tokens=300, attention_cost_tokens=1024))
    admitted = {"first": Held(0), "deep": Held(100_000), "shallow": Held(0)}
    schedule = scheduler.schedule([work("first", 200), work("deep", 50), work("shallow", 50)], admitted)
    assert [key for key, _ in rows_of(schedule)] == ["first", "shallow"]
    assert scheduler.fitting(50, 100_000, 300 - scheduler.cost(200, 0, 200)) == 0


async def test_without_an_attention_cost_a_long_context_costs_a_token_each() -> None:
    scheduler = Scheduler(EngineConfig(max_batch_tokens=100))
    schedule = scheduler.schedule([work("a", 60), work("b", 60)], {"a": Held(50_000), "b": Held(50_000)})
    assert rows_of(schedule) == [("a", 60), ("b", 40)]
    assert scheduler.cost(60, 50_000, 60) == 60.0


async def test_work_that_unfeeds_more_than_its_request_holds_fails_and_takes_no_budget() -> None:
    scheduler = Scheduler(EngineConfig(max_batch_tokens=4))
    bad, good = work("bad", 3, unfeed=5), work("good", 4, unfeed=2)
    schedule = scheduler.schedule([bad, good], {"bad": Held(3), "good": Held(10)})
    assert rows_of(schedule) == [("good", 4)]
    [(failed, error)] = schedule.failed
    assert failed is bad and isinstance(error, ValueError) and "cannot unfeed 5" in str(error)
    assert good.unfeed == 2, "the scheduler decides; the engine drops the positions"


async def test_the_cost_of_a_row_that_unfeeds_counts_the_context_it_will_have() -> None:
    scheduler = Scheduler(EngineConfig(max_batch_tokens=100, attention_cost_tokens=10))
    schedule = scheduler.schedule([work("first", 10), work("cut", 50, unfeed=40)], {"first": Held(0), "cut": Held(40)})
    first_cost = scheduler.cost(10, 0, 10)
    assert rows_of(schedule) == [("first", 10), ("cut", scheduler.fitting(50, 0, 100 - first_cost))]
    assert scheduler.fitting(50, 0, 100 - first_cost) > scheduler.fitting(50, 40, 100 - first_cost)


async def test_feed_only_work_is_joined_by_the_requests_next_work() -> None:
    catch_up, cut = work("md", 3), work("md", 2, sample=True)
    other = work("rld", 1, sample=True)
    kept, joined = Scheduler.coalesce([catch_up, other, cut])
    assert kept == [other, cut] and joined == [(cut, catch_up)]
    assert cut.feed_ids == [100, 101, 102, 100, 101]


async def test_a_joining_work_that_unfeeds_drops_the_tokens_not_yet_fed() -> None:
    catch_up, cut = work("md", 4, fed=1), work("md", 1, sample=True, unfeed=2)
    kept, joined = Scheduler.coalesce([catch_up, cut])
    assert kept == [cut] and joined == [(cut, catch_up)]
    assert cut.feed_ids == [101, 100] and cut.unfeed == 0


@pytest.mark.parametrize("first, then", [
    ({"sample": True}, {}),  # its token is wanted
    ({"return_kv": True}, {}),  # its KV is wanted
    ({"score": Scoring([1, 2, 3], 1)}, {}),
    ({"unfeed": 1}, {}),
    ({}, {"return_kv": True}),
    ({}, {"fed": 1}),  # already running
    ({}, {"unfeed": 4}),  # drops more than the first has left
])
async def test_work_is_not_joined_when_either_side_must_stay_apart(first, then) -> None:
    a, b = work("md", 3, **first), work("md", 2, **then)
    kept, joined = Scheduler.coalesce([a, b])
    assert kept == [a, b] and joined == []
    assert a.feed_ids == [100, 101, 102]


def holds_after_a_step_of(step_s: float, **config: float) -> StepHolds:
    holds = StepHolds(EngineConfig(hold_steps=0.5, gather_s=0.005, **config))  # type: ignore[arg-type]
    holds.stepped(step_s)
    return holds


def test_no_hold_before_a_step_was_timed_or_without_an_announcement() -> None:
    untimed = StepHolds(EngineConfig(hold_steps=0.5))
    untimed.announce("md", 10.01)
    assert untimed.until(10.0, None, set(), {"md"}) is None
    assert holds_after_a_step_of(0.1).until(10.0, None, set(), {"md"}) is None


def test_a_hold_lasts_to_the_work_s_due_time_and_grace_within_half_a_step() -> None:
    holds = holds_after_a_step_of(0.1)  # a reach of 50 ms; a grace of a quarter step, 25 ms
    holds.announce("md", 10.01)
    assert holds.until(10.0, None, set(), {"md"}) == pytest.approx(10.035)
    holds.announce("md", 10.04)
    assert holds.until(10.0, 10.0, set(), {"md"}) == pytest.approx(10.05), "never past the reach"
    assert holds.until(10.02, 10.0, {"md"}, {"md"}) is None and holds.due == {}, "the work came"
    assert holds.ended({"md"}, {"md"}) and (holds.holds, holds.holds_met) == (1, 1)
    assert holds.announced == 2 and holds.announced_late == 0


def test_work_due_past_the_reach_is_not_held_for_and_counts_late_once_its_grace_is_over() -> None:
    holds = holds_after_a_step_of(0.1, hold_grace_s=0.01)
    holds.announce("md", 10.2)
    assert holds.until(10.0, None, set(), {"md"}) is None and holds.announced_late == 0
    assert holds.until(10.25, None, set(), {"md"}) is None
    assert holds.announced_late == 1 and holds.due == {}


def test_a_hold_for_a_request_gone_ends() -> None:
    holds = holds_after_a_step_of(0.1)
    holds.announce("md", 10.01)
    assert holds.until(10.0, None, set(), set()) is None and holds.due == {}
    assert not holds.ended({"md"}, set()) and (holds.holds, holds.holds_met) == (1, 0)
