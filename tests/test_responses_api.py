"""The Responses API (POST /v1/responses): input items, instructions, function tools and text.format
served as the chat request they amount to, answered whole or as typed events in the shapes of the
openai client's types, every field it does not honour refused by name; and openai-agents, which
speaks it by default, run unmodified on P-MD and across a handoff on P-RLD-MD."""
from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic_ai
import pydantic_ai.models.openai
import pytest
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import Response, ResponseStreamEvent, response_create_params
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field, TypeAdapter
from pydantic_ai.providers.openai import OpenAIProvider

from services.gateway.http.generation import Step
from services.gateway.http.responses_items import KNOWN_FIELDS, chat_messages, responses_param, to_chat_request
from services.gateway.http.responses_store import ResponseStore
from services.gateway.http.responses_stream import ResponseOutput, as_input_items, responses_usage
from shared.errors import InvalidParam

MODEL = "tiny-llama"
SHARE_STACK = True  # its tests only send requests (the responses it stores are its own ids)
PIPELINES = (("p-md", {}), ("p-rld-md", {"handoff_at": 4}))  # the handoff falls inside the grammar

FORECAST_TOOL = {"type": "function", "name": "get_forecast", "description": "The weather forecast for a city",
                 "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                                                 "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}},
                                "required": ["city", "days"], "additionalProperties": False},
                 "strict": True}
QUESTION = "What is the weather in Lima this week?"
EVENT = TypeAdapter(ResponseStreamEvent)


class Forecast(BaseModel):
    """A weather forecast."""

    city: Literal["Paris", "Tokyo", "Lima"]
    days: int = Field(ge=1, le=7)
    rain: bool


@pytest.fixture
async def client(stack):
    client = openai.AsyncOpenAI(base_url=stack.api_url + "/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


# ---- the request as chat (no stack) ----

def test_input_items_become_the_chat_conversation() -> None:
    request = to_chat_request({
        "model": MODEL, "instructions": "Be brief.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Lima"},
                                         {"type": "input_text", "text": "and Paris?"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_forecast",
             "arguments": '{"city": "Lima", "days": 2}', "status": "completed"},
            {"type": "function_call", "call_id": "call_b", "name": "get_forecast", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_b",
             "output": [{"type": "input_text", "text": "rain"}]},
            {"role": "developer", "content": "Answer in JSON."}],
        "tools": [FORECAST_TOOL], "tool_choice": {"type": "function", "name": "get_forecast"},
        "text": {"format": {"type": "json_schema", "name": "forecast", "schema": Forecast.model_json_schema()}},
        "max_output_tokens": 50, "temperature": 0.5, "parallel_tool_calls": False, "store": False,
        "include": [], "metadata": {"k": "v"}, "user": "u1", "truncation": "disabled",
        "reasoning": {"effort": None}})
    chat = request.chat_body
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Lima\nand Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_forecast", "arguments": '{"city": "Lima", "days": 2}'}},
            {"id": "call_b", "type": "function",
             "function": {"name": "get_forecast", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
        {"role": "developer", "content": "Answer in JSON."}]
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in FORECAST_TOOL.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_forecast"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "forecast", "schema": Forecast.model_json_schema()}}
    assert (chat["max_completion_tokens"], chat["temperature"], chat["parallel_tool_calls"]) == (50, 0.5, False)
    assert "logprobs" not in chat and not request.store and request.metadata == {"k": "v"}
    assert request.message_sources == ["instructions", "input[0]", "input[1]", "input[4]", "input[5]", "input[6]"]


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "foo": 1}, "foo"),
    ({"input": "hi", "max_output_token": 3}, "max_output_token"),
    ({"input": ""}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": "n"}]},
     "input[0].namespace"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "cache": 1}]}]},
     "input[0].content[0].cache"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": ["hi", {"type": "reasoning", "summary": []}]}, "input[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{**FORECAST_TOOL, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"input": "hi", "tools": [FORECAST_TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "include": ["file_search_call.bogus"]}, "include"),
    ({"input": "hi", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "hi", "tools": [FORECAST_TOOL], "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "stream": "yes"}, "stream"),
    ({"input": "hi", "instructions": ["be brief"]}, "instructions"),
])
def test_what_is_not_honoured_is_refused_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(InvalidParam) as caught:
        to_chat_request(body)
    assert caught.value.param == param, caught.value


def test_every_field_of_the_openai_clients_responses_body_is_known_and_documented() -> None:
    fields = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    assert not fields - KNOWN_FIELDS, f"classify {sorted(fields - KNOWN_FIELDS)} in responses_items.py and docs/api.md"
    docs = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    section = docs[docs.index("## The Responses API"):]
    section = section[:section.index("\n## ")]
    undocumented = {name for name in KNOWN_FIELDS if f"`{name}`" not in section}
    assert not undocumented, f"docs/api.md's Responses API section does not answer {sorted(undocumented)}"


@pytest.mark.parametrize("chat_param, param", [
    ("messages[2].content", "input[1].content"), ("messages[0]", "instructions"), ("messages", "input"),
    ("tools[1].function.parameters", "tools[1].parameters"), ("tool_choice.function.name", "tool_choice.name"),
    ("response_format.json_schema.schema", "text.format.schema"), ("max_completion_tokens", "max_output_tokens"),
    ("temperature", "temperature"), ("pdd.handoff_at", "pdd.handoff_at"),
])
def test_a_chat_error_names_the_responses_field(chat_param: str, param: str) -> None:
    assert responses_param(chat_param, ["instructions", "input[0]", "input[1]"]) == param


def _step(index: int, text: str, finish: str | None = None) -> Step:
    return Step(index, 0, "main", text, finish, None)


def test_events_and_the_response_have_the_openai_clients_shapes() -> None:
    """Text, a call, text after it: a message, a function_call, a second message, every event one of
    the client's types with consecutive sequence numbers, the last one carrying the whole response."""
    request = to_chat_request({"input": QUESTION, "tools": [FORECAST_TOOL]})
    output = ResponseOutput("resp_1", 1, MODEL, request, None)
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_forecast", "arguments": '{"city": "Lima", "days": 2}'}}
    # each step's delta as the choice's ToolDeltas reads it (the tag held back, the call whole)
    deltas = [{"content": "Let me "}, {"content": "check."}, {}, {"tool_calls": [call]}, {"content": "\nDone"},
              {"content": "."}]
    events = output.start()
    for i, delta in enumerate(deltas):
        events += output.step(_step(i, "(read for calls)", "stop" if i == len(deltas) - 1 else None), delta)
    usage = {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15,
             "prompt_tokens_details": {"cached_tokens": 4}}
    events += output.finish("stop", responses_usage(usage), {"pipeline": "p-md"})
    parsed = [EVENT.validate_python(event) for event in events]
    assert [e.sequence_number for e in parsed] == list(range(len(events)))
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    response = Response.model_validate(events[-1]["response"])
    assert [item.type for item in response.output] == ["message", "function_call", "message"]
    assert response.output_text == "Let me check.Done."
    call_item = response.output[1]
    assert (call_item.name, call_item.call_id, json.loads(call_item.arguments)) == (
        "get_forecast", "call_1", {"city": "Lima", "days": 2})
    assert response.usage.input_tokens_details.cached_tokens == 4 and response.usage.total_tokens == 15
    assert response.status == "completed" and response.tools[0].name == "get_forecast"
    assert as_input_items(events[-1]["response"]["output"])[1] == {
        "type": "function_call", "call_id": call_item.call_id, "name": "get_forecast",
        "arguments": call_item.arguments}


def test_a_failure_after_the_first_event_is_a_response_failed_event() -> None:
    output = ResponseOutput("resp_3", 1, MODEL, to_chat_request({"input": "hi"}), None)
    events = output.start() + output.step(_step(0, "It")) + [output.failed("server_error", "MD was lost")]
    failed = EVENT.validate_python(events[-1])
    assert failed.type == "response.failed" and failed.sequence_number == len(events) - 1
    assert (failed.response.status, failed.response.error.code, failed.response.error.message) == (
        "failed", "server_error", "MD was lost")
    assert failed.response.output[0].content[0].text == "It"


def test_a_length_cut_is_an_incomplete_response() -> None:
    output = ResponseOutput("resp_2", 1, MODEL, to_chat_request({"input": "hi"}), None)
    events = output.start() + output.step(_step(0, "It", "length"))
    events += output.finish("length", {}, {})
    assert events[-1]["type"] == "response.incomplete"
    response = events[-1]["response"]
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"


def test_the_store_drops_the_least_recently_used_past_its_budget() -> None:
    store = ResponseStore(budget_bytes=700)  # three of these (226 bytes each)
    for i in range(3):
        store.put({"id": f"resp_{i}", "text": "x" * 200}, [])
    assert store.get("resp_0") is not None  # now the most recently used
    store.put({"id": "resp_3", "text": "x" * 200}, [])
    assert store.get("resp_1") is None and store.get("resp_0") is not None and store.size_bytes <= 700
    store.put({"id": "huge", "text": "x" * 2000}, [])
    assert store.get("huge") is None and len(store) == 3


def test_history_items_are_named_as_the_previous_response() -> None:
    messages, sources = chat_messages([{"type": "message", "role": "user", "content": "a"},
                                       {"type": "message", "role": "user", "content": "b"}], history_count=1)
    assert sources == ["previous_response_id", "input[0]"] and len(messages) == 2


# ---- served (the tiny model) ----

async def test_an_answer_is_the_chat_answer_to_the_same_conversation(client):
    kwargs = {"temperature": 0, "extra_body": {"pdd": {"pipeline": "p-md"}}}
    response = await client.responses.create(model=MODEL, instructions="Be brief.", input=QUESTION,
                                             max_output_tokens=12, **kwargs)
    chat = await client.chat.completions.create(model=MODEL, max_tokens=12, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}], **kwargs)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.instructions == "Be brief." and response.max_output_tokens == 12


async def test_logprobs_are_chat_logprobs_on_the_text_and_its_deltas(client):
    kwargs = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True}}
    response = await client.responses.create(input=QUESTION, include=["message.output_text.logprobs"],
                                             top_logprobs=2, max_output_tokens=6, **kwargs)
    chat = await client.chat.completions.create(messages=[{"role": "user", "content": QUESTION}], logprobs=True,
                                                top_logprobs=2, max_tokens=6, **kwargs)
    logprobs = response.output[0].content[0].logprobs
    assert [t.token for t in logprobs] == [t.token for t in chat.choices[0].logprobs.content]
    assert len(logprobs) == response.usage.output_tokens == 6 and all(len(t.top_logprobs) == 2 for t in logprobs)
    stream = await client.responses.create(input=QUESTION, include=["message.output_text.logprobs"], top_logprobs=2,
                                           max_output_tokens=6, stream=True, **kwargs)
    deltas = [e for e in [event async for event in stream] if e.type == "response.output_text.delta"]
    assert [t.token for e in deltas for t in e.logprobs] == [t.token for t in logprobs]


async def test_a_streamed_answer_is_the_whole_answer_event_by_event(client):
    """A JSON answer (its grammar ends it, so it completes) cut over from RLD to MD inside the JSON."""
    kwargs = {"model": MODEL, "input": QUESTION, "max_output_tokens": 60, "temperature": 0,
              "text": {"format": {"type": "json_schema", "name": "forecast", "schema": Forecast.model_json_schema(),
                                  "strict": True}},
              "extra_body": {"pdd": {"pipeline": "p-rld-md", "handoff_at": 5}}}
    whole = await client.responses.create(**kwargs)
    async with client.responses.stream(**kwargs) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                            "response.output_item.added", "response.content_part.added"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.completed"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text == events[-4].text
    Forecast.model_validate_json(deltas)
    assert final.usage.output_tokens == whole.usage.output_tokens
    summary = events[-1].response.model_extra["pdd"]
    assert summary["tokens_by_tier"]["relay"] == 5 and summary["tokens_by_tier"]["main"] > 0


async def test_a_length_cut_streams_response_incomplete(client):
    stream = await client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True}, stream=True)
    events = [event async for event in stream]
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 3


async def test_a_function_call_and_its_output_go_back_to_the_model(client):
    first = await client.responses.create(model=MODEL, input=QUESTION, tools=[FORECAST_TOOL], tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_forecast" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), FORECAST_TOOL["parameters"])
    assert first.status == "completed"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny"}'}
    chained = await client.responses.create(model=MODEL, previous_response_id=first.id, input=[output],
                                            tools=[FORECAST_TOOL], max_output_tokens=8, temperature=0)
    explicit = await client.responses.create(
        model=MODEL, input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), output],
        tools=[FORECAST_TOOL], max_output_tokens=8, temperature=0)
    assert explicit.usage.input_tokens > first.usage.input_tokens + 10
    assert chained.usage.input_tokens == explicit.usage.input_tokens  # the stored call is the same history
    # the chained prompt begins with the first one, which P's prefix cache kept
    assert chained.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2
    assert chained.output_text == explicit.output_text and chained.previous_response_id == first.id
    assert (await client.responses.retrieve(first.id)).output[0].call_id == call.call_id


async def test_a_forced_call_streams_as_function_call_events(client):
    async with client.responses.stream(
            model=MODEL, input=QUESTION, tools=[FORECAST_TOOL], max_output_tokens=80, temperature=0.8,
            tool_choice={"type": "function", "name": "get_forecast"},
            extra_body={"seed": 11, "pdd": {"pipeline": "p-rld-md", "handoff_at": 5}}) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    [arguments] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments.name == "get_forecast" and arguments.arguments == final.output[0].arguments
    jsonschema.validate(json.loads(arguments.arguments), FORECAST_TOOL["parameters"])


async def test_a_forced_call_cut_by_max_output_tokens_is_an_incomplete_call(client):
    for stream in (False, True):
        response = await client.responses.create(model=MODEL, input=QUESTION, tools=[FORECAST_TOOL],
                                                 tool_choice="required", max_output_tokens=16, temperature=0,
                                                 stream=stream)
        if stream:
            events = [event async for event in response]
            assert events[-1].type == "response.incomplete"
            response = events[-1].response
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        [call] = response.output
        assert call.type == "function_call" and call.name == "get_forecast" and call.status == "incomplete"
        assert call.arguments == "" or call.arguments.startswith("{")  # the JSON as far as it came
        with pytest.raises(ValueError):
            json.loads(call.arguments)


async def test_text_format_json_schema_is_followed_on_both_pipelines(client):
    answers = []
    for pipeline, extra in PIPELINES:
        response = await client.responses.parse(
            model=MODEL, input=QUESTION, text_format=Forecast, max_output_tokens=60, temperature=0.7,
            extra_body={"seed": 3, "pdd": {"pipeline": pipeline, **extra}})
        assert isinstance(response.output_parsed, Forecast), response.output_text
        answers.append(response.output_parsed)
    assert answers[0] == answers[1]


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "foo": 1}, "foo"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "bogus"}}]},
     "tools[0].parameters"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
     "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "previous_response_id": "resp_nobody"}, "previous_response_id"),
    ({"input": "hi", "model": "gpt-4o"}, "model"),
    ({"input": "hi", "pdd": {"pipelin": "p-md"}}, "pdd"),
])
async def test_a_bad_field_is_a_400_naming_it(stack, session, body, param):
    async with session.post(stack.api_url + "/v1/responses", json=body) as resp:
        error = (await resp.json())["error"]
        assert (resp.status, error["param"]) == (404 if param == "model" else 400, param), error


async def _responses_counted(session, stack, status: str) -> float:
    async with session.get(f"{stack.api_url}/metrics") as resp:
        text = await resp.text()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "pdd_http_responses_total" and sample.labels == {"route": "/v1/responses",
                                                                                   "status": status})


async def test_responses_are_counted_under_their_route(stack, session, client):
    before = {status: await _responses_counted(session, stack, status) for status in ("200", "400")}
    await client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model=MODEL, input="hi", max_output_tokens=0)
    after = {status: await _responses_counted(session, stack, status) for status in ("200", "400")}
    assert {status: after[status] - before[status] for status in after} == {"200": 1, "400": 1}


async def test_a_response_is_kept_until_deleted_unless_store_is_false(stack, session, client):
    kept = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert (await client.responses.retrieve(kept.id)).output_text == kept.output_text
    async with session.get(f"{stack.api_url}/v1/responses/{kept.id}?stream=true") as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "stream"
    await client.responses.delete(kept.id)
    not_kept = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    for response_id in (kept.id, not_kept.id):
        async with session.get(f"{stack.api_url}/v1/responses/{response_id}") as resp:
            error = (await resp.json())["error"]
            assert (resp.status, error["param"], error["code"]) == (404, "response_id", "response_not_found")
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(kept.id)
    with pytest.raises(openai.BadRequestError, match="no response with id") as refused:
        await client.responses.create(model=MODEL, input="hi", previous_response_id=kept.id)
    assert refused.value.code == "previous_response_not_found"  # what clients and proxies match to resend


# ---- openai-agents, unmodified, on the default Responses model ----

class Recorder:
    """Every response body the agent's client received (its pdd summary says which tiers served it)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def __call__(self, response: httpx.Response) -> None:
        if response.headers.get("content-type", "").startswith("application/json"):  # not a stream's events
            await response.aread()
            self.bodies.append(response.json())

    def check_tiers(self, extra: dict) -> None:
        """Every response was served by MD alone, or cut over from RLD at `handoff_at` (inside its grammar)."""
        assert self.bodies
        for body in self.bodies:
            assert body.get("object") == "response", body
            tiers = body["pdd"]["tokens_by_tier"]
            assert tiers["relay"] == (extra["handoff_at"] if extra else 0) and tiers["main"] > 0, body


async def _run(stack, pipeline: str, extra: dict, prompt: str, settings: dict | None = None, stream: bool = False,
               chain: bool = False, **agent: object):
    """Runner.run (or run_streamed) on an Agent whose model is openai-agents' OpenAIResponsesModel on
    our gateway; every whole response it got must have been served across the handoff asked for.
    `chain`: each turn sends only its new items and the previous turn's response id."""
    set_tracing_disabled(True)
    client, recorder = _recorded_client(stack)
    model_settings = ModelSettings(temperature=0, max_tokens=100, parallel_tool_calls=False,
                                   extra_body={"pdd": {"pipeline": pipeline, **extra}}, **(settings or {}))
    runner = Agent(name="forecaster", instructions="You answer weather questions.",
                   model=OpenAIResponsesModel(MODEL, client), model_settings=model_settings, **agent)
    try:
        if stream:
            result = Runner.run_streamed(runner, prompt, max_turns=4, auto_previous_response_id=chain)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(runner, prompt, max_turns=4, auto_previous_response_id=chain)
    finally:
        await client.close()
    if not stream:  # a stream's events are not recorded
        recorder.check_tiers(extra)
    return result, recorder.bodies


def _recorded_client(stack) -> tuple[openai.AsyncOpenAI, Recorder]:
    recorder = Recorder()
    return openai.AsyncOpenAI(base_url=stack.api_url + "/v1", api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(event_hooks={"response": [recorder]})), recorder


async def test_agents_fill_an_output_type_on_both_pipelines_whole_or_streamed(stack):
    outputs = []
    for pipeline, extra in PIPELINES:
        result, bodies = await _run(stack, pipeline, extra, QUESTION, output_type=Forecast)
        assert isinstance(result.final_output, Forecast) and len(bodies) == 1
        streamed, _ = await _run(stack, pipeline, extra, QUESTION, output_type=Forecast, stream=True)
        assert streamed.final_output == result.final_output
        outputs.append(result.final_output)
    assert outputs[0] == outputs[1]


def _time_tool(zones: list[str]) -> FunctionTool:
    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time now in a zone."""
        zones.append(zone)
        return f"12:00 {zone}"

    return get_time


async def test_agents_call_a_function_tool_on_both_pipelines(stack):
    """A forced call, run by the agent; its output is the final output (stop_on_first_tool: a random
    model's free text would not end before max_tokens, which the agent takes as a failure)."""
    runs = []
    for pipeline, extra in PIPELINES:
        zones: list[str] = []
        result, bodies = await _run(stack, pipeline, extra, "What time is it?", settings={"tool_choice": "required"},
                                    tools=[_time_tool(zones)], tool_use_behavior="stop_on_first_tool")
        assert len(zones) == 1 and result.final_output == f"12:00 {zones[0]}"
        assert [item["type"] for item in bodies[0]["output"]] == ["function_call"]
        runs.append(result.final_output)
    assert runs[0] == runs[1]


class Place(BaseModel):
    city: Literal["Paris", "Tokyo", "Lima"]
    zone: Literal["UTC", "CET"]


def _forecast_tool(places: list[Place]) -> FunctionTool:
    @function_tool
    def local_forecast(place: Place) -> str:
        """The forecast where a place is."""
        places.append(place)
        return "sunny"

    return local_forecast


async def test_agents_with_a_nested_model_tool_and_an_output_type_on_both_pipelines(stack):
    """Issue 42's pattern: a tool taking a nested model (a $defs schema), its call forced on the first
    turn, and an output_type (tools and text.format in one request) that ends the run."""
    runs = []
    for pipeline, extra in PIPELINES:
        places: list[Place] = []
        result, bodies = await _run(stack, pipeline, extra, QUESTION, settings={"tool_choice": "required"},
                                    tools=[_forecast_tool(places)], output_type=Forecast)
        assert places and isinstance(result.final_output, Forecast), bodies
        assert bodies[0]["output"][0]["type"] == "function_call" and len(bodies) >= 2
        runs.append((places, result.final_output))
        # the same run with the conversation kept here: each turn sends its new items and the last id
        chained_places: list[Place] = []
        chained, chained_bodies = await _run(stack, pipeline, extra, QUESTION, settings={"tool_choice": "required"},
                                             chain=True, tools=[_forecast_tool(chained_places)], output_type=Forecast)
        assert [b["previous_response_id"] for b in chained_bodies[1:]] == [b["id"] for b in chained_bodies[:-1]]
        assert [b["usage"]["input_tokens"] for b in chained_bodies] == [b["usage"]["input_tokens"] for b in bodies]
        assert (chained_places, chained.final_output) == (places, result.final_output)
    assert runs[0] == runs[1]


# ---- pydantic-ai's Responses model ----

@pytest.mark.parametrize("native", [False, True])
async def test_pydantic_ai_responses_model_fills_an_output_type_on_both_pipelines(stack, native):
    """pydantic-ai's OpenAIResponsesModel: its default ToolOutput is a forced call to final_result; its
    NativeOutput is text.format json_schema."""
    outputs = []
    for pipeline, extra in PIPELINES:
        client, recorder = _recorded_client(stack)
        model = pydantic_ai.models.openai.OpenAIResponsesModel(MODEL, provider=OpenAIProvider(openai_client=client))
        agent = pydantic_ai.Agent(model, output_type=pydantic_ai.NativeOutput(Forecast) if native else Forecast)
        try:
            result = await agent.run(QUESTION, model_settings={  # type: ignore[typeddict-unknown-key]
                "temperature": 0, "max_tokens": 80, "parallel_tool_calls": False,
                "extra_body": {"pdd": {"pipeline": pipeline, **extra}}})
        finally:
            await client.close()
        assert isinstance(result.output, Forecast)
        recorder.check_tiers(extra)
        kinds = [item["type"] for item in recorder.bodies[-1]["output"]]
        assert kinds == (["message"] if native else ["function_call"]), recorder.bodies
        outputs.append(result.output)
    assert outputs[0] == outputs[1]
