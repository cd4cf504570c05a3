"""Constrained decoding, the gateway's half: what a constraint is, built and validated from a request.

The gateway turns `response_format` or a forced tool call into a `Constraint` (an llguidance grammar,
validated there so a bad one is a 400, never a decoder failure); it travels with the request as
`to_dict()`. Decoders apply it with `shared/grammar_masks.py`. This module imports neither torch
nor the tokenizer, so the gateway does not pay for them.

    gateway:  constraint = constraint_for_response_format(body["response_format"])   # or None
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, overload

import llguidance

from shared.errors import InvalidParam, PddError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON exactly as json.dumps writes it: fixed separators and no free whitespace, so a model (even a
# random one) cannot spend its tokens on blanks, and two tiers agree on one spelling.
JSON_STYLE: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for json_schema and function names
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # the Hermes / Qwen2.5 tool-call format


class InvalidConstraint(InvalidParam):
    """A response_format or tool definition the grammar library refuses; `param` names the field."""


class GrammarDiverged(PddError):
    """A token the grammar refuses arrived: the tiers disagree on the answer so far, or a mask was skipped."""

    code = "grammar_diverged"


class ConstraintKind(str, Enum):
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    TOOL_CALLS = "tool_calls"
    TOOL_CALLS_OR_JSON = "tool_calls_or_json"  # tool_choice "auto" beside a response_format


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    grammar: str  # an llguidance grammar (its JSON form), already validated

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind.value, "grammar": self.grammar}

    @classmethod
    def from_dict(cls, d: Mapping[str, str]) -> Constraint:
        return cls(ConstraintKind(d["kind"]), d["grammar"])


# ---- building constraints (gateway, at request time) ----

@dataclass(frozen=True)
class AnswerFormat:
    """What `response_format` asks the answer's text to be: JSON, or JSON following a schema."""

    kind: ConstraintKind  # JSON_OBJECT or JSON_SCHEMA
    schema: dict[str, object]  # closed (closed_objects); {"type": "object"} for json_object
    param: str  # the field that gave the schema, for errors

    def constraint(self) -> Constraint:
        return Constraint(self.kind, _json_grammar(self.schema, self.param))


def answer_format(response_format: object) -> AnswerFormat | None:
    """OpenAI's `response_format`, checked: None for text. `{"type": "json_object", "schema": {...}}`
    (Fireworks' and Together's spelling) is honoured as that schema, never silently widened to any object."""
    if not isinstance(response_format, Mapping):
        raise InvalidConstraint("response_format", "response_format must be an object with a type")
    kind = response_format.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidConstraint("response_format.type",
                                "response_format.type must be one of 'text', 'json_object', 'json_schema'")
    allowed = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}[kind]
    _no_unknown_keys(response_format, allowed, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        if schema is None:
            return AnswerFormat(ConstraintKind.JSON_OBJECT, {"type": "object"}, "response_format")
        if not isinstance(schema, Mapping):
            raise InvalidConstraint("response_format.schema", "response_format.schema must be a JSON schema object")
        return AnswerFormat(ConstraintKind.JSON_SCHEMA, closed_objects(schema), "response_format.schema")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise InvalidConstraint("response_format.json_schema",
                                "response_format.json_schema must be an object with name and schema")
    _no_unknown_keys(spec, {"name", "description", "schema", "strict"}, "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise InvalidConstraint("response_format.json_schema.name", "response_format.json_schema.name must be "
                                "1 to 64 letters, digits, underscores or dashes")
    if spec.get("strict") not in (None, True, False):
        raise InvalidConstraint("response_format.json_schema.strict",
                                "response_format.json_schema.strict must be a boolean")
    # strict or not, the schema is enforced: OpenAI's non-strict mode only promises less.
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise InvalidConstraint("response_format.json_schema.schema",
                                "response_format.json_schema.schema must be a JSON schema object")
    return AnswerFormat(ConstraintKind.JSON_SCHEMA, closed_objects(schema), "response_format.json_schema.schema")


def constraint_for_response_format(response_format: object) -> Constraint | None:
    """OpenAI's `response_format`: None for text, a constraint for json_object and json_schema."""
    fmt = answer_format(response_format)
    return None if fmt is None else fmt.constraint()


def check_json_schema(schema: Mapping[str, object], param: str) -> None:
    """Raise InvalidConstraint naming `param` if llguidance cannot compile `schema`."""
    _json_grammar(schema, param)


def constraint_for_tool_calls(parameters_by_name: Mapping[str, Mapping[str, object]], *,
                              only: str | None = None, single: bool = False,
                              or_answer: AnswerFormat | None = None) -> Constraint:
    """One or more Hermes tool calls to any of the tools (tool_choice "required"; exactly one when
    `single`, parallel_tool_calls false), or exactly one call to the tool named `only` (a named
    tool_choice); with `or_answer` (tool_choice "auto" beside a response_format), either those calls
    or an answer in that format. Each call is, then the answer ends:

        <tool_call>\n{"name": "<name>", "arguments": <that tool's parameters schema>}\n</tool_call>

    calls separated by one newline. `parameters_by_name`: each tool's `parameters` schema (already
    checked with check_json_schema). Each schema is a JSON grammar of its own, so its `#/$defs/...`
    refer to its own root, as they do when the schema stands alone.
    """
    names = [only] if only is not None else list(parameters_by_name)
    if not names:
        raise InvalidConstraint("tools", "tool calls need at least one tool")
    functions = [f"fn_{i}" for i in range(len(names))]
    repeat = "" if only is not None or single else ' ("\\n" call)*'
    rules = [f"calls: call{repeat}",
             f"call: {json.dumps(TOOL_CALL_OPEN + chr(10))} ({' | '.join(functions)}) "
             f"{json.dumps(chr(10) + TOOL_CALL_CLOSE)}"]
    for i, name in enumerate(names):
        head = json.dumps({"name": name, "arguments": None})[:-len("null}")]  # '{"name": "<name>", "arguments": '
        rules.append(f"fn_{i}: {json.dumps(head)} args_{i} \"}}\"")
        rules.append(f"args_{i}: %json {_styled(closed_objects(parameters_by_name[name]))}")
    if or_answer is None:
        start = "start: calls"
    else:
        start = "start: calls | answer"
        rules.append(f"answer: %json {_styled(or_answer.schema)}")
    grammar = llguidance.LLMatcher.grammar_from_lark("\n".join([start, *rules]) + "\n")
    _check(grammar, "tool_choice" if only is not None else "tools")
    kind = ConstraintKind.TOOL_CALLS if or_answer is None else ConstraintKind.TOOL_CALLS_OR_JSON
    return Constraint(kind, grammar)


def _styled(schema: Mapping[str, object]) -> str:
    return json.dumps({**schema, "x-guidance": JSON_STYLE})


def _no_unknown_keys(spec: Mapping[str, object], allowed: set[str], param: str) -> None:
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise InvalidConstraint(f"{param}.{unknown[0]}", f"{param} has unknown fields {unknown}; it takes "
                                                         f"{sorted(allowed)}")


@overload
def closed_objects(schema: Mapping[str, object]) -> dict[str, object]: ...
@overload
def closed_objects(schema: object) -> object: ...
def closed_objects(schema: object) -> object:
    """The schema with every object that lists its `properties` closed to others unless it says
    otherwise (`additionalProperties` false), as vLLM's xgrammar does in its default strict mode: a
    schema that names its fields means those fields, and a model must not wander into keys of its own."""
    if isinstance(schema, Mapping):
        closed: dict[str, object]
        closed = {key: ({name: closed_objects(sub) for name, sub in value.items()}  # names, not a schema
                        if key in ("properties", "$defs", "definitions") and isinstance(value, Mapping)
                        else closed_objects(value))
                  for key, value in schema.items()}
        if "properties" in closed and "additionalProperties" not in closed and "patternProperties" not in closed:
            closed["additionalProperties"] = False
        return closed
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    return schema


def _json_grammar(schema: Mapping[str, object], param: str) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(dict(schema), overrides=JSON_STYLE)
    except (ValueError, TypeError) as exc:
        raise InvalidConstraint(param, f"{param} is not a usable JSON schema: {exc}") from None
    _check(grammar, param)
    return grammar


def _check(grammar: str, param: str) -> None:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidConstraint(param, f"{param} cannot be enforced: {first_line(error)}")


def first_line(error: str) -> str:
    """The first line of an llguidance error, which names the problem (the rest is its context)."""
    return error.strip().splitlines()[0] if error.strip() else "unknown error"
