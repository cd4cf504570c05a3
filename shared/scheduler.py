"""The batch engine's scheduler: which queued work runs in the next step, and how many tokens of each.

Pure decisions over the queue and what each admitted request holds: it allocates nothing, runs
nothing and settles no future (the engine, shared/batch_engine.py, does all three).
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from shared.config import EngineConfig
from shared.sampling import TokenLogprob


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
