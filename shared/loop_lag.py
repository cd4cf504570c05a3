"""How late this process's event loop runs, and a clock that stands still while it is stalled.

A task sleeps `interval_s` again and again; how much later than asked it wakes is the loop's lag
(each sample goes to `observe`, a service's `pdd_event_loop_lag_seconds`). Lag beyond `slack_s`
is time this process could not look at its sockets: a heartbeat that arrived then is still
unread in a buffer. `clock()` is `time.monotonic()` minus all such stalls, the current one
included before the task has woken to measure it, so a deadline measured on it never expires
for a delay that was our own (services/gateway/routing/registry.py judges liveness by it).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

INTERVAL_S = 0.05
SLACK_S = 0.02  # lag up to this is scheduling noise, not a stall


class LoopLagMonitor:
    def __init__(self, observe: Callable[[float], None] | None = None, interval_s: float = INTERVAL_S,
                 slack_s: float = SLACK_S) -> None:
        self.interval_s = interval_s
        self.slack_s = slack_s
        self._observe = observe
        self._stalled_s = 0.0
        self._due: float | None = None  # monotonic time the sampling task should wake next
        self.max_lag_s = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> LoopLagMonitor:
        self._task = asyncio.get_running_loop().create_task(self._sample(), name="loop-lag")
        return self

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def clock(self) -> float:
        """Monotonic seconds, less every stall of the loop beyond `slack_s`, this one included."""
        now = time.monotonic()
        overdue = 0.0 if self._due is None else max(0.0, now - self._due - self.slack_s)
        return now - self._stalled_s - overdue

    @property
    def stalled_s(self) -> float:
        """All stalls so far, beyond `slack_s` each."""
        return self._stalled_s

    async def _sample(self) -> None:
        while True:
            self._due = time.monotonic() + self.interval_s
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.monotonic() - self._due)
            self._stalled_s += max(0.0, lag - self.slack_s)
            self._due = None
            self.max_lag_s = max(self.max_lag_s, lag)
            if self._observe is not None:
                self._observe(lag)
