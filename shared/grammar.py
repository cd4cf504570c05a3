"""Constrained decoding: what a constraint is, and how a decoder holds one per sequence.

The gateway turns `response_format` or a forced tool call into a `Constraint` (an llguidance grammar,
validated there so a bad one is a 400, never a decoder failure); it travels with the request as
`to_dict()`. Each decoder builds one `GrammarCompiler` from the HF tokenizer at start-up, a
`GrammarState` per constrained sequence, and masks a batch's logits with `apply_masks`. A decoder
that takes over mid-answer (handoff, Catch-Up, migration) `replay`s the tokens made before it, so its
state equals the first tier's. This module never samples and never ends a sequence itself.

    gateway:  constraint = constraint_for_response_format(body["response_format"])   # or None
    decoder:  grammars = GrammarCompiler.from_hf(hf_tokenizer, logits_width, eos_token_ids)   # once
              state = grammars.new_state(Constraint.from_dict(wire)); state.replay(earlier_ids)
              grammars.apply_masks(logits, [state or None per row]); ...; state.accept(token_id)
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, cast, overload

import llguidance
import llguidance.hf
import numpy as np
import torch

from shared.errors import InvalidParam, PddError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# JSON exactly as json.dumps writes it: fixed separators and no free whitespace, so a model (even a
# random one) cannot spend its tokens on blanks, and two tiers agree on one spelling.
JSON_STYLE: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for json_schema and function names
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # the Hermes / Qwen2.5 tool-call format
MATCHER_CACHE_SIZE = 64


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
        raise InvalidConstraint(param, f"{param} cannot be enforced: {_first_line(error)}")


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


# ---- applying constraints (decoder, on the engine thread) ----

class GrammarCompiler:
    """The model's vocabulary as llguidance sees it, built once per decoder (about 0.5 s), plus the
    thread pool and bitmask buffer for masking a batch. Engine thread only."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, logits_width: int) -> None:
        if tokenizer.vocab_size < logits_width:
            raise ValueError(f"the grammar tokenizer has {tokenizer.vocab_size} tokens, the logits {logits_width}")
        self.tokenizer = tokenizer
        self.logits_width = logits_width
        self._executor: llguidance.LLExecutor | None = None  # threads for masking many rows, made on first use
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)  # [rows, ceil(vocab / 32)], grown on demand
        self._matchers: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar -> pristine matcher

    @classmethod
    def from_hf(cls, hf_tokenizer: PreTrainedTokenizerBase, logits_width: int,
                eos_token_ids: Sequence[int] = ()) -> GrammarCompiler:
        """`logits_width`: the model's vocab_size, which may exceed len(tokenizer); the columns past
        the tokenizer are padding and never allowed. `eos_token_ids`: the tokens that may end a
        finished grammar (default: the tokenizer's EOS)."""
        n_vocab = max(logits_width, len(hf_tokenizer))
        eos = list(eos_token_ids) or None
        # AutoTokenizer gives a fast tokenizer (the kind llguidance reads); transformers types it as the base
        fast = cast("PreTrainedTokenizerFast", hf_tokenizer)
        return cls(llguidance.hf.from_tokenizer(fast, n_vocab=n_vocab, eos_token=eos), logits_width)

    def new_state(self, constraint: Constraint) -> GrammarState:
        pristine = self._matchers.get(constraint.grammar)
        if pristine is None:
            pristine = llguidance.LLMatcher(self.tokenizer, constraint.grammar, log_level=0)
            if pristine.is_error():
                raise InvalidConstraint(None, f"the grammar cannot be enforced: {_first_line(pristine.get_error())}")
            self._matchers[constraint.grammar] = pristine
            if len(self._matchers) > MATCHER_CACHE_SIZE:
                self._matchers.popitem(last=False)
        else:
            self._matchers.move_to_end(constraint.grammar)
        return GrammarState(pristine.deep_copy(), self)

    def apply_masks(self, logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
        """Set every token row i's grammar forbids to -inf in logits [rows, logits_width], in place.
        Rows whose state is None are untouched; when all are None nothing is computed or allocated."""
        rows = [i for i, state in enumerate(states) if state is not None]
        if not rows:
            return
        words = (self.tokenizer.vocab_size + 31) // 32
        if self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(max(len(rows), 2 * self._bitmask.shape[0]), words, dtype=torch.int32)
        bitmask = self._bitmask[:len(rows)]
        matchers = [(states[row]._matcher, k) for k, row in enumerate(rows)]  # type: ignore[union-attr]
        if len(matchers) == 1:
            matchers[0][0].unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(rows))
        allowed = _unpack(bitmask, logits.shape[1], logits.device)
        minus_inf = _minus_inf(logits)
        if len(rows) == logits.shape[0]:
            torch.where(allowed, logits, minus_inf, out=logits)  # faster than masked_fill_ on CPU
        else:
            index = torch.tensor(rows, device=logits.device)
            logits[index] = torch.where(allowed, logits[index], minus_inf)


def _unpack(bitmask: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
    """bitmask [rows, words] int32, bit j of word w allowing token 32w + j -> allowed [rows, width] bool."""
    if device.type == "cpu":  # numpy unpacks bits in a few microseconds; int32 words are little-endian
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :width]
        return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool)
    return _unpack_with_shifts(bitmask.to(device), width)


def _unpack_with_shifts(words: torch.Tensor, width: int) -> torch.Tensor:
    """_unpack on the logits' own device (a GPU): 4 bytes a word cross the bus, not 32."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :width].bool()


def _minus_inf(logits: torch.Tensor) -> torch.Tensor:
    key = (logits.device, logits.dtype)
    if key not in _MINUS_INF:
        _MINUS_INF[key] = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return _MINUS_INF[key]


_MINUS_INF: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


class GrammarState:
    """One sequence's place in its grammar. Made by GrammarCompiler.new_state."""

    def __init__(self, matcher: llguidance.LLMatcher, grammars: GrammarCompiler) -> None:
        self._matcher = matcher
        self._grammars = grammars
        self.tokens_accepted = 0

    def replay(self, token_ids: Sequence[int]) -> None:
        """Feed output tokens another tier made (in order; successive chunks may follow)."""
        token_ids = [int(t) for t in token_ids]
        taken = self._matcher.try_consume_tokens(token_ids)
        self.tokens_accepted += taken
        if taken < len(token_ids):
            self.accept(token_ids[taken])  # raises, with the matcher's reason

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token (an EOS ending a finished grammar is accepted too). After
        GrammarDiverged the state is spent: the sequence must end."""
        if not self._matcher.consume_token(int(token_id)):
            raise GrammarDiverged(f"output token {self.tokens_accepted} (id {token_id}) breaks the grammar: "
                                  f"{_first_line(self._matcher.get_error())}")
        self.tokens_accepted += 1

    @property
    def finished(self) -> bool:
        """The grammar is complete: only EOS is allowed next."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher gave up (a resource limit mid-answer); it then allows only EOS."""
        return _first_line(self._matcher.get_error()) if self._matcher.is_error() else None
