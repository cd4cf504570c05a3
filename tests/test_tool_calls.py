"""Tool calling at the gateway: tools and tool_choice checked naming the field, tool history rendered
through the chat template, tool calls read out of the answer the same whole or streamed."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import jsonschema
import pytest
import torch

from services.gateway.http.request_parsing import _chat_message
from services.gateway.http.tool_calls import (
    AnswerShape,
    ParsedAnswer,
    ToolCallStream,
    ToolChoice,
    parse_answer,
    parse_tool_request,
    render_chat,
    template_takes_tools,
)
from shared.errors import BadRequest
from shared.grammar import ConstraintKind, answer_format
from shared.grammar_masks import GrammarCompiler
from shared.models import ensure_smollm2_tokenizer, load_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                  "required": ["x", "y"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
NAMES = {"get_weather", "add"}
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city":"Rome","unit":"celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "21C"}]},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
ANSWERS = [
    "The sky is blue because of Rayleigh scattering. <b>Really</b> < 3 <tool",
    f"Let me check.\n{CALL}",
    f"{CALL}\n{CALL.replace('Paris', 'Rome')}\n",
    f'{CALL}\n<tool_call>\n{{"name": "nope", "arguments": {{}}}}\n</tool_call> and <tool_call>not json</tool_call>!',
    f'  Before {CALL} between <tool_call>{{"name": "add", "arguments": {{"x": 1, "y": 2}}}}',
    "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"x\": 1",
    "",
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer(ensure_smollm2_tokenizer())


def counter_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


# ---- tools and tool_choice ----

@pytest.mark.parametrize("tools, tool_choice, param", [
    ("get_weather", None, "tools"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "function", "function": {"name": "get weather"}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "description": 5}}], None, "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, "tools[0].function.strict"),
    ([ADD, {"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools[1].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "paramters": {"type": "object"}}}], None,
     "tools[0].function.paramters"),  # else a tool that takes nothing
    ([{"type": "function", "function": {"name": "f"}, "strict": True}], None, "tools[0].strict"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([], {"type": "function", "function": {"name": "add"}}, "tool_choice"),
])
def test_bad_tools_and_tool_choice_name_the_field(tools: object, tool_choice: object, param: str) -> None:
    with pytest.raises(BadRequest) as raised:
        parse_tool_request(tools, tool_choice)
    assert raised.value.param == param  # type: ignore[attr-defined]


def test_each_tool_choice_and_its_grammar() -> None:
    assert parse_tool_request(None, None) is None and parse_tool_request([], "auto") is None
    auto = parse_tool_request(TOOLS, None)
    assert auto.choice is ToolChoice.AUTO and auto.constraint is None and auto.names == NAMES
    none = parse_tool_request(TOOLS, "none")
    assert none.constraint is None and none.names == frozenset()
    required = parse_tool_request(TOOLS, "required")
    assert required.constraint.kind is ConstraintKind.TOOL_CALLS and required.names == NAMES
    named = parse_tool_request(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert named.choice is ToolChoice.NAMED and named.names == {"add"} and named.constraint is not None
    no_parameters = parse_tool_request([{"type": "function", "function": {"name": "now"}}], "required")
    assert no_parameters.tools[0].parameters == {"type": "object", "properties": {}, "additionalProperties": False}
    assert (auto.shape, required.shape, named.shape) == (AnswerShape.FREE, AnswerShape.CALLS, AnswerShape.CALLS)


def test_beside_a_response_format_auto_is_calls_or_the_answer_and_forced_calls_stay_calls() -> None:
    fmt = answer_format({"type": "json_object"})
    auto = parse_tool_request(TOOLS, "auto", answer=fmt)
    assert auto.shape is AnswerShape.CALLS_OR_ANSWER and auto.constraint.kind is ConstraintKind.TOOL_CALLS_OR_JSON
    required = parse_tool_request(TOOLS, "required", answer=fmt)
    assert required.shape is AnswerShape.CALLS
    assert required.constraint == parse_tool_request(TOOLS, "required").constraint
    assert parse_tool_request(TOOLS, "none", answer=fmt).constraint is None  # response_format's own grammar serves


# ---- rendering ----

def test_smollm2_renders_tools_and_tool_history_in_the_hermes_format(smollm2_tokenizer) -> None:
    assert not template_takes_tools(smollm2_tokenizer)
    prompt = render_chat(HISTORY, parse_tool_request([WEATHER], "auto"), native=False, text_message=_chat_message)
    assert prompt.tools is None and all(set(m) == {"role", "content"} for m in prompt.messages)
    text = smollm2_tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
    signature = json.dumps(WEATHER)
    assert text.startswith(f"<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the "
                           f"user query.\n\nYou are provided with function signatures within <tools></tools> XML "
                           f"tags:\n<tools>\n{signature}\n</tools>\n\n")
    assert text.endswith(
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL}\n{CALL.replace('Paris', 'Rome')}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_a_system_message_keeps_its_text_and_gains_the_tools(smollm2_tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    prompt = render_chat(messages, parse_tool_request([ADD], "required"), native=False, text_message=_chat_message)
    assert prompt.messages[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert len(prompt.messages) == 2
    none = render_chat(messages, parse_tool_request([ADD], "none"), native=False, text_message=_chat_message)
    assert none.messages == messages  # tool_choice "none": the model is not told of the tools


def test_a_template_that_takes_tools_gets_them_natively(smollm2_tokenizer) -> None:
    tokenizer = load_tokenizer(ensure_smollm2_tokenizer())
    tokenizer.chat_template = (
        "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}{{ '\\n' }}{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
        "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}{{ '\\n' }}{% endfor %}")
    assert template_takes_tools(tokenizer)
    prompt = render_chat(HISTORY, parse_tool_request(TOOLS, "auto"), native=True, text_message=_chat_message)
    assert prompt.tools == TOOLS
    text = tokenizer.apply_chat_template(prompt.messages, tools=prompt.tools, tokenize=False)
    assert text == ("TOOLS get_weather,add\nuser: Weather in Paris and Rome?\n"
                    "assistant:  CALL get_weather(Paris) CALL get_weather(Rome)\n"
                    "tool: 18C [call_1]\ntool: 21C [call_2]\n")


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{x"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "[1]"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"type": "function"}]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": "add"}, "messages[1].tool_calls"),
    ({"role": "tool", "tool_call_id": 5, "content": "x"}, "messages[1].tool_call_id"),
    ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),  # OpenAI refuses it too
    ({"role": "tool", "tool_call_id": "", "content": "x"}, "messages[1].tool_call_id"),
    ({"role": "tool", "tool_call_id": "call_1", "content": 5}, "messages[1].content"),
])
def test_bad_tool_history_names_the_field(message: dict, param: str) -> None:
    with pytest.raises(BadRequest) as raised:
        render_chat([{"role": "user", "content": "hi"}, message], None, native=False, text_message=_chat_message)
    assert raised.value.param == param  # type: ignore[attr-defined]


# ---- parsing the answer ----

def test_parsing_calls_out_of_an_answer() -> None:
    plain = parse_answer("  Just text.\n", NAMES)
    assert plain.content == "Just text." and plain.tool_calls == []
    one = parse_answer(f"Let me check.\n{CALL}", NAMES, counter_ids())
    assert one.content == "Let me check."
    assert one.tool_calls == [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]
    two = parse_answer(f"{CALL}\n{CALL}\n", NAMES)
    assert two.content is None and len(two.tool_calls) == 2 and two.tool_calls[0]["id"] != two.tool_calls[1]["id"]
    assert two.tool_calls[0]["id"].startswith("call_") and len(two.tool_calls[0]["id"]) == 29


def test_what_is_not_a_call_stays_content() -> None:
    unknown = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    assert parse_answer(unknown, NAMES) == ParsedAnswer(unknown, [])
    assert parse_answer("<tool_call>not json</tool_call>", NAMES).content == "<tool_call>not json</tool_call>"
    bad_arguments = '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
    assert parse_answer(bad_arguments, NAMES).content == bad_arguments
    unnamed = '<tool_call>\n{"call": "add", "arguments": {"x": 1'  # cut, and no call of ours began
    assert parse_answer(unnamed, NAMES).content == unnamed
    unclosed = '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}'  # EOS before the close tag
    assert [c["function"]["name"] for c in parse_answer(unclosed, NAMES).tool_calls] == ["add"]
    assert parse_answer(CALL, frozenset()).content == CALL  # tool_choice "none": nothing is a call


@pytest.mark.parametrize("shape", [AnswerShape.FREE, AnswerShape.CALLS, AnswerShape.CALLS_OR_ANSWER])
def test_a_call_cut_by_length_is_a_call_with_its_arguments_cut(shape: AnswerShape) -> None:
    """As OpenAI returns one: the name, and the arguments as far as they came (finish_reason length)."""
    def read(text: str, names: frozenset[str] = frozenset(NAMES)) -> ParsedAnswer:
        return parse_answer(text, names, counter_ids(), shape=shape)

    cut = read('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert cut == ParsedAnswer(None, [{"id": "call_0", "type": "function",
                                       "function": {"name": "get_weather", "arguments": '{"city": "Par'}}])
    whole_arguments = read(f'{CALL}\n<tool_call>\n{{"name": "add", "arguments": {{"x": 1, "y": 2}}')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_arguments.tool_calls] == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("add", '{"x": 1, "y": 2}')]
    in_the_name = read('<tool_call>\n{"name": "get_w')  # only one tool fits what came
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in in_the_name.tool_calls] == [
        ("get_weather", "")]
    assert read('<tool_call>\n{"name": "ad', frozenset({"add", "adjust"})).tool_calls == []  # two fit: no call
    assert read('<tool_call>\n{"name": "add", "arguments": {"x": "1<').tool_calls[0]["function"]["arguments"] == \
        '{"x": "1<'  # a "<" in the arguments stays, though "</tool_call>" could begin with it
    for cut in range(1, len("\n</tool_call>")):  # cut in the closing tag: the call is whole, and no tag in it
        assert read(CALL[:-cut]).tool_calls[0]["function"]["arguments"] == '{"city": "Paris", "unit": "celsius"}'


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "ad', "<tool_ca", "<tool_call>", f"{CALL}\n<tool",
                                  '<tool_call>\n{"name": "nope"}\n</tool_call>'])
def test_where_a_grammar_wrote_calls_no_markup_is_ever_content(text: str) -> None:
    names = frozenset({"add", "adjust", "get_weather"})
    for shape in (AnswerShape.CALLS, AnswerShape.CALLS_OR_ANSWER):
        assert parse_answer(text, names, shape=shape).content is None, shape
        for cut in range(len(text) + 1):
            stream = ToolCallStream(names, shape=shape)
            deltas = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
            assert not [d for d in deltas if "content" in d], (shape, cut)


def test_an_answer_in_the_response_format_is_never_read_for_calls() -> None:
    answer = '{"note": "<tool_call>\\n{\\"name\\": \\"add\\"}</tool_call>"}'
    assert parse_answer(answer, NAMES, shape=AnswerShape.CALLS_OR_ANSWER) == ParsedAnswer(answer, [])
    assert parse_answer(CALL, NAMES, shape=AnswerShape.CALLS_OR_ANSWER).tool_calls


def stream_all(pieces: list[str]) -> tuple[str | None, list[dict]]:
    stream = ToolCallStream(NAMES, counter_ids())
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    content = "".join(d["content"] for d in deltas if "content" in d) or None
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == list(range(len(calls))) == list(range(stream.calls_made))
    return content, [{k: v for k, v in c.items() if k != "index"} for c in calls]


@pytest.mark.parametrize("answer", ANSWERS)
def test_streaming_gives_the_same_answer_at_every_split(answer: str) -> None:
    whole = parse_answer(answer, NAMES, counter_ids())
    expected = (whole.content, whole.tool_calls)
    assert stream_all(list(answer)) == expected
    for cut in range(len(answer) + 1):
        assert stream_all([answer[:cut], answer[cut:]]) == expected, cut
    for a, b in itertools.combinations(range(0, len(answer) + 1, 7), 2):
        assert stream_all([answer[:a], answer[a:b], answer[b:]]) == expected, (a, b)


def test_a_plain_answer_streams_token_by_token(smollm2_tokenizer) -> None:
    text = "Rayleigh scattering makes the sky blue: short waves scatter more, so 1 < 2 and <b> is fine."
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    stream, shown = ToolCallStream(NAMES), ""
    for n in range(1, len(ids) + 1):
        before = smollm2_tokenizer.decode(ids[:n - 1])
        shown += "".join(d["content"] for d in stream.feed(smollm2_tokenizer.decode(ids[:n])[len(before):]))
        so_far = smollm2_tokenizer.decode(ids[:n])
        held = next((k for k in range(len("<tool_call>") - 1, 0, -1) if "<tool_call>".startswith(so_far[-k:])), 0)
        assert shown == so_far[:len(so_far) - held].rstrip()  # only blanks and a possible "<tool_call" wait
    assert shown + "".join(d["content"] for d in stream.finish()) == text


def test_a_streamed_call_is_one_openai_delta() -> None:
    stream = ToolCallStream(NAMES, counter_ids())
    assert stream.feed("Checking.\n<tool_call>\n{\"name\": \"add\", ") == [{"content": "Checking."}]
    assert stream.feed('"arguments": {"x": 1, "y": 2}}\n</tool_call>') == [{"tool_calls": [
        {"index": 0, "id": "call_0", "type": "function",
         "function": {"name": "add", "arguments": '{"x": 1, "y": 2}'}}]}]
    assert stream.finish() == [] and stream.calls_made == 1


# ---- the grammar writes what the parser reads ----

@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_calls_from_random_logits_parse_as_tool_calls(smollm2_tokenizer, tiny_path: Path,
                                                            tool_choice: object) -> None:
    request = parse_tool_request(TOOLS, tool_choice)
    width = len(smollm2_tokenizer)
    grammars = GrammarCompiler.from_hf(smollm2_tokenizer, width)
    texts = smollm2_tokenizer.batch_decode([[i] for i in range(width)])
    tilt = torch.tensor([4.0 * any(c in t for c in '"{}[],:0123456789\n<>/') for t in texts])
    tilt[smollm2_tokenizer.eos_token_id] = 4.0
    for seed in range(4):
        state, generator, out = grammars.new_state(request.constraint), torch.Generator().manual_seed(seed), []
        while not out or out[-1] != smollm2_tokenizer.eos_token_id:
            assert len(out) < 500
            logits = torch.randn(1, width, generator=generator) + tilt
            grammars.apply_masks(logits, [state])
            out.append(int(logits[0].argmax()))
            state.accept(out[-1])
        answer = parse_answer(smollm2_tokenizer.decode(out[:-1]), request.names)
        assert answer.content is None and answer.tool_calls
        if request.choice is ToolChoice.NAMED:
            assert len(answer.tool_calls) == 1
        for call in answer.tool_calls:
            assert call["function"]["name"] in request.names
            schema = next(t.parameters for t in request.tools if t.name == call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
