"""Structured output and tool calls end to end on real processes (tiny model), with the clients
agents use: the answer follows its grammar whichever tier makes each token, and a request cut over
from RLD to MD (One-Shot or Catch-Up) gives the same tokens as one served by MD alone."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from langchain_core.tools import tool as langchain_tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tools.api_client import stream_completion

from helpers import random_prompt

MODEL = "tiny-llama"
SHARE_STACK = True  # its tests only send requests


class Forecast(BaseModel):
    """A weather forecast."""

    city: Literal["Paris", "Tokyo", "Lima"]
    days: int = Field(ge=1, le=7)
    rain: bool


FORECAST_TOOL = {"type": "function", "function": {
    "name": "get_forecast", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
# long enough that RLD's eager tokens, the cut and MD's tokens all fall inside the JSON
COLOURS = {"type": "object", "properties": {"colours": {
    "type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 12, "maxItems": 12}},
    "required": ["colours"], "additionalProperties": False}
COLOURS_FORMAT = {"type": "json_schema", "json_schema": {"name": "colours", "schema": COLOURS, "strict": True}}
USER = [{"role": "user", "content": "What is the weather in Lima this week?"}]


@pytest.fixture
async def client(stack):
    client = openai.AsyncOpenAI(base_url=stack.api_url + "/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


def body(prompt_ids: list[int], pipeline: str, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt_ids, "max_tokens": 120, "temperature": 0.9, "seed": 5,
            "response_format": COLOURS_FORMAT, "pdd": {"pipeline": pipeline, **extra}}


@pytest.mark.parametrize("handoff_mode", ["one-shot", "catch-up"])
async def test_a_schema_is_followed_and_token_exact_across_the_handoff(stack, session, handoff_mode):
    prompt_ids = random_prompt(300 + len(handoff_mode), 40)
    alone = await stream_completion(session, stack.api_url, body(prompt_ids, "p-md"))
    split = await stream_completion(session, stack.api_url, body(prompt_ids, "p-rld-md", handoff_at=6,
                                                                  handoff_mode=handoff_mode))
    assert split.token_ids == alone.token_ids
    assert split.tiers[:6] == ["relay"] * 6 and set(split.tiers[6:]) == {"main"}
    jsonschema.validate(json.loads(alone.text), COLOURS)
    assert alone.finish_reason == "stop"  # the grammar ended the answer, not max_tokens
    unconstrained = dict(body(prompt_ids, "p-md"), response_format=None)
    free = await stream_completion(session, stack.api_url, unconstrained)
    assert free.token_ids != alone.token_ids  # the random model left alone writes no such JSON


async def test_openai_parse_fills_a_pydantic_model_on_both_pipelines(client):
    answers = []
    for pipeline, extra in (("p-md", {}), ("p-rld-md", {"handoff_at": 4})):
        completion = await client.chat.completions.parse(
            model=MODEL, messages=USER, response_format=Forecast, max_tokens=60, temperature=0.7, seed=3,
            extra_body={"pdd": {"pipeline": pipeline, **extra}})
        forecast = completion.choices[0].message.parsed
        assert isinstance(forecast, Forecast) and 1 <= forecast.days <= 7
        answers.append(forecast)
    assert answers[0] == answers[1]


async def test_n_2_chat_choices_with_logprobs_are_the_same_on_both_pipelines(client):
    """n=2 with a JSON schema and top logprobs: two different valid answers, each choice the same
    tokens and (within float tolerance) the same logprobs served by MD alone or cut over from RLD."""
    runs = []
    for pipeline, extra in (("p-md", {}), ("p-rld-md", {"handoff_at": 4})):
        result = await client.chat.completions.create(
            model=MODEL, messages=USER, response_format={"type": "json_schema", "json_schema": {
                "name": "forecast", "schema": Forecast.model_json_schema(), "strict": True}},
            n=2, logprobs=True, top_logprobs=2, max_tokens=60, temperature=1.0, seed=5,
            extra_body={"pdd": {"pipeline": pipeline, **extra}})
        assert [c.index for c in result.choices] == [0, 1]
        for choice in result.choices:
            Forecast.model_validate_json(choice.message.content)
            assert [t.token for t in choice.logprobs.content] and all(
                len(t.top_logprobs) == 2 for t in choice.logprobs.content)
        runs.append(result.choices)
    md, split = runs
    assert md[0].message.content != md[1].message.content, "each choice draws with its own seed"
    for alone, cut in zip(md, split):
        assert cut.message.content == alone.message.content
        assert [t.token for t in cut.logprobs.content] == [t.token for t in alone.logprobs.content]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(alone.logprobs.content, cut.logprobs.content)) < 1e-4


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_forecast"}}])
async def test_a_forced_tool_call_is_a_valid_call_across_the_handoff(client, tool_choice):
    calls = []
    for pipeline, extra in (("p-md", {}), ("p-rld-md", {"handoff_at": 5})):
        result = await client.chat.completions.create(
            model=MODEL, messages=USER, tools=[FORECAST_TOOL, TIME_TOOL], tool_choice=tool_choice, max_tokens=80,
            temperature=0.8, seed=11, parallel_tool_calls=False,  # the random model would go on calling
            extra_body={"pdd": {"pipeline": pipeline, **extra}})
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            schema = {"get_forecast": FORECAST_TOOL, "get_time": TIME_TOOL}[call.function.name]["function"]
            jsonschema.validate(json.loads(call.function.arguments), schema["parameters"])
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in choice.message.tool_calls] == ["get_forecast"]
        calls.append([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])
    assert calls[0] == calls[1]


async def test_a_forced_tool_call_streams_as_tool_call_deltas(client):
    stream = await client.chat.completions.create(
        model=MODEL, messages=USER, tools=[FORECAST_TOOL], tool_choice="required", parallel_tool_calls=False,
        max_tokens=80, temperature=0, stream=True, extra_body={"pdd": {"pipeline": "p-rld-md", "handoff_at": 5}})
    chunks = [chunk async for chunk in stream]
    calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "get_forecast" and calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].function.arguments), FORECAST_TOOL["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


async def test_tool_history_goes_back_to_the_model(client):
    """An agent's second turn: the call it made and the tool's answer are in the prompt."""
    first = await client.chat.completions.create(model=MODEL, messages=USER, tools=[FORECAST_TOOL],
                                                 tool_choice="required", max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*USER, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    second = await client.chat.completions.create(model=MODEL, messages=history, tools=[FORECAST_TOOL],
                                                  max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


async def test_langchain_binds_tools_and_fills_structured_output(stack):
    llm = ChatOpenAI(model=MODEL, base_url=stack.api_url + "/v1", api_key="unused", max_retries=0,
                     temperature=0, max_tokens=80)

    @langchain_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time now in a zone."""
        return "12:00"

    message = await llm.bind_tools([get_time], tool_choice="required").ainvoke("What time is it?")
    assert [c["name"] for c in message.tool_calls], message
    assert {c["name"] for c in message.tool_calls} == {"get_time"}
    assert all(c["args"]["zone"] in ("UTC", "CET") for c in message.tool_calls)
    for method in ("function_calling", "json_schema"):
        forecast = await llm.with_structured_output(Forecast, method=method).ainvoke("Weather in Paris?")
        assert isinstance(forecast, Forecast), method
