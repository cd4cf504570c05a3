"""services/decoder/early_messages.py as plain logic: what is kept comes back once, in arrival order,
for its own request only; what no request claims is dropped after its time, and the store is bounded."""
from __future__ import annotations

import asyncio

from services.decoder.early_messages import EarlyMessages


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay(name: str):
    async def run() -> None:
        return None
    run.name = name
    return run


def names(replays) -> list[str]:
    return [r.name for r in replays]


def test_a_requests_messages_come_back_once_in_arrival_order_and_only_its_own() -> None:
    early = EarlyMessages()
    early.keep("a", replay("a1"))
    early.keep("b", replay("b1"))
    early.keep("a", replay("a2"))
    assert names(early.take("a")) == ["a1", "a2"]
    assert early.take("a") == [] and len(early) == 1 and early.replayed == 2
    assert names(early.take("b")) == ["b1"]


def test_what_no_request_claims_is_dropped_after_its_time() -> None:
    clock = Clock()
    early = EarlyMessages(ttl_s=10.0, clock=clock)
    early.keep("late", replay("x"))
    clock.now = 5.0
    early.keep("soon", replay("y"))
    clock.now = 10.5
    assert early.take("late") == [] and early.expired == 1
    assert names(early.take("soon")) == ["y"]


def test_the_store_is_bounded_oldest_first() -> None:
    early = EarlyMessages(max_kept=2)
    for i in range(3):
        early.keep(f"r{i}", replay(f"m{i}"))
    assert len(early) == 2 and early.expired == 1
    assert early.take("r0") == [] and names(early.take("r2")) == ["m2"]


async def test_what_no_request_claims_leaves_on_an_idle_decoder_with_nothing_kept_or_taken() -> None:
    """The heartbeat's early_messages gauge reads idle on an idle stack: expiry runs on a timer."""
    early = EarlyMessages(ttl_s=0.05)
    early.keep("late", replay("x"))
    await asyncio.sleep(0.01)
    early.keep("later", replay("y"))
    assert len(early) == 2
    await asyncio.sleep(0.5)  # no keep, no take
    assert len(early) == 0 and early.expired == 2 and early.replayed == 0
