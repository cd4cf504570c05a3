"""Agent clients' own code paths, unmodified, against the tiny model (issue 42): openai's
`pydantic_function_tool` with a nested model, instructor's TOOLS mode, pydantic-ai with a tool and an
output type (its default ToolOutput and NativeOutput), openai-agents' chat completions model with a
tool and an output type, langchain-openai's bind_tools beside a response_format, and a forced call
cut by max_tokens. Each runs
on P-MD and on P-RLD-MD with the handoff inside the grammar (every answer is grammar-made here), and
gives the same result on both; the gateway's per-response tier counts prove each cut happened."""
from __future__ import annotations

import json
from enum import Enum

import httpx
import instructor
import openai
import pytest
from agents import Agent as OpenAIAgent
from agents import ModelSettings, OpenAIChatCompletionsModel, Runner, ToolCallItem, function_tool, set_tracing_disabled
from langchain_core.tools import tool as langchain_tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.exceptions import IncompleteToolCall
from pydantic_ai.messages import ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

MODEL = "tiny-llama"
SHARE_STACK = True  # its tests only send requests
HANDOFF_AT = 20  # the tiny tokenizer's `<tool_call>\n{"name": "draw_shape", "arguments": {` is about 18 tokens
PIPELINES = {"p-md": {"pipeline": "p-md"}, "p-rld-md": {"pipeline": "p-rld-md", "handoff_at": HANDOFF_AT}}
USER = [{"role": "user", "content": "Draw a small red square near the origin."}]


class Color(str, Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Point(BaseModel):
    x: int = Field(ge=0, le=9)
    y: int = Field(ge=0, le=9)


class Shape(BaseModel):
    """A shape to draw: pydantic writes Color and Point into the schema's $defs."""

    color: Color
    corner: Point
    filled: bool


class Verdict(BaseModel):
    """What the agent answers with: its own $defs (a Color of its own, a nested model)."""

    shade: Color
    at: Point
    done: bool


class Tiers:
    """The pdd summary of every whole JSON response a client got (who made how many tokens), read by
    a hook of the HTTP client `http`, which the clients under test are given."""

    def __init__(self) -> None:
        self.by_response: list[dict[str, int]] = []
        self.http = httpx.AsyncClient(event_hooks={"response": [self.on_response]}, timeout=120)

    async def on_response(self, response: httpx.Response) -> None:
        if response.headers.get("content-type", "").startswith("application/json"):
            await response.aread()
            pdd = response.json().get("pdd")
            if pdd is not None:
                self.by_response.append(pdd["tokens_by_tier"])

    def check(self, pipeline: str) -> None:
        """P-MD: MD made every token; P-RLD-MD: RLD made the first HANDOFF_AT, MD the rest."""
        assert self.by_response
        for tiers in self.by_response:
            if pipeline == "p-md":
                assert tiers["relay"] == 0 and tiers["main"] > 0, tiers
            else:
                assert tiers["relay"] == HANDOFF_AT and tiers["main"] > 0, tiers


@pytest.fixture
async def clients(stack):
    """openai.AsyncOpenAI per pipeline, each with its own Tiers; the pipeline rides in extra_body."""
    made: dict[str, tuple[openai.AsyncOpenAI, Tiers]] = {}
    for pipeline in PIPELINES:
        tiers = Tiers()
        made[pipeline] = (openai.AsyncOpenAI(base_url=stack.api_url + "/v1", api_key="unused", max_retries=0,
                                             http_client=tiers.http), tiers)
    yield made
    for client, tiers in made.values():
        await client.close()
        await tiers.http.aclose()


async def test_openai_pydantic_function_tool_with_a_nested_model_forced(clients):
    """Issue 42 item 1: `Pointer '/$defs/Color' does not exist` was the answer to this."""
    tool = openai.pydantic_function_tool(Shape, name="draw_shape")
    assert "$defs" in tool["function"]["parameters"]
    shapes = {}
    for pipeline, (client, tiers) in clients.items():
        completion = await client.chat.completions.parse(
            model=MODEL, messages=USER, tools=[tool],
            tool_choice={"type": "function", "function": {"name": "draw_shape"}}, max_tokens=80, temperature=0.8,
            seed=7, extra_body={"pdd": PIPELINES[pipeline]})
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "draw_shape" and isinstance(call.function.parsed_arguments, Shape)
        shapes[pipeline] = call.function.parsed_arguments
        tiers.check(pipeline)
    assert shapes["p-md"] == shapes["p-rld-md"]


async def test_instructor_tools_mode_fills_a_nested_model(clients):
    shapes = {}
    for pipeline, (client, tiers) in clients.items():
        patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
        shapes[pipeline] = await patched.chat.completions.create(
            model=MODEL, messages=USER, response_model=Shape, max_retries=0, max_tokens=80, temperature=0.8,
            seed=11, extra_body={"pdd": PIPELINES[pipeline]})
        assert isinstance(shapes[pipeline], Shape)
        tiers.check(pipeline)
    assert shapes["p-md"].model_dump() == shapes["p-rld-md"].model_dump()  # instructor keeps each raw response


def pydantic_ai_run(client: openai.AsyncOpenAI, pipeline: str, output_type: object, seed: int, max_tokens: int = 80):
    """An agent with one tool (taking a nested model) and an output type, as pydantic-ai's docs write one."""
    drawn: list[Shape] = []
    agent = Agent(OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client)), output_type=output_type)

    @agent.tool_plain
    def draw_shape(shape: Shape) -> str:
        """Draw a shape on the canvas."""
        drawn.append(shape)
        return "drawn"

    # one call an answer: the random model, free to go on, would call until max_tokens
    settings = {"temperature": 0.8, "seed": seed, "max_tokens": max_tokens, "parallel_tool_calls": False,
                "extra_body": {"pdd": PIPELINES[pipeline]}}
    return agent.run(USER[0]["content"], model_settings=settings,  # type: ignore[arg-type]
                     usage_limits=UsageLimits(request_limit=6)), drawn


def calls_made(result) -> list[tuple[str, dict]]:
    return [(part.tool_name, part.args_as_dict()) for message in result.all_messages() for part in message.parts
            if isinstance(part, ToolCallPart)]


# seeds with which the random model answers within a request or two (with others it calls draw_shape
# again and again: its choice of tool hardly depends on what the tool said)
@pytest.mark.parametrize("output, seed", [("tool_output", 4), ("native_output", 3)])
async def test_pydantic_ai_with_a_tool_and_an_output_type(clients, output, seed):
    """ToolOutput (pydantic-ai's default): tools [draw_shape, final_result], each with its own $defs,
    tool_choice "required". NativeOutput: response_format json_schema beside the tool, tool_choice
    "auto": one grammar of a call or the answer (issue 42 item 3; it was a 400)."""
    outcomes = {}
    for pipeline, (client, tiers) in clients.items():
        run, drawn = pydantic_ai_run(client, pipeline, Verdict if output == "tool_output" else NativeOutput(Verdict),
                                     seed=seed)
        result = await run
        assert isinstance(result.output, Verdict)
        names = [name for name, _ in calls_made(result)]
        assert set(names) <= {"draw_shape", "final_result"}
        assert len(drawn) == names.count("draw_shape")
        if output == "tool_output":
            assert names[-1] == "final_result"  # the answer came as the output tool's call
        else:
            assert "final_result" not in names  # the answer came as content, in the schema
        outcomes[pipeline] = (result.output, calls_made(result))
        tiers.check(pipeline)
    assert outcomes["p-md"] == outcomes["p-rld-md"]


async def test_pydantic_ai_sees_its_output_call_cut_by_max_tokens_as_an_incomplete_call(clients):
    """Issue 42 item 2 as pydantic-ai met it: the markup came as text, failed validation as output, and
    three retries later `Exceeded maximum output retries`. Now the cut call is a tool call, and
    pydantic-ai says what happened."""
    for pipeline, (client, _) in clients.items():
        run, drawn = pydantic_ai_run(client, pipeline, Verdict, seed=4, max_tokens=HANDOFF_AT + 6)
        with pytest.raises(IncompleteToolCall, match="exceeded while generating a tool call"):
            await run
        assert not drawn


def openai_agent(client: openai.AsyncOpenAI, pipeline: str) -> tuple[OpenAIAgent, list[Shape]]:
    """An openai-agents agent on the chat completions API, with one tool (a nested model) and an output type."""
    drawn: list[Shape] = []

    @function_tool
    def draw_shape(shape: Shape) -> str:
        """Draw a shape on the canvas."""
        drawn.append(shape)
        return "drawn"

    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0.8, max_tokens=80,
                             extra_args={"seed": 1}, extra_body={"pdd": PIPELINES[pipeline]})
    return OpenAIAgent(name="painter", instructions="Draw the shape, then say where it is.", tools=[draw_shape],
                       output_type=Verdict, model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                       model_settings=settings), drawn


async def test_openai_agents_on_chat_completions_calls_its_tool_then_answers_in_its_output_type(clients):
    """openai-agents sends response_format beside its tools. tool_choice "required" first: a forced
    call (the format waits for a later turn); the tool's output goes back, and openai-agents resets
    tool_choice, so the second request is "auto" beside response_format, one grammar of a call or
    the answer, and the random model answers. (openai-agents' default, the Responses API, is
    tests/test_responses_api.py's.)"""
    set_tracing_disabled(True)
    outcomes = {}
    for pipeline, (client, tiers) in clients.items():
        agent, drawn = openai_agent(client, pipeline)
        result = await Runner.run(agent, USER[0]["content"], max_turns=4)
        assert isinstance(result.final_output, Verdict) and len(drawn) == 1
        calls = [(item.raw_item.name, item.raw_item.arguments) for item in result.new_items
                 if isinstance(item, ToolCallItem)]
        assert [name for name, _ in calls] == ["draw_shape"]
        assert len(tiers.by_response) == 2
        outcomes[pipeline] = (result.final_output, calls, drawn)
        tiers.check(pipeline)
    assert outcomes["p-md"] == outcomes["p-rld-md"]


@pytest.mark.parametrize("tool_choice", [None, "draw_shape"], ids=["auto", "named"])
async def test_langchain_binds_a_tool_beside_a_response_format(stack, clients, tool_choice):
    """langchain-openai's bind_tools(..., response_format=Verdict) sends both (it was a 400): auto is a
    call or the parsed answer; a named tool_choice is that call, its nested arguments whole."""
    @langchain_tool
    def draw_shape(shape: Shape) -> str:
        """Draw a shape on the canvas."""
        return "drawn"

    messages = {}
    for pipeline, (_, tiers) in clients.items():
        llm = ChatOpenAI(model=MODEL, base_url=stack.api_url + "/v1", api_key="unused", max_retries=0,
                         temperature=0.8, seed=2, max_tokens=80, extra_body={"pdd": PIPELINES[pipeline]},
                         http_async_client=tiers.http)
        bound = llm.bind_tools([draw_shape], response_format=Verdict, tool_choice=tool_choice,
                               parallel_tool_calls=False)
        message = await bound.ainvoke(USER[0]["content"])
        parsed = message.additional_kwargs.get("parsed")
        if tool_choice is not None or message.tool_calls:
            assert [c["name"] for c in message.tool_calls] == ["draw_shape"] and parsed is None
            Shape.model_validate(message.tool_calls[0]["args"]["shape"])
        else:
            assert isinstance(parsed, Verdict)
        messages[pipeline] = ([(c["name"], c["args"]) for c in message.tool_calls], parsed, message.content)
        tiers.check(pipeline)
    assert messages["p-md"] == messages["p-rld-md"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_forced_call_cut_by_max_tokens_comes_back_as_tool_calls(clients, stream):
    """Issue 42 item 2: it came back as `<tool_call>` markup in content. As OpenAI: tool_calls with the
    arguments cut, finish_reason "length", in every choice of n."""
    tool = openai.pydantic_function_tool(Shape, name="draw_shape")
    request = {"model": MODEL, "messages": USER, "tools": [tool], "tool_choice": "required", "n": 2,
               "max_tokens": HANDOFF_AT + 6, "temperature": 1.0, "seed": 5}
    answers = {}
    for pipeline, (client, tiers) in clients.items():
        body = dict(request, extra_body={"pdd": PIPELINES[pipeline]})
        if stream:
            chunks = [chunk async for chunk in await client.chat.completions.create(**body, stream=True)]
            got = []
            for index in (0, 1):
                deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
                calls = [call for d in deltas for call in d.delta.tool_calls or []]
                got.append(("".join(d.delta.content or "" for d in deltas) or None,
                            [(c.function.name, c.function.arguments) for c in calls], deltas[-1].finish_reason))
        else:
            completion = await client.chat.completions.create(**body)
            got = [(c.message.content, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
                    c.finish_reason) for c in completion.choices]
            tiers.check(pipeline)
        assert len(got) == 2
        for content, calls, finish_reason in got:
            assert content is None and finish_reason == "length"
            [(name, arguments)] = calls
            assert name == "draw_shape" and arguments.startswith("{")
            with pytest.raises(json.JSONDecodeError):
                json.loads(arguments)  # cut: the client sees it is not whole
        answers[pipeline] = got
    assert answers["p-md"] == answers["p-rld-md"]
    assert answers["p-md"][0] != answers["p-md"][1], "each choice draws with its own seed"
