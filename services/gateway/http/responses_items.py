"""The Responses API's request as the chat request pdd serves: input items, `instructions`, `tools`,
`tool_choice` and `text.format` turned into chat messages, tools and response_format, every field
checked and named as the Responses API names it.

Pure functions; knows nothing of HTTP, of stored responses (the caller passes their items) or of
how the chat request is served. A chat parser's error names a chat field; `responses_param` turns
it back into the Responses field it came from.

    request = to_chat_request(body, history_items)     # InvalidParam naming e.g. input[2].content
    parsed = parse_chat_request(request.chat_body, ...)  # errors: request.rename(exc)
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.gateway.http.request_parsing import refuse_unknown_fields
from shared.errors import InvalidParam

Json = dict[str, object]

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = {"user": ("input_text",), "system": ("input_text",), "developer": ("input_text",),
                   "assistant": ("output_text", "refusal")}
ITEM_STATUSES = (None, "in_progress", "completed", "incomplete")
# The keys of each item type pdd takes: what it renders, and what describes the item (id, status; an
# assistant message's phase, a hint for OpenAI's own models) as the client got it back from a response.
ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
             "function_call": {"type", "id", "call_id", "name", "arguments", "status"},
             "function_call_output": {"type", "id", "call_id", "output", "status"}}
PART_KEYS = {"type", "text", "refusal", "annotations", "logprobs"}  # annotations and logprobs describe an answer
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values that add to items pdd never makes (built-in tool calls, images, reasoning): no effect
INERT_INCLUDES = ("web_search_call.action.sources", "web_search_call.results", "code_interpreter_call.outputs",
                  "computer_call_output.output.image_url", "file_search_call.results",
                  "message.input_image.image_url", "reasoning.encrypted_content")
MAX_TOP_LOGPROBS = 20
# Fields served as chat serves them, under the same name (chat checks them): the sampling options
# pdd has beyond OpenAI's Responses API (vLLM takes them there too), and pdd's own.
CHAT_FIELDS = ("model", "temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p",
               "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "stop", "stop_token_ids",
               "ignore_eos", "min_tokens", "include_stop_str_in_output", "pdd")
# Fields that describe the caller or ask for something pdd cannot change: accepted, no effect.
WITHOUT_EFFECT = ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
                  "service_tier", "metadata", "max_tool_calls", "stream_options")
# Fields pdd does not honour, each with the values that ask for nothing; any other is a 400.
NOT_HONOURED: dict[str, tuple[object, ...]] = {
    "background": (False,), "conversation": (), "prompt": (), "truncation": ("disabled",),
    "context_management": ([],), "moderation": (), "reasoning": ({},),
}
OWN_FIELDS = ("input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "stream", "store",
              "previous_response_id", "include", "top_logprobs")
KNOWN_FIELDS = frozenset((*CHAT_FIELDS, *WITHOUT_EFFECT, *NOT_HONOURED, *OWN_FIELDS))


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request checked and turned into a chat body, with what the response echoes."""

    chat_body: Json
    items: list[Json]  # the conversation's items so far (stored history, then this input), normalised
    stream: bool
    store: bool
    instructions: str | None
    tools: list[Json]  # as the response shows them: {type, name, description, parameters, strict}
    tool_choice: object
    text_format: Json
    top_logprobs: int | None  # None: no logprobs asked for
    metadata: Mapping[str, object]
    previous_response_id: str | None
    message_sources: list[str] = field(default_factory=list)  # chat messages[i] came from this field

    def echo(self) -> Json:
        """The request's fields as a response object repeats them."""
        body = self.chat_body
        return {"instructions": self.instructions, "tools": self.tools, "tool_choice": self.tool_choice,
                "text": {"format": self.text_format}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                "max_output_tokens": body.get("max_completion_tokens"), "top_logprobs": self.top_logprobs or 0,
                "previous_response_id": self.previous_response_id, "store": self.store,
                "metadata": dict(self.metadata), "truncation": "disabled", "background": False,
                "reasoning": {"effort": None, "summary": None}, "service_tier": "default"}

    def rename(self, exc: InvalidParam) -> InvalidParam:
        """A chat parser's error, naming the Responses field it came from."""
        param = responses_param(exc.param, self.message_sources)
        if param == exc.param:
            return exc
        message = str(exc).replace(exc.param or "", param or "") if exc.param else str(exc)
        renamed = InvalidParam(param, message)
        renamed.code = exc.code
        return renamed


def to_chat_request(body: object, history: Sequence[Json] = (), previous_response_id: str | None = None) -> \
        ResponsesRequest:
    """Check a Responses body and build its chat body; `history`: the items of the response that
    `previous_response_id` names (its own history, input and output), already checked."""
    if not isinstance(body, dict):
        raise InvalidParam(None, "request body must be a JSON object")
    _refuse_unknown(body)
    chat: Json = {name: body[name] for name in CHAT_FIELDS if body.get(name) is not None}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidParam("instructions", "instructions must be a string")
    items = [*history, *_input_items(body.get("input"))]
    messages, sources = chat_messages(items, len(history))
    if instructions:  # OpenAI: a previous response's instructions are not carried over, only these
        messages, sources = [{"role": "system", "content": instructions}, *messages], ["instructions", *sources]
    chat["messages"] = messages
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
                         for tool in tools]
    tool_choice = body.get("tool_choice")
    if tool_choice is not None:
        chat["tool_choice"] = _tool_choice(tool_choice)
    text_format = _text_format(body.get("text"))
    if text_format["type"] != "text":
        chat["response_format"] = _response_format(text_format)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    top_logprobs = _logprobs(body.get("include"), body.get("top_logprobs"))
    if top_logprobs is not None and tools and tool_choice != "none":
        # a token's logprob belongs to the text it made; text read as a function call is not output_text
        raise InvalidParam("include", f"{LOGPROBS_INCLUDE} cannot be combined with function tools unless "
                                      "tool_choice is 'none'")
    if top_logprobs is not None:
        chat["logprobs"], chat["top_logprobs"] = True, top_logprobs
    stream = _bool(body, "stream", False)
    chat["stream"] = stream
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidParam("metadata", "metadata must be an object of strings")
    return ResponsesRequest(
        chat_body=chat, items=items, stream=stream, store=_bool(body, "store", True), instructions=instructions,
        tools=tools, tool_choice="auto" if tool_choice is None else tool_choice, text_format=text_format,
        top_logprobs=top_logprobs, metadata=metadata or {}, previous_response_id=previous_response_id,
        message_sources=sources)


def responses_param(param: str | None, message_sources: Sequence[str] = ()) -> str | None:
    """The Responses field a chat field came from (`message_sources[i]`: chat messages[i]'s)."""
    if param is None:
        return None
    if match := re.fullmatch(r"messages\[(\d+)\](\.content)?.*", param):
        index = int(match[1])
        source = message_sources[index] if index < len(message_sources) else "input"
        return source + (match[2] or "") if source.startswith("input[") else source
    if param == "messages":
        return "input"
    if match := re.fullmatch(r"tools\[(\d+)\]\.function(\..*)?", param):
        return f"tools[{match[1]}]{match[2] or ''}"
    if param.startswith("tool_choice.function"):
        return "tool_choice" + param.removeprefix("tool_choice.function")
    if param.startswith("response_format"):
        rest = param.removeprefix("response_format").removeprefix(".json_schema")
        return "text.format" + rest
    if param in ("max_completion_tokens", "max_tokens"):
        return "max_output_tokens"
    if param == "logprobs":
        return "include"
    return param


# ---- fields ----

def _refuse_unknown(body: Mapping[str, object]) -> None:
    refuse_unknown_fields(body, KNOWN_FIELDS, "responses")
    for name, neutral in NOT_HONOURED.items():
        value = body.get(name)
        if value is not None and value not in neutral and not (name == "reasoning" and _all_null(value)):
            raise InvalidParam(name, f"{name} is not supported by this server; leave it out"
                                     + (f" (or at {json.dumps(neutral[0])})" if neutral else ""))


def _all_null(value: object) -> bool:
    return isinstance(value, dict) and all(v is None for v in value.values())


def _bool(body: Mapping[str, object], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParam(name, f"{name} must be true or false")
    return value


def _tools(tools: object) -> list[Json]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidParam("tools", "tools must be a list of {type: 'function', name, parameters} objects")
    out: list[Json] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidParam(where, f"{where} must be an object")
        if tool.get("type") != "function":
            raise InvalidParam(f"{where}.type", f"{where}.type {tool.get('type')!r} is not supported: this server "
                                                "serves function tools only")
        extra = sorted(set(tool) - {"type", "name", "description", "parameters", "strict", "defer_loading",
                                    "allowed_callers", "output_schema"})
        if extra:
            raise InvalidParam(f"{where}.{extra[0]}", f"{where}: unknown fields {extra}")
        if tool.get("defer_loading") not in (None, False):
            raise InvalidParam(f"{where}.defer_loading", f"{where}.defer_loading (tool search) is not supported")
        if tool.get("allowed_callers") not in (None, ["direct"]):
            raise InvalidParam(f"{where}.allowed_callers", f"{where}.allowed_callers: only ['direct'] is supported")
        # output_schema describes what the client's function returns: it never changes the model's answer
        out.append({"type": "function", **{k: tool[k] for k in ("name", "description", "parameters", "strict")
                                           if tool.get(k) is not None}})
    return out


def _tool_choice(choice: object) -> object:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if set(choice) - {"type", "name"}:
            raise InvalidParam("tool_choice", "tool_choice must be {type: 'function', name}")
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise InvalidParam("tool_choice", "tool_choice must be 'none', 'auto', 'required' or {type: 'function', name}"
                                      + (f"; {kind!r} is not supported" if kind else ""))


def _text_format(text: object) -> Json:
    if text is None:
        return {"type": "text"}
    if not isinstance(text, dict):
        raise InvalidParam("text", "text must be an object with a format")
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise InvalidParam(f"text.{extra[0]}", f"text: unknown fields {extra}")
    if text.get("verbosity") is not None:
        raise InvalidParam("text.verbosity", "text.verbosity is not supported by this server; leave it out")
    text_format = text.get("format")
    if text_format is None:
        return {"type": "text"}
    if not isinstance(text_format, dict):
        raise InvalidParam("text.format", "text.format must be an object with a type")
    return text_format


def _response_format(text_format: Json) -> Json:
    """text.format as chat's response_format (which checks it and builds its grammar)."""
    kind = text_format.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise InvalidParam("text.format.type", "text.format.type must be one of 'text', 'json_object', "
                                               "'json_schema'")
    extra = sorted(set(text_format) - {"type", "name", "schema", "strict", "description"})
    if extra:
        raise InvalidParam(f"text.format.{extra[0]}", f"text.format: unknown fields {extra}")
    spec = {k: text_format[k] for k in ("name", "schema", "strict", "description") if k in text_format}
    return {"type": "json_schema", "json_schema": spec}


def _logprobs(include: object, top_logprobs: object) -> int | None:
    """How many alternatives beside each token's logprob; None: no logprobs (not included)."""
    if include is not None and (not isinstance(include, list) or not all(isinstance(i, str) for i in include)):
        raise InvalidParam("include", "include must be a list of strings")
    for value in include or []:
        if value != LOGPROBS_INCLUDE and value not in INERT_INCLUDES:
            raise InvalidParam("include", f"include {value!r} is not one of {[LOGPROBS_INCLUDE, *INERT_INCLUDES]}")
    if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                                     or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
        raise InvalidParam("top_logprobs", f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}")
    if LOGPROBS_INCLUDE in (include or []):
        return top_logprobs or 0
    if top_logprobs:
        raise InvalidParam("top_logprobs", f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]")
    return None


# ---- input items ----

def _input_items(value: object) -> list[Json]:
    """This request's input as normalised items (a string is one user message)."""
    if isinstance(value, str):
        if not value:
            raise InvalidParam("input", "input is empty")
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidParam("input", "input must be a string or a non-empty list of items")
    return [_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _item(item: object, where: str) -> Json:
    if not isinstance(item, dict):
        raise InvalidParam(where, f"{where} must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    if item.get("status") not in ITEM_STATUSES:
        raise InvalidParam(f"{where}.status", f"{where}.status must be one of {list(ITEM_STATUSES[1:])}")
    unknown = sorted(set(item) - ITEM_KEYS.get(str(kind), set(item)))
    if unknown:
        raise InvalidParam(f"{where}.{unknown[0]}", f"{where}: this server does not take {unknown} in a {kind} item")
    if kind == "message":
        return _message_item(item, where)
    if kind == "function_call":
        call_id, name, arguments = (_string(item, key, where) for key in ("call_id", "name", "arguments"))
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise InvalidParam(f"{where}.arguments", f"{where}.arguments must be a string holding a JSON object")
        return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text_of(output, ("input_text",), f"{where}.output")
        return {"type": "function_call_output", "call_id": _string(item, "call_id", where), "output": text}
    raise InvalidParam(f"{where}.type", f"{where}.type {kind!r} is not supported: this server takes message, "
                                        "function_call and function_call_output items")


def _message_item(item: Mapping[str, object], where: str) -> Json:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise InvalidParam(f"{where}.role", f"{where}.role must be one of {list(MESSAGE_ROLES)}")
    content = item.get("content")
    text = content if isinstance(content, str) else _text_of(content, TEXT_PART_TYPES[str(role)], f"{where}.content")
    return {"type": "message", "role": role, "content": text}


def _text_of(parts: object, types: tuple[str, ...], where: str) -> str:
    """Text parts joined with newlines, as chat joins its text parts."""
    if not isinstance(parts, list):
        raise InvalidParam(where, f"{where} must be a string or a list of {list(types)} parts")
    texts: list[str] = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in types:
            raise InvalidParam(f"{where}[{j}].type", f"{where}[{j}].type {kind!r} is not supported here; this server "
                                                     f"takes {list(types)} parts (text only)")
        assert isinstance(part, dict)
        unknown = sorted(set(part) - PART_KEYS)
        if unknown:
            raise InvalidParam(f"{where}[{j}].{unknown[0]}", f"{where}[{j}]: this server does not take {unknown} "
                                                             f"in a {kind} part")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise InvalidParam(f"{where}[{j}]", f"{where}[{j}] must have a string text")
        texts.append(text)
    return "\n".join(texts)


def _string(item: Mapping[str, object], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value and key != "arguments":
        raise InvalidParam(f"{where}.{key}", f"{where}.{key} must be a non-empty string")
    return value


def chat_messages(items: Sequence[Json], history_count: int = 0) -> tuple[list[Json], list[str]]:
    """Normalised items as chat messages, and for each message the field it came from: an assistant
    message and the function calls after it are one assistant turn with tool_calls; each call's
    output a tool message. The first `history_count` items are a stored response's."""
    messages: list[Json] = []
    sources: list[str] = []
    calls: set[str] = set()
    for i, item in enumerate(items):
        where = "previous_response_id" if i < history_count else f"input[{i - history_count}]"
        last = messages[-1] if messages else None
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"]})
            sources.append(where)
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            calls.add(str(item["call_id"]))
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text and calls
                last.setdefault("tool_calls", []).append(call)  # type: ignore[attr-defined]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(where)
        else:
            if item["call_id"] not in calls:
                raise InvalidParam(f"{where}.call_id", f"{where}.call_id {item['call_id']!r} answers no "
                                                       "function_call before it")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            sources.append(where)
    return messages, sources
