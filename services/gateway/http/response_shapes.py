"""The OpenAI objects of one response: chat.completion(.chunk) and text_completion, whole or as
chunks, with pdd's extension (each token's tier, the handoff, the run's summary).

Pure shaping: builds dicts from steps; knows nothing of runs, HTTP or SSE.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.gateway.http.tool_calls import parse_answer
from services.gateway.http.tool_deltas import tool_finish

if TYPE_CHECKING:
    from services.gateway.http.generation import Step
    from services.gateway.http.logprob_shapes import Logprobs
    from services.gateway.http.tool_calls import ToolRequest

Json = dict[str, object]


def _package_version() -> str:
    try:
        return importlib.metadata.version("pdd")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


SYSTEM_FINGERPRINT = f"pdd-{_package_version()}"  # in every response, as OpenAI's; changes with pdd's version


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Json:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class Shapes:
    """Builds one response's OpenAI objects: chat.completion(.chunk) or text_completion."""

    response_id: str
    created: int
    model: str
    chat: bool
    include_usage: bool
    logprobs: Logprobs | None = None  # when the request asks for them
    index: int = 0  # the choice this object's choices are (n > 1)

    def for_choice(self, index: int, logprobs: Logprobs | None) -> Shapes:
        return dataclasses.replace(self, index=index, logprobs=logprobs)

    def _head(self, object_name: str) -> Json:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def _chunk(self, choices: list[Json]) -> Json:
        chunk = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": choices}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI sends null usage on every chunk but the last
        return chunk

    def _choice(self, text: str, finish_reason: str | None, *, first: bool = False,
                logprobs: Json | None = None, delta: Json | None = None) -> Json:
        if not self.chat:
            return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if delta is None:
            delta = {} if finish_reason is not None else {"content": text}
        if first:  # OpenAI's first chunk names the role beside the first token's text
            delta = {"role": "assistant", **delta}
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs_of(self, steps: list[Step]) -> Json | None:
        return None if self.logprobs is None else self.logprobs.of(steps)

    def token_chunk(self, step: Step, pipeline: str, delta: Json | None = None) -> Json:
        """The chunk of one token; the first (index 0) also carries the assistant role, so that the
        first chunk a client sees is the first token (its time is the TTFT clients measure).
        `delta`: chat's delta when the text is read for tool calls (else the step's text)."""
        pdd: Json = {"tokens": [{"index": step.index, "id": step.token_id, "tier": step.tier}], "pipeline": pipeline}
        if step.handoff is not None:
            pdd["handoff"] = step.handoff
        choice = self._choice(step.text, None, first=step.index == 0, logprobs=self._logprobs_of([step]), delta=delta)
        return {**self._chunk([choice]), "pdd": pdd}

    def final_chunk(self, finish_reason: str, summary: Json, handoff: Json | None) -> Json:
        pdd: Json = {**summary, "tokens": []}
        if handoff is not None:
            pdd["handoff"] = handoff
        return {**self._chunk([self._choice("", finish_reason)]), "pdd": pdd}

    def usage_chunk(self, usage: Json) -> Json:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"),
                "choices": [], "usage": usage}

    def choice(self, text: str, steps: list[Step], finish_reason: str, tools: ToolRequest | None = None) -> Json:
        """A whole choice. `tools`: the text is read for calls to them (chat with tools offered, not "none")."""
        logprobs = self._logprobs_of(steps)
        if not self.chat:
            return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        message: Json = {"role": "assistant", "content": text}
        if tools is not None:
            answer = parse_answer(text, tools.names, shape=tools.shape)
            message["content"] = answer.content
            if answer.tool_calls:
                message["tool_calls"] = answer.tool_calls
                finish_reason = tool_finish(finish_reason)
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def completion(self, choices: list[Json], usage: Json, pdd: Json) -> Json:
        return {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": choices, "usage": usage, "pdd": pdd}
