"""The names pdd's services agree on, one enum each: roles, pipelines, handoff modes, failure policies
and model dtypes. A name is spelled here once; flags, messages and checks use these.

They are `StrEnum`s, so they travel in messages and flags as the plain strings docs/protocol.md gives,
and a string read off the wire compares equal to its member.
"""
from __future__ import annotations

import enum


class Role(enum.StrEnum):
    PREFILL = "prefill"
    RELAY = "relay"
    MAIN = "main"


class Pipeline(enum.StrEnum):
    P_MD = "p-md"
    P_RLD_MD = "p-rld-md"
    P_RLD = "p-rld"  # never planned: RLD finishes alone (MD lost, or none reachable)
    P = "p"  # P alone: a prompt's logprobs and no output token (completions echo with max_tokens 0)

    @classmethod
    def requestable(cls) -> tuple[Pipeline, ...]:
        """What a client or an operator may ask for; P-RLD only happens to a request."""
        return (cls.P_MD, cls.P_RLD_MD)

    @property
    def uses_relay(self) -> bool:
        return self in (Pipeline.P_RLD_MD, Pipeline.P_RLD)

    @property
    def uses_main(self) -> bool:
        return self in (Pipeline.P_MD, Pipeline.P_RLD_MD)


AUTO = "auto"  # a flag value: the policy chooses (pipeline) or RLD's load does (handoff mode)


class AbortReason(enum.StrEnum):
    """Reasons of an Abort that a tier acts on; any other reason is free text, for logs and metrics."""

    FINISHED = "finished"  # the request ended with its last token (the gateway's RequestRun.close)
    FINISHED_ON_RELAY = "finished on relay"  # RLD made every token: what P sent toward MD was for nothing


class HandoffMode(enum.StrEnum):
    ONE_SHOT = "one-shot"
    CATCH_UP = "catch-up"


class FailurePolicy(enum.StrEnum):
    RECOVER = "recover"
    FAIL = "fail"


class DType(enum.StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


def choices(values: type[enum.StrEnum] | tuple[enum.StrEnum, ...], *extra: str) -> tuple[str, ...]:
    """argparse choices: the enum's values (plus e.g. AUTO) as plain strings."""
    return (*extra, *(str(v) for v in values))
