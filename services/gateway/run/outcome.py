"""How a request ended and what it went through, as typed values: why an attempt was let go, how
a tier was lost, and each migration; and the summary of it all that the response carries (its
`pdd` object). Plain data; no NATS."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.names import AbortReason, Pipeline, Role

if TYPE_CHECKING:
    from services.gateway.routing.policy import PipelineDecision
    from services.gateway.run.request_run import RequestRun


class CloseReason(enum.StrEnum):
    """Why the gateway let an attempt go; the Abort every tier hears carries it."""

    FINISHED = AbortReason.FINISHED  # the last token was merged
    STOP_STRING = "stop_string"  # the HTTP layer stopped at a stop string
    CLIENT_DISCONNECTED = "client_disconnected"
    CANCELLED = "cancelled"  # the handler was cancelled, the client still there
    ERROR = "error"  # the request failed
    MIGRATED = "migrated"  # a new attempt serves the rest
    DISPATCH_FAILED = "dispatch failed"  # an instance did not accept: whoever did drops it


class LossKind(enum.StrEnum):
    """How a tier was lost (`pdd_tier_losses_total`'s cause)."""

    GONE = "gone"  # the instance is (the watchdog, or it said it is stopping)
    PREEMPTED = "preempted"  # its KV budget was full: load, not a fault
    FAILED = "failed"  # it failed the request and may be alive
    UNREACHABLE = "unreachable"  # P could not reach its KV port: the path failed; it may be serving


@dataclass(frozen=True)
class Migration:
    """One move of a request to a new attempt."""

    after_tokens: int  # tokens the client had when it moved
    lost: Role
    preempted: bool
    pipeline: Pipeline  # the new attempt's
    instances: dict[str, str]  # role -> instance id, the new attempt's
    attempt_id: str

    def as_json(self) -> dict[str, object]:
        return {"after_tokens": self.after_tokens, "lost": str(self.lost), "preempted": self.preempted,
                "pipeline": str(self.pipeline), "instances": dict(self.instances), "attempt_id": self.attempt_id}


def response_summary(run: RequestRun) -> dict:
    """How the request was served, as the response's `pdd` object (docs/api.md); keys are plain str
    (the response goes out through orjson)."""
    return {
        "pipeline": run.pipeline,
        "pipeline_requested": None if run.request.pipeline is None else str(run.request.pipeline),
        "attempts": [{"attempt_id": a.request_id, "pipeline": str(a.served_pipeline), "after_tokens": a.output_offset,
                      "instances": {str(role): iid for role, iid in a.instances.items()}} for a in run.attempts],
        "trace_id": run.trace_id,
        "cached_tokens": {"prefill": run.cached_tokens, "main": run.main_cached_tokens},
        "kv": {tier: {"cached_tokens": kv.cached_tokens, "kv_tokens": kv.kv_tokens, "kv_bytes": kv.kv_bytes,
                      "kv_wait_s": round(kv.kv_wait_s, 6)} for tier, kv in run.kv_received.items()},
        "prefill": None if run.prefill is None else {
            "computed_tokens": run.prefill.computed_tokens, "prefill_s": round(run.prefill.prefill_s, 6)},
        "ttft_s": None if run.first_token_at is None else round(run.first_token_at - run.started_at, 6),
        "instances": run.instances,
        "recovery": None if run.recovery is None else str(run.recovery),
        "migrations": [migration.as_json() for migration in run.migrations],
        "policy": None if (decision := run.decision) is None else _policy_summary(run, decision),
    }


def _policy_summary(run: RequestRun, decision: PipelineDecision) -> dict:
    main_kv = run.kv_received.get(Role.MAIN)
    return {"reason": decision.reason, "main_hit_predicted": decision.main_hit_tokens,
            "wan_bytes_predicted": decision.wan_bytes, "main_kv_held": decision.hold_main_kv,
            "link_bytes_per_s": decision.link_bytes_per_s or None,
            "relay_ready_predicted_s": round(decision.predicted_relay_ready_s, 6),
            "main_ready_predicted_s": round(decision.predicted_main_ready_s, 6),
            "main_ready_actual_s": None if main_kv is None else round(main_kv.kv_wait_s, 6),
            "ttft_budget_s": decision.budget_s}
