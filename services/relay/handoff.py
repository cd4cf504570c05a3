"""When and how Relay Decode hands a request to Main Decode. Plain logic; no NATS, no model.

RLD decodes eagerly from the moment it has the prompt KV. MD reports progress: first that its
KV is complete (0 output tokens adopted), then, in Catch-Up, each time it has recomputed a chunk.
- One-Shot: at MD's first report RLD stops and sends every eager token ID at once (the cut).
- Catch-Up: at each report RLD sends the tokens MD lacks as a chunk and keeps decoding while MD
  recomputes it; once fewer than `threshold` tokens remain, RLD stops and sends the rest (the
  cut). If a round does not shrink what remains (MD recomputes slower than RLD decodes), RLD
  falls back to One-Shot at once, so Catch-Up always converges.
`handoff_at` is a test knob that pins the cut to exactly that many eager tokens: RLD decodes on
until it has made them even if MD is ready earlier, and waits for MD if it gets there first.
Once the gateway says MD is lost, RLD decodes to the end alone and hands nothing off.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.names import AUTO, HandoffMode


class Step(enum.Enum):
    DECODE = "decode"
    WAIT_FOR_MAIN = "wait_for_main"
    SEND_CHUNK = "send_chunk"  # tokens [start, end) to MD; RLD keeps decoding
    CUT = "cut"  # tokens [start, end) to MD, and RLD stops


@dataclass(frozen=True)
class Decision:
    step: Step
    start: int = 0
    end: int = 0


def choose_mode(configured: str, running_requests: int, catch_up_max_running: int) -> HandoffMode:
    """`auto` follows RLD's load: Catch-Up when RLD has room, One-Shot when it is busy."""
    if configured == AUTO:
        return HandoffMode.CATCH_UP if running_requests <= catch_up_max_running else HandoffMode.ONE_SHOT
    return HandoffMode(configured)


class HandoffPlan:
    """The state of one request's handoff on RLD."""

    def __init__(self, mode: HandoffMode, threshold: int, handoff_at: int | None) -> None:
        self.mode = mode
        self.threshold = threshold
        self.handoff_at = handoff_at
        self.sent = 0  # eager tokens already handed to MD
        self.rounds = 0
        self.fell_back = False
        self._main_reported = False  # MD reported progress we have not acted on yet
        self._last_remaining: int | None = None
        self.main_lost = False  # RLD finishes alone

    def on_main_progress(self) -> None:
        self._main_reported = True

    @property
    def main_reported(self) -> bool:
        """MD reported progress RLD has not acted on yet (a pinned cut waits for its token count)."""
        return self._main_reported

    def on_main_lost(self) -> None:
        self.main_lost = True

    def next(self, eager: int) -> Decision:
        if self.main_lost:
            return Decision(Step.DECODE)
        if self.handoff_at is not None and eager >= self.handoff_at:
            return self._act(Step.CUT, eager) if self._main_reported else Decision(Step.WAIT_FOR_MAIN)
        if not self._main_reported:
            return Decision(Step.DECODE)
        if self.would_cut(eager):
            self.fell_back = self.fell_back or not self._cut_by_rule(eager - self.sent)
            return self._act(Step.CUT, eager)
        if self.mode is HandoffMode.CATCH_UP and eager > self.sent:
            self._last_remaining = eager - self.sent
            return self._act(Step.SEND_CHUNK, eager)
        return Decision(Step.DECODE)  # nothing new to send yet (or One-Shot held by handoff_at)

    def would_cut(self, eager: int) -> bool:
        """Whether, once MD has reported, RLD cuts when it holds `eager` tokens (no state changes):
        the cut RLD can announce to MD while it still makes the last of them."""
        if self.main_lost:
            return False
        if self.handoff_at is not None:
            return eager >= self.handoff_at
        remaining = eager - self.sent
        # or not converging: MD recomputes slower than RLD decodes
        return self._cut_by_rule(remaining) or (self._last_remaining is not None and remaining >= self._last_remaining)

    def _cut_by_rule(self, remaining: int) -> bool:
        return self.mode is HandoffMode.ONE_SHOT or remaining < self.threshold

    def _act(self, step: Step, eager: int) -> Decision:
        decision = Decision(step, self.sent, eager)
        self.sent = eager
        self.rounds += 1
        self._main_reported = False
        return decision
