"""A Responses API answer built from its steps: the output items (assistant messages and function
calls read out of the text) and the typed events that stream them, each with its sequence_number.

Pure shaping: one `ResponseOutput` per response, fed every step; the whole answer is the same
object the stream's last event carries. Knows nothing of runs, HTTP or SSE framing.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.gateway.http.generation import Step
    from services.gateway.http.responses_items import ResponsesRequest

Json = dict[str, object]
StepLogprobs = Callable[["Step"], list[Json]]  # a step's entries in output_text.logprobs


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(chat_usage: Json) -> Json:
    """Chat's usage object in the Responses API's names. P keeps every prefix it computes, so what
    was not read from its cache was written to it."""
    prompt_tokens, completion_tokens = int(chat_usage["prompt_tokens"]), int(chat_usage["completion_tokens"])  # type: ignore[call-overload]
    details = chat_usage["prompt_tokens_details"]
    cached = int(details["cached_tokens"]) if isinstance(details, dict) else 0
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt_tokens - cached},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseOutput:
    """One response's output items, built step by step, and the events that say so.

    Text outside tool calls goes to an assistant message (opened at its first text); each tool call
    closes the message before it and is a function_call item of its own, whole (its arguments in one
    delta, as chat streams a call whole); text after a call opens a new message. The answer's end
    closes what is open and says whether it completed or was cut (`incomplete`, max_output_tokens).
    """

    def __init__(self, response_id: str, created_at: int, model: str, request: ResponsesRequest,
                 step_logprobs: StepLogprobs | None) -> None:
        self.response_id = response_id
        self._head: Json = {"id": response_id, "object": "response", "created_at": created_at, "model": model}
        self._request = request
        self._step_logprobs = step_logprobs
        self.items: list[Json] = []
        self._message: Json | None = None  # the message whose text is streaming, if one is open
        self._sequence = 0
        self.status = "in_progress"

    def response(self, usage: Json | None = None, pdd: Json | None = None) -> Json:
        """The response object as it stands (`usage` and pdd's summary once it has finished)."""
        body: Json = {**self._head, "status": self.status, "error": None,
                      "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
                      **self._request.echo(), "output": [dict(item) for item in self.items], "usage": usage}
        if pdd is not None:
            body["pdd"] = pdd
        return body

    def start(self) -> list[Json]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def step(self, step: Step, delta: Json | None = None) -> list[Json]:
        """The events of one step. `delta`: its text read for tool calls, chat's delta for it (the
        choice's ToolDeltas: content, then whole calls; none while the text may still begin a call);
        None when the answer is not read for calls (tools absent or tool_choice "none")."""
        logprobs = self._step_logprobs(step) if self._step_logprobs is not None else []
        if delta is None:
            return self._text(step.text, logprobs) if step.text or logprobs else []
        # one token's text that ends a call and begins text after it would be read content first: a
        # tokeniser's tokens are too short for that to be more than the blank between them
        events = self._text(str(delta["content"]), []) if delta.get("content") else []
        calls: list[Json] = delta.get("tool_calls", [])  # type: ignore[assignment]
        for i, call in enumerate(calls):
            cut = step.finish_reason == "length" and i == len(calls) - 1  # its arguments as far as they came
            events += self._call(call, "incomplete" if cut else "completed")
        return events

    def finish(self, finish_reason: str, usage: Json, pdd: Json) -> list[Json]:
        """The events that end the response: its open message closed, then response.completed (or
        response.incomplete when max_output_tokens cut it)."""
        self.status = "incomplete" if finish_reason == "length" else "completed"
        events: list[Json] = []
        if not self.items and self._message is None:  # an empty answer is an empty message, as OpenAI's
            events += self._open_message()
        events += self._close_message(self.status)
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.response(usage, pdd))]

    def failed(self, code: str, message: str) -> Json:
        """The event of a response that failed once streaming (its error in `response.error`)."""
        self.status = "failed"
        response = {**self.response(), "error": {"code": code, "message": message}}
        return self._event("response.failed", response=response)

    def _text(self, text: str, logprobs: list[Json]) -> list[Json]:
        if self._message is None and self.items:  # a message after a call: the blank between them is neither's
            text = text.lstrip()
            if not text and not logprobs:
                return []
        events = self._open_message() if self._message is None else []
        message = self._message
        assert message is not None
        part = message["content"][0]  # type: ignore[index]
        part["text"] += text
        part["logprobs"] += logprobs
        if text or logprobs:
            events.append(self._event("response.output_text.delta", item_id=message["id"],
                                      output_index=len(self.items) - 1, content_index=0, delta=text,
                                      logprobs=logprobs))
        return events

    def _open_message(self) -> list[Json]:
        message: Json = {"id": new_item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                         "content": []}
        self._message = message
        self.items.append(message)
        part: Json = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self._event("response.output_item.added", output_index=len(self.items) - 1, item=_copy(message))
        message["content"] = [part]
        return [added, self._event("response.content_part.added", item_id=message["id"],
                                   output_index=len(self.items) - 1, content_index=0, part=dict(part, text=""))]

    def _close_message(self, status: str) -> list[Json]:
        message, self._message = self._message, None
        if message is None:
            return []
        message["status"] = status
        part = message["content"][0]  # type: ignore[index]
        index = self.items.index(message)
        return [self._event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=part["logprobs"]),
                self._event("response.content_part.done", item_id=message["id"], output_index=index,
                            content_index=0, part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=_copy(message))]

    def _call(self, call: Json, status: str) -> list[Json]:
        events = self._close_message("completed")
        function = call["function"]
        assert isinstance(function, dict)
        item: Json = {"id": new_item_id("fc"), "type": "function_call", "status": "in_progress",
                      "call_id": call["id"], "name": function["name"], "arguments": ""}
        self.items.append(item)
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        item["arguments"], item["status"] = function["arguments"], status
        events += [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"]),
                   self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"]),
                   self._event("response.output_item.done", output_index=index, item=dict(item))]
        return events

    def _event(self, kind: str, **fields: object) -> Json:
        event: Json = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def _copy(message: Json) -> Json:
    """A message as it is now: its content parts copied, so later text does not change a sent event."""
    return {**message, "content": [dict(part) for part in message["content"]]}  # type: ignore[attr-defined]


def as_input_items(output: list[Json]) -> list[Json]:
    """A response's output items as a later request's input items would give them (normalised)."""
    items: list[Json] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(str(part["text"]) for part in item["content"])  # type: ignore[attr-defined]
            items.append({"type": "message", "role": "assistant", "content": text})
        else:
            items.append({key: item[key] for key in ("type", "call_id", "name", "arguments")})
    return items
