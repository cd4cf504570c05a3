"""How a request ended and what it went through, as typed values: why an attempt was let go, how
a tier was lost, and each migration (the response's `pdd.migrations`). Plain data; no NATS."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.names import AbortReason, Pipeline, Role


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
