"""The batch engine's scheduler: which queued work runs in the next step, and how many tokens of each
(`Scheduler`); and how long the next step waits for work announced to arrive (`StepHolds`).

Pure decisions over the queue, what each admitted request holds and the clock it is given: it
allocates nothing, runs nothing and settles no future (the engine, shared/batch_engine.py, does).
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Collection, Container, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from shared.config import EngineConfig
from shared.sampling_params import TokenLogprob


@dataclass(frozen=True)
class Scoring:
    """Score fed tokens' successors (a prompt's logprobs): next_ids[i] is the token after feed_ids[i],
    scored by the logits after feed_ids[i], with the top_n likeliest tokens there."""

    next_ids: list[int]
    top_n: int


@dataclass(eq=False)  # by identity: a step's failed work is looked up by it
class Work:
    """Tokens to feed one admitted request, as one `submit` asked."""

    key: str
    feed_ids: list[int]
    sample: bool
    return_kv: bool
    future: asyncio.Future
    fed: int = 0  # tokens of feed_ids already in the KV (work split across steps)
    unfeed: int = 0  # newest KV positions to drop when the work is first scheduled (then 0)
    submitted_ns: int = 0
    started_ns: int = 0  # when its first forward began
    score: Scoring | None = None
    scored: list[TokenLogprob] = field(default_factory=list)  # one per fed token so far, when scoring

    @property
    def left(self) -> int:
        return len(self.feed_ids) - self.fed

    @property
    def feeds_only(self) -> bool:
        """Nothing comes back but its completion: no sampling, scoring or KV."""
        return not (self.sample or self.return_kv or self.score)


class Admitted(Protocol):
    """What the scheduler reads of an admitted request (shared/kv_budget.py's Slot)."""

    @property
    def kv_length(self) -> int: ...

    @property
    def background(self) -> bool: ...


Row = tuple[Work, int]  # a work and how many of its tokens the step feeds


@dataclass
class Schedule:
    rows: list[Row]  # the step's rows, at most one per request
    failed: list[tuple[Work, Exception]]  # work that can never run (it unfeeds more than its request holds)


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.max_batch_tokens = config.max_batch_tokens
        self.attention_cost_tokens = config.attention_cost_tokens
        self.long_work_by_admission = config.long_work_by_admission

    @staticmethod
    def coalesce(queue: list[Work]) -> tuple[list[Work], list[tuple[Work, Work]]]:
        """The queue, where a request's work that only feeds is joined by its next work: one row, one
        step (MD's Catch-Up pass still queued when the cut's pass comes); and each (work, joined
        work), whose future must settle as the work's does."""
        last: dict[str, Work] = {}
        kept: list[Work] = []
        joined: list[tuple[Work, Work]] = []
        for work in queue:
            prev = last.get(work.key)
            if (prev is not None and prev.feeds_only and prev.unfeed == 0
                    and not (work.return_kv or work.score) and work.fed == 0 and work.unfeed <= prev.left):
                # "drop the newest u positions, then feed" after tokens not yet fed: drop those tokens
                work.feed_ids = prev.feed_ids[prev.fed:len(prev.feed_ids) - work.unfeed] + work.feed_ids
                work.unfeed = 0
                joined.append((work, prev))
                kept.remove(prev)
            kept.append(work)
            last[work.key] = work
        return kept, joined

    def schedule(self, queue: list[Work], admitted: Mapping[str, Admitted]) -> Schedule:
        """Decode tokens first (latency), then longer work, split to fit the budget: in queue order, or
        (`long_work_by_admission`) in the order its requests were admitted (`admitted`'s order),
        background work last. One row per request, its oldest work: the next waits for the next step.
        Every queued work's request must be in `admitted`."""
        firsts: dict[str, Work] = {}
        for work in queue:
            firsts.setdefault(work.key, work)
        order = {key: i for i, key in enumerate(admitted)} if self.long_work_by_admission else {}
        budget = float(self.max_batch_tokens)
        schedule = Schedule([], [])
        long_rows = 0
        for work in sorted(firsts.values(), key=lambda w: (w.left > 1, admitted[w.key].background,
                                                           order.get(w.key, 0))):
            if budget < 1:
                break
            kv_length = admitted[work.key].kv_length - work.unfeed  # what it holds when its row runs
            if kv_length < 0:
                schedule.failed.append((work, ValueError(
                    f"{work.key} holds {kv_length + work.unfeed} positions, cannot unfeed {work.unfeed}")))
                continue
            if work.left == 1 or long_rows == 0:  # the first long row is cut by tokens: it never waits on others
                take = min(work.left, int(budget))
            else:
                take = self.fitting(work.left, kv_length, budget)
                if take == 0:
                    continue
            long_rows += work.left > 1
            schedule.rows.append((work, take))
            budget -= self.cost(work.left, kv_length, take)
        return schedule

    def cost(self, left: int, kv_length: int, take: int) -> float:
        """What feeding `take` of a work's `left` tokens to a request holding `kv_length` positions
        costs the step's budget: a token each, and with `attention_cost_tokens` C, a fed token over a
        context of n positions counts 1 + n / C (a one-token decode step counts 1)."""
        c = self.attention_cost_tokens
        if c <= 0 or left <= 1:
            return float(take)
        return take * (1 + (kv_length + take / 2) / c)

    def fitting(self, left: int, kv_length: int, budget: float) -> int:
        """The most of `left` tokens whose cost fits the budget (the inverse of `cost`)."""
        c = self.attention_cost_tokens
        if c <= 0:
            return min(left, int(budget))
        b = 1 + kv_length / c  # cost(t) = t * (b + t / 2c)
        return min(left, int(c * (math.sqrt(b * b + 2 * budget / c) - b)))


class StepHolds:
    """Holding the next step for sampling work announced to arrive (`BatchEngine.expect`: MD's cut
    from RLD), so it joins this step instead of waiting out the next."""

    def __init__(self, config: EngineConfig) -> None:
        self.hold_steps = config.hold_steps
        self.grace_s = config.hold_grace_s
        self.gather_s = config.gather_s
        self.due: dict[str, float] = {}  # key -> when its announced work should arrive (time.monotonic)
        self.step_s = 0.0  # a moving average of a step's forward, for how long a hold may last
        self.holds = 0  # steps held back for announced work
        self.holds_met = 0  # holds the announced work arrived in
        self.announced = 0  # work announced for an admitted request (`expect`)
        self.announced_late = 0  # announced work that had not come by its due time and grace

    def announce(self, key: str, due: float) -> None:
        self.due[key] = due
        self.announced += 1

    def stepped(self, forward_s: float) -> None:
        self.step_s = forward_s if not self.step_s else 0.8 * self.step_s + 0.2 * forward_s

    def until(self, now: float, held_since: float | None, arrived: Collection[str],
              admitted: Container[str]) -> float | None:
        """Until when to hold the next step for announced work not yet here (`arrived`: the requests
        whose sampling work is queued); None: do not hold.

        Work is due at the time `expect` gave, give or take a grace (`hold_grace_s`, by default a
        quarter of a step, at least `gather_s`: the announcer's clock is an estimate, and a hop
        follows it). A hold lasts at most `hold_steps` of a step from when the engine was first
        ready, is not begun for work due later than that, and ends when the work arrives or its
        grace is over; work that missed its hold joins a later step without another hold and counts
        in `announced_late`."""
        for key in [k for k in self.due if k in arrived or k not in admitted]:
            del self.due[key]  # it came (or the request is gone): nothing left to hold for
        limit = self.hold_steps * self.step_s
        if not self.due or limit <= 0:
            return None
        reach = (held_since if held_since is not None else now) + limit
        grace = self.grace_s or max(0.25 * self.step_s, self.gather_s)
        until = max((due + grace for due in self.due.values() if due <= reach), default=None)
        if until is not None:
            until = min(until, reach)
        late = [key for key, due in self.due.items()
                if due + grace <= now or (until is not None and until <= now and due <= reach)]
        for key in late:
            del self.due[key]  # late, or its hold is over: it joins a later step
        self.announced_late += len(late)
        return until if until is not None and until > now else None

    def ended(self, held_for: set[str], arrived: Collection[str]) -> bool:
        """A hold is over: whether the work it held for came."""
        met = bool(held_for & set(arrived))
        self.holds += 1
        self.holds_met += met
        return met
