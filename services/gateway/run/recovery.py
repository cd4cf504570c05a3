"""What the gateway does when a tier fails mid-request. Plain logic; no NATS.

With the `recover` policy:
- MD lost (it died, its KV transfer failed, or the WAN was cut) before the cut of a P-RLD-MD
  request: RLD finishes the request alone. This is the one case where P-RLD runs (counted).
- RLD lost before the cut: MD takes over with the tokens the client has already received, sent
  by the gateway itself as the final handoff, so no token is produced twice.
- The decoder streaming the request lost (MD after the cut or in P-MD, RLD once MD is gone):
  the request migrates. The gateway dispatches it again, to other instances, with the tokens the
  client already has appended to the prompt; the new decoder continues from there.
- P lost before any token reached the client and before its KV was all sent: the request is
  dispatched again on another P (a migration with nothing streamed yet).
- P lost once its KV is out, or RLD lost after the cut: nothing to do, they were finished.
Migrations are limited per request (--max-migrations). Everything else, and everything under
the `fail` policy, ends the request with a terminal error.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    FAIL = "fail"
    FINISH_ON_RELAY = "finish_on_relay"
    MAIN_TAKES_OVER = "main_takes_over"
    MIGRATE = "migrate"
    IGNORE = "ignore"


@dataclass(frozen=True)
class RunState:
    """The current attempt of a request, as far as recovery cares."""

    pipeline: str  # "p-md", "p-rld-md" or "p-rld"
    cut_done: bool  # MD has taken over (its handoff stats or its first token arrived)
    lost: frozenset[str]  # tiers of this attempt already lost (and recovered from)
    streamed: int  # tokens this attempt's decoders have sent the client
    prefill_done: bool  # P reported every KV path sent
    migrations_left: int
    policy: str  # "recover" | "fail"


def on_tier_lost(state: RunState, tier: str) -> Action:
    """`tier` is "main", "relay" or "prefill"."""
    action = _recovery(state, tier)
    if action is Action.IGNORE:
        return action
    if state.policy != "recover" or (action is Action.MIGRATE and state.migrations_left <= 0):
        return Action.FAIL
    return action


def _recovery(state: RunState, tier: str) -> Action:
    relay_streams = state.pipeline == "p-rld-md" and not state.cut_done  # RLD's tokens reach the client
    if tier == "prefill":
        if state.prefill_done:
            return Action.IGNORE
        if state.streamed == 0:
            return Action.MIGRATE
        if relay_streams and "main" not in state.lost:
            return Action.FINISH_ON_RELAY  # RLD has its KV (it streams); MD's may never arrive
        return Action.IGNORE  # the streaming decoder holds its KV; a decoder missing some reports it
    if tier == "relay":
        if state.pipeline == "p-rld-md" and state.cut_done:
            return Action.IGNORE
        if relay_streams and "main" not in state.lost:
            return Action.MAIN_TAKES_OVER
        return Action.MIGRATE
    if tier == "main":
        if relay_streams and "relay" not in state.lost:
            return Action.FINISH_ON_RELAY
        return Action.MIGRATE
    return Action.FAIL
