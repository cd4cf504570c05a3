"""When P should extend its prefix cache with a running answer. Plain logic.

MD's DRC keeps every finished answer, so a session's next turn hits it there; P's cache held only
prompts, so every turn P computed the previous answer again on the critical path. While an answer
streams, P is idle for it: every `step_tokens` output tokens the client has, the gateway asks P (a warm-up, a
PrefillRequest with no KV path) to compute the answer so far into its cache. The last partial step
is left to the next turn, which would otherwise race the warm-up for the same tokens.
"""
from __future__ import annotations


def warm_due(step_tokens: int, warmed_tokens: int, answered_tokens: int) -> int:
    """How many of the answer's first tokens P should now cache: the whole steps of what the client
    has (`answered_tokens`), when that is more than P was last asked for (`warmed_tokens`); else 0.
    `step_tokens` 0: never. A finished answer is not warmed (the next turn computes the rest)."""
    if not step_tokens:
        return 0
    due = answered_tokens - answered_tokens % step_tokens
    return due if due > warmed_tokens else 0
