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
- P lost once its KV is out, RLD lost after the cut, or MD lost once RLD finishes alone: nothing
  to do, they were finished (or let go).
Migrations are limited per request (--max-migrations). Everything else, and everything under
the `fail` policy, ends the request with a terminal error. A tier that preempted the request (its
KV budget was full) is load, not a fault: the same recovery applies under either policy, and its
migrations do not count against the limit (the request deadline bounds them).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from services.gateway.run.attempt import AttemptPhase
from shared.names import FailurePolicy, Pipeline, Role


class Action(enum.StrEnum):
    """What to do about a lost tier; the response's `pdd.recovery` names the one taken."""

    FAIL = "fail"
    FINISH_ON_RELAY = "finish_on_relay"
    MAIN_TAKES_OVER = "main_takes_over"
    MIGRATE = "migrate"
    IGNORE = "ignore"


@dataclass(frozen=True)
class RunState:
    """The current attempt of a request, as far as recovery cares."""

    pipeline: Pipeline
    phase: AttemptPhase  # services/gateway/run/attempt.py: CUT once MD took over, RELAY_ALONE once MD was let go
    lost: frozenset[Role]  # roles of this attempt already lost (and recovered from)
    streamed: int  # tokens this attempt's decoders have sent the client
    prefill_done: bool  # P reported every KV path sent
    migrations_left: int
    policy: FailurePolicy


def on_tier_lost(state: RunState, tier: Role, preempted: bool = False) -> Action:
    action = _recovery(state, tier)
    if action is Action.IGNORE or preempted:
        return action
    if state.policy != FailurePolicy.RECOVER or (action is Action.MIGRATE and state.migrations_left <= 0):
        return Action.FAIL
    return action


def _recovery(state: RunState, tier: Role) -> Action:
    cut = state.phase is AttemptPhase.CUT
    relay_streams = state.pipeline == Pipeline.P_RLD_MD and not cut  # RLD's tokens reach the client
    main_gone = Role.MAIN in state.lost or state.phase is AttemptPhase.RELAY_ALONE
    if tier == Role.PREFILL:
        if state.prefill_done:
            return Action.IGNORE
        if state.streamed == 0:
            return Action.MIGRATE
        if relay_streams and not main_gone:
            return Action.FINISH_ON_RELAY  # RLD has its KV (it streams); MD's may never arrive
        return Action.IGNORE  # the streaming decoder holds its KV; a decoder missing some reports it
    if tier == Role.RELAY:
        if state.pipeline == Pipeline.P_RLD_MD and cut:
            return Action.IGNORE
        if relay_streams and not main_gone:
            return Action.MAIN_TAKES_OVER
        return Action.MIGRATE
    if tier == Role.MAIN:
        if state.phase is AttemptPhase.RELAY_ALONE:
            return Action.IGNORE  # MD was let go already: RLD finishes
        if relay_streams and Role.RELAY not in state.lost:
            return Action.FINISH_ON_RELAY
        return Action.MIGRATE
    return Action.FAIL
