"""When Relay Decode hands a request to Main Decode. Plain logic; no NATS, no model.

RLD decodes eagerly from the moment it has the prompt KV. Once MD says its KV is complete,
RLD stops at its next step boundary and hands off (One-Shot: all eager token IDs at once).
`handoff_at` is a test knob that pins the cut to exactly that many eager tokens: RLD runs on
until it has made them even if MD is ready earlier, and waits for MD if it gets there first.
"""
from __future__ import annotations

import enum


class RelayAction(enum.Enum):
    DECODE = "decode"
    HAND_OFF = "hand_off"
    WAIT_FOR_MAIN = "wait_for_main"


def next_action(eager_tokens: int, main_ready: bool, handoff_at: int | None) -> RelayAction:
    if handoff_at is None:
        return RelayAction.HAND_OFF if main_ready else RelayAction.DECODE
    if eager_tokens < handoff_at:
        return RelayAction.DECODE
    return RelayAction.HAND_OFF if main_ready else RelayAction.WAIT_FOR_MAIN
