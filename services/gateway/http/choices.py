"""The n-choice fan-out: a request's n answers, each a run of its own, started so that P computes
the prompt once, and read together as one stream of steps.

Owns the choices' runs and the tasks that read them; the answer's shapes and writing are not its own.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.gateway.http.generation import Generation, Step
from services.gateway.http.logprob_shapes import Logprobs
from services.gateway.http.response_shapes import Shapes, usage
from services.gateway.http.tool_deltas import ToolDeltas
from services.gateway.run.attempt import GenerationRequest
from shared.request_ids import new_request_id
from shared.sampling_params import choice_seed

if TYPE_CHECKING:
    from aiohttp import web
    from transformers import PreTrainedTokenizerBase

    from services.gateway.http.detokenizer import TokenStrings
    from services.gateway.http.request_parsing import ParsedRequest
    from services.gateway.http.tool_calls import ToolRequest
    from services.gateway.observe.request_telemetry import RequestTelemetry
    from services.gateway.routing.dispatcher import Dispatcher
    from shared.config import GatewayConfig

log = logging.getLogger(__name__)

Json = dict[str, object]


@dataclass(frozen=True)
class ChoiceContext:
    """What a choice needs of the gateway to start, read and account for its run."""

    dispatcher: Dispatcher
    tokenizer: PreTrainedTokenizerBase
    token_strings: TokenStrings
    config: GatewayConfig
    telemetry: RequestTelemetry


@dataclass
class Choice:
    """One of a request's n answers: its run turned into steps, and how its objects are shaped."""

    index: int
    generation: Generation
    shapes: Shapes
    tools: ToolRequest | None  # the tools its text is read for calls to (None: not read)
    tool_deltas: ToolDeltas | None

    @property
    def tool_names(self) -> frozenset[str]:
        """The functions a call in its text may name; empty when the text is not read for calls."""
        return frozenset() if self.tools is None else self.tools.names


class Choices:
    """A request's n choices, each a run of its own with choice_seed(seed, i). Choice 0 starts first;
    the others once P has reported it done (PrefillDone, seen at choice 0's next token; P keeps the
    prompt in its prefix cache before it reports), so P computes the prompt once. Owns their runs
    and the tasks that read them: close() closes every one it started."""

    def __init__(self, context: ChoiceContext, parsed: ParsedRequest, shapes: Shapes, request_id: str,
                 deadline_at: float) -> None:
        self.started: list[Choice] = []
        self._readers: set[asyncio.Task] = set()
        self._context = context
        self.shapes = shapes
        self._parsed, self._request_id, self._deadline_at = parsed, request_id, deadline_at

    @property
    def request_id(self) -> str:
        """The first choice's run's id, the one the client is told."""
        return self.started[0].generation.run.request_id

    async def start_first(self) -> None:
        await self._start(0)

    async def _start(self, index: int) -> Choice:
        parsed, context = self._parsed, self._context
        request_id = self._request_id if index == 0 else new_request_id()  # the KV wire needs an id of this shape
        sampling = dataclasses.replace(parsed.sampling, seed=choice_seed(parsed.sampling.seed, index))
        run = await context.dispatcher.start(GenerationRequest(
            request_id=request_id, prompt_ids=list(parsed.prompt_ids), sampling=sampling,
            pipeline=parsed.pipeline, handoff_at=parsed.handoff_at, md_kv_delay_s=parsed.md_kv_delay_s,
            handoff_mode=parsed.handoff_mode, failure_policy=parsed.failure_policy, deadline_at=self._deadline_at,
            prompt_logprobs=parsed.prompt_logprobs, max_tokens_param=parsed.max_tokens_param))
        log.info("%s: %s, %d prompt tokens, max_tokens %d, pipeline %s, stream %s", request_id, parsed.kind,
                 len(parsed.prompt_ids), sampling.max_tokens, run.pipeline, parsed.stream)
        generation = Generation(run, parsed, context.tokenizer, context.config)
        context.telemetry.started(generation)
        logprobs = None if parsed.sampling.logprobs is None else Logprobs(context.token_strings,
                                                                          parsed.kind == "chat")
        tools = parsed.tools if parsed.reads_tool_calls else None
        choice = Choice(index, generation, self.shapes.for_choice(index, logprobs), tools,
                        None if tools is None else ToolDeltas(tools))
        self.started.append(choice)
        return choice

    async def steps(self) -> AsyncGenerator[tuple[Choice, Step], None]:
        """Every choice's steps as they come, each choice's in order, until all have finished."""
        queue: asyncio.Queue[tuple[Choice, Step | BaseException]] = asyncio.Queue()
        self._read(self.started[0], queue)
        running = 1
        while running:
            choice, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if (choice.index == 0 and len(self.started) < self._parsed.n
                    and (choice.generation.run.prefill is not None or item.finish_reason is not None)):
                for index in range(1, self._parsed.n):  # P reported choice 0 after caching its prompt
                    self._read(await self._start(index), queue)
                    running += 1
            if item.finish_reason is not None:
                running -= 1
            yield choice, item

    def _read(self, choice: Choice, queue: asyncio.Queue) -> None:
        async def read() -> None:
            try:
                while True:
                    step = await choice.generation.next_step()
                    queue.put_nowait((choice, step))
                    if step.finish_reason is not None:
                        return
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # the consumer raises it
                queue.put_nowait((choice, exc))

        task = asyncio.create_task(read(), name=f"choice-{choice.index}")
        self._readers.add(task)
        task.add_done_callback(self._readers.discard)

    def usage(self) -> Json:
        """The usage object over every choice started; the prompt and its cache hit count once."""
        completion_tokens = sum(c.generation.completion_tokens for c in self.started)
        return usage(len(self._parsed.prompt_ids), completion_tokens, self.started[0].generation.run.cached_tokens)

    def set_close_reason(self, reason: str) -> None:
        for choice in self.started:
            choice.generation.close_reason = reason

    async def close(self, request: web.Request) -> None:
        for task in list(self._readers):
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        for choice in self.started:
            generation = choice.generation
            log.info("%s: closed (%s), finish %s, %d tokens %s", generation.run.request_id, generation.close_reason,
                     generation.finish_reason, generation.completion_tokens, generation.tokens_by_tier)
            try:
                await generation.close(generation.close_reason)
            finally:
                self._context.telemetry.finished(request, len(self._parsed.prompt_ids), generation)
