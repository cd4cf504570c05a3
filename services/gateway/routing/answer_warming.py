"""When P should extend its prefix cache with a running answer. Plain logic.

MD's DRC keeps every finished answer, so a session's next turn hits it there; P's cache held only
prompts, so every turn P computed the previous answer again on the critical path. While an answer
streams, P is idle for it: every `step_tokens` output tokens the gateway asks P (a warm-up, a
PrefillRequest with no KV path) to compute the answer so far into its cache. The last partial step
is left to the next turn, which would otherwise race the warm-up for the same tokens.
"""
from __future__ import annotations


class AnswerWarmer:
    def __init__(self, step_tokens: int) -> None:
        self.step_tokens = step_tokens  # 0: never
        self._outputs: dict[str, dict[int, int]] = {}  # request id -> output index -> token id
        self._warmed: dict[str, int] = {}  # request id -> output tokens P was last asked to cache

    def on_tokens(self, request_id: str, start: int, token_ids: list[int], finished: bool) -> list[int] | None:
        """A chunk of output; the request's output tokens P should now cache, or None."""
        if not self.step_tokens:
            return None
        if finished:
            self.forget(request_id)
            return None
        outputs = self._outputs.setdefault(request_id, {})
        for offset, token in enumerate(token_ids):
            outputs[start + offset] = token
        contiguous = self._warmed.get(request_id, 0)
        while contiguous in outputs:
            contiguous += 1
        due = contiguous - contiguous % self.step_tokens
        if due <= self._warmed.get(request_id, 0):
            return None
        self._warmed[request_id] = due
        return [outputs[i] for i in range(due)]

    def forget(self, request_id: str) -> None:
        self._outputs.pop(request_id, None)
        self._warmed.pop(request_id, None)
