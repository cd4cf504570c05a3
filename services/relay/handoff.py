"""When and how Relay Decode hands a request to Main Decode. Plain logic; no NATS, no model.

RLD decodes eagerly from the moment it has the prompt KV. MD reports progress (`KVReady`): that
its KV is complete (0 output tokens adopted) when nothing of RLD's waits for it, and once that it
has recomputed RLD's tokens (`adopted_tokens` > 0); it makes no report after that one, so RLD
cuts at it (what MD does with the tokens still coming: services/main/takeover.py).
- One-Shot: at MD's first report RLD stops and sends every eager token ID at once (the cut).
- Catch-Up: RLD streams each token to MD as it makes it, from the first one, while MD's KV is
  still crossing (a few bytes a token); MD queues them, and once its KV is in it recomputes all
  that has arrived in one pass, then reports. RLD, having sent all but the token in the making,
  cuts at that report: MD's final pass feeds only the tokens made since, and the handoff costs
  no round of MD asking and RLD answering. Should MD report its KV before RLD sent anything, RLD
  with fewer than `threshold` eager tokens cuts at once; with more, it sends them as one chunk
  and streams on, and cuts once MD reports holding that chunk.
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
        self.rounds = 0  # handoff messages sent, the cut's included
        self._main_reported = False  # MD reported progress we have not acted on yet
        self._main_ready = False  # MD has reported: its KV is in
        self._adopted = 0  # eager tokens MD last reported holding
        self._first_chunk = 0  # Catch-Up: where the first chunk ended, once it was sent (then RLD streams)
        self.main_lost = False  # RLD finishes alone

    def on_main_progress(self, adopted_tokens: int = 0) -> None:
        self._main_reported = True
        self._main_ready = True
        self._adopted = max(self._adopted, adopted_tokens)

    @property
    def main_ready(self) -> bool:
        """MD has reported its KV in (a pinned cut then waits only for its token count)."""
        return self._main_ready

    @property
    def streaming(self) -> bool:
        """Catch-Up after a first chunk sent at MD's report: each new token goes to MD as RLD makes it."""
        return self._first_chunk > 0

    @property
    def streams_early(self) -> bool:
        """Catch-Up (not pinned by handoff_at): tokens go to MD before it reports its KV."""
        return self.mode is HandoffMode.CATCH_UP and self.handoff_at is None

    def on_main_lost(self) -> None:
        self.main_lost = True

    def next(self, eager: int) -> Decision:
        if self.main_lost:
            return Decision(Step.DECODE)
        if self.handoff_at is not None and eager >= self.handoff_at:
            return self._act(Step.CUT, eager) if self._main_ready else Decision(Step.WAIT_FOR_MAIN)
        if self.streaming:
            if self.would_cut(eager):
                return self._act(Step.CUT, eager)
            return self._act(Step.SEND_CHUNK, eager) if eager > self.sent else Decision(Step.DECODE)
        if not self._main_reported:  # MD's KV is not in yet: stream to it meanwhile, or just decode
            if self.streams_early and eager > self.sent:
                return self._act(Step.SEND_CHUNK, eager)
            return Decision(Step.DECODE)
        if self.handoff_at is not None and self.mode is HandoffMode.ONE_SHOT:
            return Decision(Step.DECODE)  # One-Shot held by handoff_at
        if self.would_cut(eager):
            return self._act(Step.CUT, eager)
        self._first_chunk = eager
        return self._act(Step.SEND_CHUNK, eager)

    def would_cut(self, eager: int, adopted_tokens: int | None = None) -> bool:
        """Whether, once MD has reported (`adopted_tokens`, if that report is not noted yet), RLD cuts
        when it holds `eager` tokens (no state changes): the cut RLD can announce to MD while it
        still makes the last of them."""
        if self.main_lost:
            return False
        if self.handoff_at is not None:
            return eager >= self.handoff_at
        if self.mode is HandoffMode.ONE_SHOT:
            return True
        adopted = self._adopted if adopted_tokens is None else max(self._adopted, adopted_tokens)
        if self.streaming:
            return adopted >= self._first_chunk
        # MD holding some means it recomputed what RLD streamed while its KV crossed, and it makes no
        # further report: the cut carries whatever is unsent
        return adopted > 0 or eager - self.sent < self.threshold

    def _act(self, step: Step, eager: int) -> Decision:
        decision = Decision(step, self.sent, eager)
        self.sent = eager
        self.rounds += 1
        self._main_reported = False
        return decision
