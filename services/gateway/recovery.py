"""What the gateway does when a tier fails mid-request. Plain logic; no NATS.

With the `recover` policy:
- MD lost (it died, its KV transfer failed, or the WAN was cut) before the cut of a P-RLD-MD
  request: RLD finishes the request alone. This is the one case where P-RLD runs (counted).
- RLD lost before the cut: MD takes over with the tokens the client has already received, sent
  by the gateway itself as the final handoff, so no token is produced twice.
- RLD lost after the cut: nothing to do, it was finished.
Everything else, and everything under the `fail` policy, ends the request with a terminal error.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    FAIL = "fail"
    FINISH_ON_RELAY = "finish_on_relay"
    MAIN_TAKES_OVER = "main_takes_over"
    IGNORE = "ignore"


@dataclass(frozen=True)
class RunState:
    pipeline: str
    cut_done: bool  # MD has taken over (its handoff stats or its first token arrived)
    recovered: bool  # a recovery already happened: a second failure is final
    policy: str  # "recover" | "fail"


def on_tier_lost(state: RunState, tier: str) -> Action:
    """`tier` is "main", "relay" or "prefill"."""
    if tier == "relay" and state.cut_done:
        return Action.IGNORE
    if state.policy != "recover" or state.recovered or state.pipeline != "p-rld-md" or state.cut_done:
        return Action.FAIL
    if tier == "main":
        return Action.FINISH_ON_RELAY
    if tier == "relay":
        return Action.MAIN_TAKES_OVER
    return Action.FAIL
