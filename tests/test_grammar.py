"""Constrained decoding: random and adversarial logits through GrammarState always give valid output;
a replay reaches the first tier's state; bad constraints are refused naming the field."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import orjson
import pytest
import torch

from shared.grammar import (
    Constraint,
    ConstraintKind,
    GrammarDiverged,
    InvalidConstraint,
    answer_format,
    check_json_schema,
    constraint_for_response_format,
    constraint_for_tool_calls,
)
from shared.grammar_masks import GrammarCompiler, GrammarState
from shared.models import ensure_smollm2_tokenizer, load_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                                     "days": {"type": "integer"}},
                    "required": ["city", "unit", "days"], "additionalProperties": False},
    "add": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"], "additionalProperties": False},
    # as pydantic writes a nested model and an enum: each tool's `#/$defs/...` is its own, and the
    # two `Color`s differ, so a grammar that resolved either against a shared root would be wrong
    "paint": {"$defs": {"Color": {"enum": ["red", "green"], "type": "string"},
                        "Point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9}},
                                  "required": ["x"]}},
              "type": "object", "properties": {"color": {"$ref": "#/$defs/Color"},
                                               "at": {"$ref": "#/$defs/Point"}},
              "required": ["color", "at"]},
    "fill": {"$defs": {"Color": {"enum": ["cyan", "magenta"], "type": "string"}},
             "type": "object", "properties": {"colors": {"type": "array", "items": {"$ref": "#/$defs/Color"},
                                                         "minItems": 1, "maxItems": 3}},
             "required": ["colors"]},
}
TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
MAX_TOKENS = 500


@dataclass
class Vocab:
    tokenizer: object
    grammars: GrammarCompiler
    width: int
    eos: int
    tilt: torch.Tensor  # [width] pushes random logits towards the tokens that could break JSON


@pytest.fixture(scope="module", params=["tiny", "smollm2", "padded"])
def vocab(request, tiny_path: Path) -> Vocab:
    """The tiny model's tokenizer, SmolLM2's, and a model whose logits are wider than its tokenizer."""
    tokenizer = load_tokenizer(ensure_smollm2_tokenizer() if request.param == "smollm2" else tiny_path)
    width = len(tokenizer) + (64 if request.param == "padded" else 0)
    if request.param == "tiny":
        width = json.loads((tiny_path / "config.json").read_text())["vocab_size"]
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    tilt = torch.zeros(width)
    tilt[:len(texts)] = torch.tensor([float(any(c in t for c in '"{}[],:0123456789\n<>/')) for t in texts])
    tilt[tokenizer.eos_token_id] = 1.0
    grammars = GrammarCompiler.from_hf(tokenizer, width, [tokenizer.eos_token_id])
    return Vocab(tokenizer, grammars, width, tokenizer.eos_token_id, tilt)


def generate(vocab: Vocab, constraint: Constraint, seed: int, greedy: bool) -> str:
    """Random logits (tilted by 4 towards punctuation, digits and EOS), masked, then picked greedily or
    sampled at temperature 0.5 (hotter, the random words outweigh the tilt and nothing closes)."""
    state = vocab.grammars.new_state(constraint)
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = torch.randn(1, vocab.width, generator=generator) + 4.0 * vocab.tilt
        vocab.grammars.apply_masks(logits, [state])
        if greedy:
            token = int(logits[0].argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits[0] / 0.5, -1), 1, generator=generator))
        state.accept(token)
        if token == vocab.eos:
            assert state.finished
            return vocab.tokenizer.decode(out)
        out.append(token)
    pytest.fail(f"no EOS in {MAX_TOKENS} tokens: {vocab.tokenizer.decode(out)!r}")


def allowed(vocab: Vocab, state: GrammarState) -> torch.Tensor:
    logits = torch.zeros(1, vocab.width)
    vocab.grammars.apply_masks(logits, [state])
    return torch.isfinite(logits[0])


def check_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict)


def check_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def check_tool_calls(text: str, names: set[str], most: int | None) -> None:
    bodies = TOOL_CALL.findall(text)
    assert "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies) == text
    assert 1 <= len(bodies) <= (most or len(bodies))
    for body in bodies:
        call = json.loads(body)
        assert list(call) == ["name", "arguments"] and call["name"] in names
        jsonschema.validate(call["arguments"], TOOLS[call["name"]])


CASES = {
    "json_object": (lambda: constraint_for_response_format({"type": "json_object"}), check_json_object),
    "json_schema": (lambda: constraint_for_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}), check_person),
    "named_tool": (lambda: constraint_for_tool_calls(TOOLS, only="get_weather"),
                   lambda text: check_tool_calls(text, {"get_weather"}, most=1)),
    "required_tools": (lambda: constraint_for_tool_calls(TOOLS), lambda text: check_tool_calls(text, set(TOOLS), None)),
    "named_tool_with_defs": (lambda: constraint_for_tool_calls(TOOLS, only="fill"),
                             lambda text: check_tool_calls(text, {"fill"}, most=1)),
    "calls_or_answer": (lambda: constraint_for_tool_calls(TOOLS, or_answer=answer_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})),
        lambda text: check_tool_calls(text, set(TOOLS), None) if text.startswith("<") else check_person(text)),
}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", list(CASES))
def test_random_logits_always_give_valid_output(vocab: Vocab, case: str, greedy: bool) -> None:
    build, check = CASES[case]
    constraint = build()
    for seed in range(3):
        check(generate(vocab, constraint, seed, greedy))


def test_replay_reaches_the_same_state(vocab: Vocab) -> None:
    constraint = CASES["required_tools"][0]()
    first = vocab.grammars.new_state(constraint)
    generator = torch.Generator().manual_seed(7)
    tokens, masks = [], []
    for _ in range(60):
        masks.append(allowed(vocab, first))
        logits = torch.randn(1, vocab.width, generator=generator) + 4.0 * vocab.tilt
        logits[0, vocab.eos] = float("-inf")  # keep going past the first call
        vocab.grammars.apply_masks(logits, [first])
        tokens.append(int(logits[0].argmax()))
        first.accept(tokens[-1])
    for cut in (0, 1, 17, 59):
        taker = vocab.grammars.new_state(constraint)
        taker.replay(tokens[:cut])
        assert torch.equal(allowed(vocab, taker), masks[cut])
        assert taker.tokens_accepted == cut
    catch_up = vocab.grammars.new_state(constraint)  # Catch-Up: the tokens arrive in chunks
    for start in range(0, 42, 7):
        catch_up.replay(tokens[start:start + 7])
    assert torch.equal(allowed(vocab, catch_up), masks[42])


def test_a_refused_replay_raises(vocab: Vocab) -> None:
    state = vocab.grammars.new_state(CASES["json_schema"][0]())
    with pytest.raises(GrammarDiverged, match="output token 1 .*breaks the grammar"):
        state.replay(vocab.tokenizer.encode('{"nickname": 1}', add_special_tokens=False))


def test_a_finished_grammar_allows_only_eos(vocab: Vocab) -> None:
    state = vocab.grammars.new_state(CASES["json_object"][0]())
    state.replay(vocab.tokenizer.encode('{"a": [1, "b"]}', add_special_tokens=False))
    assert state.finished
    assert allowed(vocab, state).nonzero().flatten().tolist() == [vocab.eos]


def test_padding_columns_are_never_allowed(vocab: Vocab) -> None:
    state = vocab.grammars.new_state(CASES["json_schema"][0]())
    state.replay(vocab.tokenizer.encode('{"name": "', add_special_tokens=False))
    mask = allowed(vocab, state)
    assert mask.sum() > 1000  # inside a string almost anything goes...
    assert not mask[len(vocab.tokenizer):].any()  # ...but never a column the tokenizer has no token for


def test_a_batch_masks_only_its_constrained_rows(vocab: Vocab) -> None:
    json_state = vocab.grammars.new_state(CASES["json_object"][0]())
    tool_state = vocab.grammars.new_state(CASES["named_tool"][0]())
    logits = torch.randn(3, vocab.width, generator=torch.Generator().manual_seed(0))
    free_row = logits[1].clone()
    vocab.grammars.apply_masks(logits, [json_state, None, tool_state])
    assert torch.equal(logits[1], free_row)
    assert torch.equal(torch.isfinite(logits[0]), allowed(vocab, json_state))
    assert torch.equal(torch.isfinite(logits[2]), allowed(vocab, tool_state))


def test_no_grammar_costs_nothing(vocab: Vocab) -> None:
    grammars = GrammarCompiler(vocab.grammars.tokenizer, vocab.width)
    logits = torch.randn(4, vocab.width)
    before = logits.clone()
    grammars.apply_masks(logits, [None] * 4)
    assert torch.equal(logits, before)
    assert grammars._bitmask.numel() == 0 and grammars._executor is None


def test_states_from_one_constraint_are_independent(vocab: Vocab) -> None:
    constraint = CASES["json_object"][0]()
    a, b = vocab.grammars.new_state(constraint), vocab.grammars.new_state(constraint)
    a.replay(vocab.tokenizer.encode('{"a": 1}', add_special_tokens=False))
    assert a.finished and not b.finished and b.tokens_accepted == 0


def test_a_constraint_round_trips_through_json() -> None:
    for build, _ in CASES.values():
        constraint = build()
        assert Constraint.from_dict(orjson.loads(orjson.dumps(constraint.to_dict()))) == constraint
    assert constraint_for_response_format({"type": "json_object"}).kind is ConstraintKind.JSON_OBJECT
    assert constraint_for_response_format({"type": "text"}) is None


def test_json_object_with_a_schema_follows_the_schema() -> None:
    """{"type": "json_object", "schema": ...} (Fireworks' and Together's spelling) is that schema, not any object."""
    fmt = answer_format({"type": "json_object", "schema": PERSON})
    assert fmt is not None and fmt.kind is ConstraintKind.JSON_SCHEMA and fmt.param == "response_format.schema"
    assert fmt.constraint() == constraint_for_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})


@pytest.mark.parametrize("response_format, param", [
    ("json", "response_format"),
    ({"type": "bogus"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "bogus"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "format": "no-such"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"$ref": "#/$defs/missing"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_object", "schema": {"type": "bogus"}}, "response_format.schema"),
    ({"type": "json_object", "schema": "x"}, "response_format.schema"),
    ({"type": "json_object", "json_schema": {"name": "p", "schema": PERSON}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strickt": True}},
     "response_format.json_schema.strickt"),
])
def test_a_bad_response_format_names_the_field(response_format: object, param: str) -> None:
    with pytest.raises(InvalidConstraint) as raised:
        constraint_for_response_format(response_format)
    assert raised.value.param == param


def test_each_tool_schema_keeps_its_own_defs(vocab: Vocab) -> None:
    """A call is checked against its own tool's $defs: `fill` takes its Color (cyan, magenta), never
    `paint`'s, and a $ref that only resolves against another tool's root is no schema at all."""
    state = vocab.grammars.new_state(constraint_for_tool_calls(TOOLS))
    good = '<tool_call>\n{"name": "fill", "arguments": {"colors": ["cyan"]}}\n</tool_call>'
    state.replay(vocab.tokenizer.encode(good, add_special_tokens=False))
    assert state.finished or allowed(vocab, state)[vocab.eos]
    wrong = vocab.grammars.new_state(constraint_for_tool_calls(TOOLS))
    with pytest.raises(GrammarDiverged):
        wrong.replay(vocab.tokenizer.encode('<tool_call>\n{"name": "fill", "arguments": {"colors": ["red"]}}',
                                            add_special_tokens=False))
    with pytest.raises(InvalidConstraint) as raised:
        check_json_schema({"properties": {"c": {"$ref": "#/$defs/Color"}}}, "tools[0].function.parameters")
    assert raised.value.param == "tools[0].function.parameters"
    tree = {"$defs": {"Node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/Node"}}}, "required": ["v", "kids"]}}, "$ref": "#/$defs/Node"}
    nested = vocab.grammars.new_state(constraint_for_tool_calls({**TOOLS, "tree": tree}, only="tree"))
    nested.replay(vocab.tokenizer.encode('<tool_call>\n{"name": "tree", "arguments": {"v": 1, "kids": [{"v": 2, '
                                         '"kids": []}]}}\n</tool_call>', add_special_tokens=False))
    assert allowed(vocab, nested)[vocab.eos]  # a recursive model: its root's $ref is the tool's own root


def test_calls_or_answer_admits_either_and_nothing_else(vocab: Vocab) -> None:
    constraint = constraint_for_tool_calls(TOOLS, single=True, or_answer=answer_format(
        {"type": "json_object", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                           "required": ["ok"]}}))
    assert constraint.kind is ConstraintKind.TOOL_CALLS_OR_JSON
    for text in ('{"ok": true}', '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}\n</tool_call>'):
        state = vocab.grammars.new_state(constraint)
        state.replay(vocab.tokenizer.encode(text, add_special_tokens=False))
        assert allowed(vocab, state)[vocab.eos], text
    for text in ('{"ok": 1}', 'Sure, {"ok": true}', '{"ok": true}<tool_call>'):
        with pytest.raises(GrammarDiverged):
            vocab.grammars.new_state(constraint).replay(vocab.tokenizer.encode(text, add_special_tokens=False))


def test_bad_tool_schemas_name_the_field() -> None:
    with pytest.raises(InvalidConstraint) as raised:
        check_json_schema({"type": "nope"}, "tools[1].function.parameters")
    assert raised.value.param == "tools[1].function.parameters"
    with pytest.raises(InvalidConstraint) as raised:
        constraint_for_tool_calls({})
    assert raised.value.param == "tools"


def test_the_gpu_unpacking_agrees_with_the_cpu_one() -> None:
    from shared.grammar_masks import _unpack, _unpack_with_shifts

    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 40), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    on_host = _unpack(bitmask, 1270, torch.device("cpu"))
    assert on_host.shape == (3, 1270)
    assert torch.equal(on_host, _unpack_with_shifts(bitmask, 1270))
    assert on_host[1, 37].item() == bool((bitmask[1, 1].item() >> 5) & 1)


def test_objects_that_name_their_properties_are_closed_unless_they_say_otherwise():
    from shared.grammar import closed_objects

    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "free": {"type": "object"},
                                               "open": {"type": "object", "properties": {},
                                                        "additionalProperties": True}},
              "$defs": {"item": {"properties": {"b": {}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a map of names, not a schema
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["free"]  # no properties listed: any object
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["$defs"]["item"]["additionalProperties"] is False
