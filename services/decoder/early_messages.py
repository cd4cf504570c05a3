"""Peer messages that reach a decoder before their request's assignment, kept until it is registered.

The gateway assigns a request to MD and RLD at once, and nats-py serves each subscription from its
own task, so a peer's message about a request can be handled before this decoder has handled, or
finished handling, its DecodeAssign: MD with the whole prompt in its DRC reports its KV in
(KVReady) at once; RLD with the whole prompt cached streams Catch-Up tokens (Handoff) from its
first step. Dropping one loses the handoff: RLD waits for a report that never comes, or MD finds a
gap in the tokens it adopts. So a role keeps such a message here (as the call that handles it
again) and the shell replays what was kept, in arrival order, once the request is registered.

A message for a request that never comes (a late one, for a request already let go here) is
dropped `ttl_s` after it came, on a timer of the running event loop as well as whenever a message is
kept or taken, so an idle decoder's gauge reads idle; at most `max_kept` are kept, the oldest dropped first.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

Replay = Callable[[], Awaitable[None]]


class EarlyMessages:
    def __init__(self, ttl_s: float = 10.0, max_kept: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_kept = max_kept
        self.clock = clock
        self._kept: list[tuple[str, float, Replay]] = []  # (request id, kept at, replay), oldest first
        self.replayed = 0
        self.expired = 0
        self._timer: asyncio.TimerHandle | None = None  # a loop callback, not a task: nothing to await or cancel

    def keep(self, request_id: str, replay: Replay) -> None:
        """`replay` handles the message again; called once the request is registered, if it is."""
        self._expire()
        if len(self._kept) >= self.max_kept:
            del self._kept[0]
            self.expired += 1
        self._kept.append((request_id, self.clock(), replay))
        self._arm()

    def take(self, request_id: str) -> list[Replay]:
        """The request's kept messages, in arrival order; they are forgotten here."""
        self._expire()
        replays = [replay for kept_for, _, replay in self._kept if kept_for == request_id]
        if replays:
            self._kept = [kept for kept in self._kept if kept[0] != request_id]
            self.replayed += len(replays)
        return replays

    def __len__(self) -> int:
        return len(self._kept)

    def _arm(self) -> None:
        """Expire the oldest when its time comes, though nothing is kept or taken by then."""
        if self._timer is not None or not self._kept:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (plain logic): expiry on keep and take only
            return
        self._timer = loop.call_later(max(0.0, self._kept[0][1] + self.ttl_s - self.clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._expire()
        self._arm()

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        fresh = next((i for i, (_, kept_at, _) in enumerate(self._kept) if kept_at > cutoff), len(self._kept))
        self.expired += fresh
        del self._kept[:fresh]
