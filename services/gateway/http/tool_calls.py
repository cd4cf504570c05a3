"""Tool calling for the chat API: checking `tools` and `tool_choice`, rendering tools and tool history
for the chat template, and reading tool calls out of the model's text, whole or streamed.

Pure functions and one streaming class; knows nothing of HTTP or of how the answer is made. The
model's tool-call format is Hermes / Qwen2.5 (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`); "required" and a named function are enforced by the grammar in `ToolRequest.constraint`,
"auto" reads whatever the model wrote (beside a response_format, a grammar makes it calls or the
answer), "none" reads nothing. Our markup never reaches a client as content where a grammar wrote it.

    request = parse_tool_request(body.get("tools"), body.get("tool_choice"), answer=answer_format(...))
    prompt = render_chat(messages, request, native=template_takes_tools(tokenizer), text_message=...)
    tokenizer.apply_chat_template(prompt.messages, tools=prompt.tools, add_generation_prompt=True, ...)
    answer = parse_answer(text, request.names, shape=request.shape)  |  stream = ToolCallStream(...)
"""
from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from shared.grammar import (
    SCHEMA_NAME,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    AnswerFormat,
    Constraint,
    InvalidConstraint,
    check_json_schema,
    constraint_for_tool_calls,
)

FUNCTION_KEYS = ("name", "description", "parameters", "strict")  # OpenAI's FunctionDefinition
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters left out
ID_ALPHABET = string.ascii_letters + string.digits

Json = dict[str, object]
TextMessage = Callable[[object, int], dict[str, str]]


class InvalidTools(InvalidConstraint):
    """A bad `tools`, `tool_choice` or tool message; `param` names the field."""


class ToolChoice(str, Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}


class AnswerShape(str, Enum):
    """What an answer's text may be, which decides how it is read for calls."""

    FREE = "free"  # "auto": text, with calls anywhere in it (the model's own choice)
    CALLS = "calls"  # "required" or named: calls and nothing else (a grammar's); no text is content
    CALLS_OR_ANSWER = "calls_or_answer"  # "auto" beside response_format: calls, or an answer never read for calls


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: Json  # a JSON schema, checked by llguidance

    def to_openai(self) -> Json:
        function: Json = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: ToolChoice
    forced_name: str | None = None  # the function a NAMED choice calls
    # the grammar: for REQUIRED and NAMED, and for AUTO beside a response_format (calls or the answer)
    constraint: Constraint | None = field(default=None, compare=False)
    shape: AnswerShape = AnswerShape.FREE

    @property
    def names(self) -> frozenset[str]:
        """The functions a call may name; empty when tool_choice is "none" (nothing is read as a call)."""
        if self.choice is ToolChoice.NONE:
            return frozenset()
        return frozenset([self.forced_name]) if self.forced_name else frozenset(t.name for t in self.tools)


# ---- the request: tools and tool_choice ----

def parse_tool_request(tools: object, tool_choice: object, *, parallel: bool = True,
                       answer: AnswerFormat | None = None) -> ToolRequest | None:
    """OpenAI's `tools` and `tool_choice`; None when there are no tools (and no choice that needs one).
    `parallel` (parallel_tool_calls): "required" (or "auto" beside `answer`) may make several calls;
    false: exactly one. `answer`: the response_format, as OpenAI serves it beside tools: with "auto"
    the answer is calls or JSON in that format (one grammar); "required" and a named function force
    calls, and the format shapes no text of this answer (there is none), only a later turn's."""
    parsed = _tools(tools)
    if not parsed:
        if tool_choice in (None, "none", "auto"):
            return None
        raise InvalidTools("tool_choice", "tool_choice needs tools; there are none")
    choice, name = _tool_choice(tool_choice, {t.name for t in parsed})
    parameters = {t.name: t.parameters for t in parsed}
    if choice in (ToolChoice.REQUIRED, ToolChoice.NAMED):
        constraint = constraint_for_tool_calls(parameters, only=name, single=not parallel)
        return ToolRequest(parsed, choice, name, constraint, AnswerShape.CALLS)
    if choice is ToolChoice.AUTO and answer is not None:
        constraint = constraint_for_tool_calls(parameters, single=not parallel, or_answer=answer)
        return ToolRequest(parsed, choice, name, constraint, AnswerShape.CALLS_OR_ANSWER)
    return ToolRequest(parsed, choice, name)


def _tools(tools: object) -> tuple[Tool, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise InvalidTools("tools", "tools must be a list of {type: 'function', function: {...}} objects")
    parsed: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise InvalidTools(f"{where}.type", f"{where} must be an object with type 'function'")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidTools(f"{where}.function", f"{where}.function must be an object with a name")
        _known_keys(tool, ("type", "function"), where)
        # a misspelt "parameters" would otherwise make a tool that takes none
        _known_keys(function, FUNCTION_KEYS, f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not SCHEMA_NAME.match(name):
            raise InvalidTools(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, "
                                                         "digits, underscores or dashes")
        if any(t.name == name for t in parsed):
            raise InvalidTools(f"{where}.function.name", f"{where}.function.name: {name!r} is defined twice")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidTools(f"{where}.function.description", f"{where}.function.description must be a string")
        if function.get("strict") not in (None, True, False):
            raise InvalidTools(f"{where}.function.strict", f"{where}.function.strict must be a boolean")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = NO_PARAMETERS
        elif not isinstance(parameters, Mapping):
            raise InvalidTools(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema "
                                                               "object")
        check_json_schema(parameters, f"{where}.function.parameters")
        parsed.append(Tool(name, description, dict(parameters)))
    return tuple(parsed)


def _known_keys(spec: Mapping[str, object], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise InvalidTools(f"{where}.{unknown[0]}", f"{where} has unknown fields {unknown}; it takes {list(known)}")


def _tool_choice(choice: object, names: set[str]) -> tuple[ToolChoice, str | None]:
    if choice is None:
        return ToolChoice.AUTO, None
    if choice in ("none", "auto", "required"):
        return ToolChoice(choice), None
    function = choice.get("function") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    if not isinstance(function, Mapping):
        raise InvalidTools("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                          "{type: 'function', function: {name}}")
    name = function.get("name")
    if name not in names:
        raise InvalidTools("tool_choice.function.name", f"tool_choice.function.name {name!r} is not one of the "
                                                        f"tools: {sorted(names)}")
    return ToolChoice.NAMED, str(name)


# ---- the prompt: tools, assistant tool_calls and tool messages through the chat template ----

@dataclass(frozen=True)
class ChatPrompt:
    messages: list[Json]
    tools: list[Json] | None  # pass as apply_chat_template(..., tools=tools)


def template_takes_tools(tokenizer: object) -> bool:
    """Whether the model's chat template renders `tools` itself (SmolLM2's does not)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def render_chat(messages: object, request: ToolRequest | None, *, native: bool,
                text_message: TextMessage) -> ChatPrompt:
    """The conversation for apply_chat_template. `native`: the template takes tools (template_takes_tools),
    so tools, assistant tool_calls and tool messages go to it in Hugging Face's shape; otherwise they
    are written out in the Hermes format as plain {role, content} messages. `text_message(message, i)`
    checks and flattens every other message (the gateway's own rule for roles and content)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidTools("messages", "messages must be a non-empty list of {role, content} objects")
    offered = request is not None and request.choice is not ToolChoice.NONE
    rendered: list[Json] = []
    for i, message in enumerate(messages):
        fields: Mapping[str, object] = message if isinstance(message, Mapping) else {}
        if fields.get("role") == "tool":
            content = text_message({"role": "user", "content": fields.get("content")}, i)["content"]
            rendered.append(_tool_message(fields, i, content, native))
        elif fields.get("role") == "assistant" and fields.get("tool_calls") not in (None, []):
            content = text_message({"role": "assistant", "content": fields.get("content")}, i)["content"]
            calls = _history_calls(fields.get("tool_calls"), i)
            if native:
                rendered.append({"role": "assistant", "content": content, "tool_calls": calls})
            else:
                parts = ([content] if content else []) + [_call_text(call) for call in calls]
                rendered.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            rendered.append(dict(text_message(message, i)))
    if native:
        return ChatPrompt(rendered, [t.to_openai() for t in request.tools] if offered and request else None)
    rendered = _tool_results_as_user_turns(rendered)
    if offered and request:
        rendered = _with_tools_in_system(rendered, request.tools)
    return ChatPrompt(rendered, None)


def _tool_message(message: Mapping[str, object], i: int, content: str, native: bool) -> Json:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidTools(f"messages[{i}].tool_call_id", f"messages[{i}].tool_call_id must be the id of the "
                                                          "call this tool message answers (a non-empty string)")
    if native:
        out: Json = {"role": "tool", "content": content, "tool_call_id": call_id}
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        return out
    return {"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"}


def _tool_results_as_user_turns(messages: list[Json]) -> list[Json]:
    """Hermes: consecutive tool results share one user turn, as Qwen2.5's template writes them."""
    out: list[Json] = []
    for i, message in enumerate(messages):
        if message["role"] != "tool":
            out.append(message)
        elif i > 0 and messages[i - 1]["role"] == "tool":
            out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{message['content']}"}
        else:
            out.append({"role": "user", "content": message["content"]})
    return out


def _history_calls(tool_calls: object, i: int) -> list[Json]:
    if not isinstance(tool_calls, list):
        raise InvalidTools(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls must be a list")
    calls: list[Json] = []
    for j, call in enumerate(tool_calls):
        where = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidTools(where, f"{where} must be {{id, type: 'function', function: {{name, arguments}}}}")
        arguments = function.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise InvalidTools(f"{where}.function.arguments", f"{where}.function.arguments must be a string "
                                                              "holding a JSON object")
        out: Json = {"type": "function", "function": {"name": function["name"], "arguments": parsed}}
        if isinstance(call.get("id"), str):
            out["id"] = call["id"]
        calls.append(out)
    return calls


def _call_text(call: Json) -> str:
    function = call["function"]
    assert isinstance(function, dict)
    body = json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def _with_tools_in_system(messages: list[Json], tools: Sequence[Tool]) -> list[Json]:
    signatures = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    block = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
             "You are provided with function signatures within <tools></tools> XML tags:\n"
             f"<tools>\n{signatures}\n</tools>\n\n"
             "For each function call, return a json object with function name and arguments within "
             "<tool_call></tool_call> XML tags:\n"
             '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


# ---- the answer: tool calls out of the model's text ----

def new_tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None  # the text outside the calls, stripped; None when there is none
    tool_calls: list[Json]  # OpenAI's message.tool_calls: {id, type: "function", function: {name, arguments}}


def parse_answer(text: str, names: Collection[str], new_id: Callable[[], str] = new_tool_call_id, *,
                 shape: AnswerShape = AnswerShape.FREE) -> ParsedAnswer:
    """The whole answer at once; the same result as streaming it through ToolCallStream."""
    stream = ToolCallStream(names, new_id, shape=shape)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(str(d["content"]) for d in deltas if "content" in d)
    calls = [call for d in deltas for call in d.get("tool_calls", [])]  # type: ignore[attr-defined]
    return ParsedAnswer(content or None, [{k: v for k, v in call.items() if k != "index"} for call in calls])


class ToolCallStream:
    """Text deltas in, OpenAI chat deltas out: {"content": str} and {"tool_calls": [{index, id, type,
    function: {name, arguments}}]} (each call whole, in one delta, once its </tool_call> arrives).

    Holds back only what could still become a call: a tail that may be the start of `<tool_call>`,
    an open block, and trailing whitespace (the content is stripped, as parse_answer strips it). A
    block that is not a call to one of `names` with a JSON object for arguments stays content, but
    a block the answer ends in (a length cut) that has begun a call to one of them is that call, its
    arguments cut, as OpenAI returns one. `shape` (AnswerShape): where a grammar wrote the answer,
    any text but a call is never content (a cut before a call's name is known, the piece of a tag),
    and an answer that does not begin with `<` is read as the answer, not for calls.
    """

    def __init__(self, names: Collection[str], new_id: Callable[[], str] = new_tool_call_id, *,
                 shape: AnswerShape = AnswerShape.FREE) -> None:
        self._names = frozenset(names)
        self._new_id = new_id
        self._shape = shape
        self._pending = ""
        self._in_block = False
        self._calls_made = 0
        self._content_started = False
        self._held_space = ""

    @property
    def calls_made(self) -> int:
        """Tool calls emitted so far (finish_reason is "tool_calls" when any)."""
        return self._calls_made

    def feed(self, text: str) -> list[Json]:
        self._pending += text
        if self._shape is AnswerShape.CALLS_OR_ANSWER:
            begun = self._pending.lstrip()
            if not begun:
                return []
            self._shape = AnswerShape.CALLS if begun.startswith("<") else AnswerShape.FREE
            if self._shape is AnswerShape.FREE:
                self._names = frozenset()  # the answer in the response_format: JSON, never read for calls
        if not self._names:
            text, self._pending = self._pending, ""
            return self._content(text)
        deltas: list[Json] = []
        while True:
            if self._in_block:
                end = self._pending.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return deltas
                body, self._pending = self._pending[:end], self._pending[end + len(TOOL_CALL_CLOSE):]
                self._in_block = False
                deltas += self._block(body, closed=True)
            else:
                start = self._pending.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = _prefix_tail(self._pending, TOOL_CALL_OPEN)
                    cut = len(self._pending) - keep
                    deltas += self._content(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    return deltas
                deltas += self._content(self._pending[:start])
                self._pending = self._pending[start + len(TOOL_CALL_OPEN):]
                self._in_block = True

    def finish(self) -> list[Json]:
        """The end of the answer: an unclosed block is a call if it has begun one (its arguments as
        far as they came), else content."""
        pending, self._pending = self._pending, ""
        if self._in_block:
            self._in_block = False
            return self._block(pending, closed=False)
        return self._content(pending)

    def _block(self, body: str, closed: bool) -> list[Json]:
        call = _call(body, self._names)
        if call is None and not closed:  # cut: in the closing tag (the call is whole), or in the call
            call = _call(body[:len(body) - _prefix_tail(body, TOOL_CALL_CLOSE)], self._names) or \
                _cut_call(body, self._names)
        if call is None:
            return self._content(TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else ""))
        name, arguments = call
        delta = {"index": self._calls_made, "id": self._new_id(), "type": "function",
                 "function": {"name": name, "arguments": arguments}}
        self._calls_made += 1
        return [{"tool_calls": [delta]}]

    def _content(self, text: str) -> list[Json]:
        if self._shape is AnswerShape.CALLS:
            return []  # the grammar writes calls and the newlines between them; a cut leaves pieces of tags
        if not self._content_started:
            text = text.lstrip()
            if not text:
                return []
            self._content_started = True
        body = text.rstrip()
        if not body:
            self._held_space += text
            return []
        out, self._held_space = self._held_space + body, text[len(body):]
        return [{"content": out}]


def _call(body: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) if `body` is {"name": one of names, "arguments": {...}}."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _cut_call(body: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, the arguments' text as far as it came) if `body`, cut, begins a call as the grammar and the
    prompt write one, `{"name": "<name>", "arguments": ...`, and only one of `names` fits what came."""
    text = body.lstrip()
    fits: list[tuple[str, str]] = []
    for name in names:
        head = json.dumps({"name": name, "arguments": None})[:-len("null}")]  # '{"name": "<name>", "arguments": '
        if text.startswith(head):
            fits.append((name, text[len(head):].rstrip()))
        elif head.startswith(text):
            fits.append((name, ""))
    return fits[0] if len(fits) == 1 else None


def _prefix_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
