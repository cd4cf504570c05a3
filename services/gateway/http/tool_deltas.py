"""A chat answer read for tool calls as OpenAI shows them: each streamed token's delta, and the
finish reason of an answer that called tools.

Owns the shape only; reading calls out of text is tool_calls.py's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from services.gateway.http.tool_calls import ToolCallStream

if TYPE_CHECKING:
    from services.gateway.http.generation import Step
    from services.gateway.http.tool_calls import ToolRequest

Json = dict[str, object]


def tool_finish(finish_reason: str) -> str:
    """An answer that ended by itself with tool calls in it finished to call them (a length cut stays
    one: the last call's arguments are cut)."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


class ToolDeltas:
    """A streamed chat answer's text read for tool calls: each token's text in, that token's delta out."""

    def __init__(self, tools: ToolRequest) -> None:
        self._stream = ToolCallStream(tools.names, shape=tools.shape)

    def delta(self, step: Step) -> Json:
        deltas = self._stream.feed(step.text)
        if step.finish_reason is not None:
            deltas += self._stream.finish()
        delta: Json = {}
        content = "".join(str(d["content"]) for d in deltas if "content" in d)
        calls = [call for d in deltas for call in d.get("tool_calls", [])]  # type: ignore[attr-defined]
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, finish_reason: str) -> str:
        return tool_finish(finish_reason) if self._stream.calls_made else finish_reason
