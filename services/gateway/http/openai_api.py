"""The gateway's OpenAI-compatible HTTP API: parse a request, run it, answer as JSON or SSE.

Owns the HTTP shape only: requests are parsed in request_parsing.py, served by the dispatcher,
and errors become responses in http_errors.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from opentelemetry import trace

from services.gateway.http.admission import Admission, ClientLeft
from services.gateway.http.body_reading import read_body
from services.gateway.http.client_watch import ClientWatch, client_gone
from services.gateway.http.detokenizer import OutputText, TokenStrings, as_decoder
from services.gateway.http.http_errors import error_payload
from services.gateway.http.prompt_echo import PromptEcho, PromptOnlyServer, echo_of
from services.gateway.http.request_parsing import (
    ModelNotFound,
    ParsedRequest,
    check_prompt_bytes,
    decode_json_body,
    parse_chat_request,
    parse_completion_request,
)
from services.gateway.http.tool_calls import ToolCallStream, parse_answer
from services.gateway.observe.request_telemetry import STARTED_AT, RequestTelemetry
from services.gateway.run.attempt import GenerationRequest
from services.gateway.run.request_run import new_request_id
from shared import tracing
from shared.config import GatewayConfig
from shared.errors import DeadlineExceeded, PddError, ProtocolError, RequestAborted
from shared.metrics import GatewayMetrics
from shared.names import Role
from shared.sampling import choice_seed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from services.gateway.routing.dispatcher import Dispatcher
    from services.gateway.run.request_run import RequestRun, TokenEvent
    from shared.messages import HandoffStats
    from shared.sampling import TokenLogprob

log = logging.getLogger(__name__)

Json = dict[str, object]


# --- running a request: token events to text steps ---------------------------------------------


@dataclass(frozen=True)
class _Step:
    index: int
    token_id: int
    tier: str
    text: str
    finish_reason: str | None
    handoff: Json | None  # MD's handoff stats, on the step at the run's cut (if they are known by then)
    logprob: TokenLogprob | None = None  # when the request asks for logprobs
    echo: PromptEcho | None = None  # the prompt, on the first step of a completion with echo: text is behind it


def _logprob(step: _Step) -> TokenLogprob:
    assert step.logprob is not None  # _Generation refuses a token without it when logprobs were asked for
    return step.logprob


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


def _handoff_json(stats: HandoffStats) -> Json:
    return {k: v for k, v in dataclasses.asdict(stats).items() if k != "request_id"}


class _Generation:
    """One run's token events turned into text steps, under the request and per-token deadlines."""

    def __init__(self, run: RequestRun, parsed: ParsedRequest, tokenizer: PreTrainedTokenizerBase,
                 config: GatewayConfig) -> None:
        self.run = run
        self._events = run.tokens()
        self._text = OutputText(as_decoder(tokenizer), parsed.prompt_ids, parsed.stop, include_stop=parsed.include_stop)
        # a client's stop_token_ids are shown, as vLLM shows them (a special token's text is empty anyway)
        self._shown_stop_ids = frozenset(parsed.sampling.stop_token_ids) - frozenset(parsed.sampling.eos_token_ids)
        self._wants_logprobs = parsed.sampling.logprobs is not None
        self._parsed = parsed
        self._prompt_strings = TokenStrings(as_decoder(tokenizer)) if parsed.echo is not None else None
        self._deadline = asyncio.get_running_loop().time() + config.request_timeout_s
        self._handoff_reported = False
        self.tokens_by_tier = {str(Role.RELAY): 0, str(Role.MAIN): 0}
        self.token_log: list[tuple[float, str]] = []  # (time.monotonic(), tier) of each token, for metrics
        self.finish_reason: str | None = None
        self.close_reason = "error"  # what run.close() is told; replaced once we know better

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens_by_tier.values())

    async def next_step(self) -> _Step:
        event = await self._next_event()
        self.token_log.append((time.monotonic(), event.tier))
        self.tokens_by_tier[event.tier] = self.tokens_by_tier.get(event.tier, 0) + 1
        finish: str | None
        if event.finish_reason == "stop" and event.token_id not in self._shown_stop_ids:
            # EOS ends the text without showing it, as OpenAI and vLLM do.
            delta = self._text.finish()
            text, finish = delta.text, "stop"
        else:
            delta = self._text.add_token(event.token_id)
            text = delta.text
            if not delta.stopped and event.finish_reason is not None:
                delta = self._text.finish()
                text += delta.text
            finish = "stop" if delta.stopped else event.finish_reason
        if finish is not None:
            self.finish_reason = finish
            self.close_reason = "stop_string" if delta.stopped else "finished"
        handoff = self.take_handoff() if event.index == self.run.cut_index else None
        if self._wants_logprobs and event.logprob is None:
            raise ProtocolError(f"{self.run.request_id}: {event.tier} sent token {event.index} without its logprobs")
        echo = None
        if self._prompt_strings is not None and event.index == 0:  # the answer starts with the prompt
            echo = await echo_of(self._parsed, self.run.prompt_logprobs, self._prompt_strings)
            text = echo.text + text
        return _Step(event.index, event.token_id, event.tier, text, finish, handoff, event.logprob, echo)

    def summary(self) -> Json:
        """The run's own summary plus what only the HTTP layer counts."""
        return {**self.run.summary(), "tokens_by_tier": dict(self.tokens_by_tier)}

    def take_handoff(self) -> Json | None:
        """MD's handoff stats, the first time they are known; None before and after."""
        if self._handoff_reported or self.run.handoff is None:
            return None
        self._handoff_reported = True
        return _handoff_json(self.run.handoff)

    async def _next_event(self) -> TokenEvent:
        """The next token. The run's stream enforces the next-token deadline, except while the request
        waits for P (queued is not stalled); here only the request's own deadline is a backstop."""
        request_left_s = self._deadline - asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(max(0.0, request_left_s)):
                return await anext(self._events)
        except StopAsyncIteration:
            raise RequestAborted("the token stream ended without a finish reason") from None
        except TimeoutError:
            raise DeadlineExceeded(f"{self.run.request_id}: the request deadline passed") from None

    async def close(self, reason: str) -> None:
        try:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            await self.run.close(reason)


TOKENIZE_NICENESS = 10


def _package_version() -> str:
    try:
        return importlib.metadata.version("pdd")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


SYSTEM_FINGERPRINT = f"pdd-{_package_version()}"  # in every response, as OpenAI's; changes with pdd's version


def lower_thread_priority() -> None:
    """Run the calling thread at a lower CPU priority (Linux sets niceness per thread; elsewhere nothing)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZE_NICENESS)
    except (AttributeError, OSError) as exc:
        log.debug("tokeniser threads keep their priority: %s", exc)


# --- response shapes ---------------------------------------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Json:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class _Logprobs:
    """One response's logprobs in OpenAI's shapes, from each token's TokenLogprob (the model's raw
    distribution). Chat: `content`, an entry per token with its `top_logprobs`. Completions: parallel
    lists, where `top_logprobs` holds the likeliest tokens and always the chosen one, and `text_offset`
    counts the tokens' own strings, as vLLM counts it."""

    def __init__(self, strings: TokenStrings, chat: bool) -> None:
        self._strings = strings
        self._chat = chat
        self._text_offset = 0  # completions: where the next token's string starts

    def of(self, steps: list[_Step]) -> Json:
        if self._chat:
            return {"content": [self._chat_entry(step.token_id, _logprob(step)) for step in steps]}
        first_echo = steps[0].echo if steps else None
        echo = first_echo.logprobs if first_echo is not None else None
        if first_echo is not None and echo is not None:  # the prompt's entries first; the answer's count on after
            self._text_offset = first_echo.text_offset_end
        tokens, offsets = [self._strings.text(step.token_id) for step in steps], []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        shaped: Json = {"tokens": tokens, "token_logprobs": [_logprob(step).logprob for step in steps],
                        "top_logprobs": [self._alternatives(step) for step in steps], "text_offset": offsets}
        return shaped if echo is None else {key: [*echo[key], *shaped[key]] for key in shaped}  # type: ignore[misc]

    def _chat_entry(self, token_id: int, logprob: TokenLogprob) -> Json:
        return {**self._token(token_id, logprob.logprob),
                "top_logprobs": [self._token(top_id, value) for top_id, value in logprob.top]}

    def _token(self, token_id: int, logprob: float) -> Json:
        text, raw = self._strings.get(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def _alternatives(self, step: _Step) -> dict[str, float]:
        logprob = _logprob(step)
        alternatives = {self._strings.text(top_id): value for top_id, value in logprob.top}
        alternatives.setdefault(self._strings.text(step.token_id), logprob.logprob)
        return alternatives


@dataclass(frozen=True)
class _Shapes:
    """Builds one response's OpenAI objects: chat.completion(.chunk) or text_completion."""

    response_id: str
    created: int
    model: str
    chat: bool
    include_usage: bool
    logprobs: _Logprobs | None = None  # when the request asks for them
    index: int = 0  # the choice this object's choices are (n > 1)

    def for_choice(self, index: int, logprobs: _Logprobs | None) -> _Shapes:
        return dataclasses.replace(self, index=index, logprobs=logprobs)

    def _head(self, object_name: str) -> Json:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def _chunk(self, choices: list[Json]) -> Json:
        chunk = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": choices}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI sends null usage on every chunk but the last
        return chunk

    def _choice(self, text: str, finish_reason: str | None, *, first: bool = False,
                logprobs: Json | None = None, delta: Json | None = None) -> Json:
        if not self.chat:
            return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if delta is None:
            delta = {} if finish_reason is not None else {"content": text}
        if first:  # OpenAI's first chunk names the role beside the first token's text
            delta = {"role": "assistant", **delta}
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs_of(self, steps: list[_Step]) -> Json | None:
        return None if self.logprobs is None else self.logprobs.of(steps)

    def token_chunk(self, step: _Step, pipeline: str, delta: Json | None = None) -> Json:
        """The chunk of one token; the first (index 0) also carries the assistant role, so that the
        first chunk a client sees is the first token (its time is the TTFT clients measure).
        `delta`: chat's delta when the text is read for tool calls (else the step's text)."""
        pdd: Json = {"tokens": [{"index": step.index, "id": step.token_id, "tier": step.tier}], "pipeline": pipeline}
        if step.handoff is not None:
            pdd["handoff"] = step.handoff
        choice = self._choice(step.text, None, first=step.index == 0, logprobs=self._logprobs_of([step]), delta=delta)
        return {**self._chunk([choice]), "pdd": pdd}

    def final_chunk(self, finish_reason: str, summary: Json, handoff: Json | None) -> Json:
        pdd: Json = {**summary, "tokens": []}
        if handoff is not None:
            pdd["handoff"] = handoff
        return {**self._chunk([self._choice("", finish_reason)]), "pdd": pdd}

    def usage_chunk(self, usage: Json) -> Json:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"),
                "choices": [], "usage": usage}

    def choice(self, text: str, steps: list[_Step], finish_reason: str,
               tool_names: frozenset[str] = frozenset()) -> Json:
        """A whole choice. `tool_names`: the text is read for calls to these tools (chat with tools offered)."""
        logprobs = self._logprobs_of(steps)
        if not self.chat:
            return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        message: Json = {"role": "assistant", "content": text}
        if tool_names:
            answer = parse_answer(text, tool_names)
            message["content"] = answer.content
            if answer.tool_calls:
                message["tool_calls"] = answer.tool_calls
                finish_reason = _tool_finish(finish_reason)
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def completion(self, choices: list[Json], usage: Json, pdd: Json) -> Json:
        return {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": choices, "usage": usage, "pdd": pdd}


def _tool_finish(finish_reason: str) -> str:
    """An answer that ended by itself with tool calls in it finished to call them (a length cut stays one)."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


class _ToolDeltas:
    """A streamed chat answer's text read for tool calls: each token's text in, that token's delta out."""

    def __init__(self, names: frozenset[str]) -> None:
        self._stream = ToolCallStream(names)

    def delta(self, step: _Step) -> Json:
        deltas = self._stream.feed(step.text)
        if step.finish_reason is not None:
            deltas += self._stream.finish()
        delta: Json = {}
        content = "".join(str(d["content"]) for d in deltas if "content" in d)
        calls = [call for d in deltas for call in d.get("tool_calls", [])]  # type: ignore[attr-defined]
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, finish_reason: str) -> str:
        return _tool_finish(finish_reason) if self._stream.calls_made else finish_reason


def _sse(payload: Json) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _send(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one
        raise _ClientGone(str(exc)) from exc


# --- handlers ----------------------------------------------------------------------------------


class OpenAIHandlers:
    """aiohttp handlers for /v1/chat/completions, /v1/completions and /v1/models."""

    def __init__(self, dispatcher: Dispatcher, tokenizer: PreTrainedTokenizerBase, served_model: str,
                 config: GatewayConfig, max_context_tokens: int, admission: Admission | None = None,
                 telemetry: RequestTelemetry | None = None) -> None:
        self._dispatcher = dispatcher
        self._telemetry = telemetry or RequestTelemetry(GatewayMetrics())
        self._admission = admission or Admission(0, 0, None)
        self._tokenizer = tokenizer
        self._served_model = served_model
        self._config = config
        self._max_context_tokens = max_context_tokens
        self._max_prompt_bytes = max_context_tokens * config.max_prompt_bytes_per_token
        self._token_strings = TokenStrings(as_decoder(tokenizer))
        self._prompt_only = PromptOnlyServer(dispatcher, self._telemetry, self._token_strings, served_model,
                                             SYSTEM_FINGERPRINT)
        # The chat template and the tokeniser run here, not on the event loop: a big prompt would
        # stall every stream (the fast tokeniser releases the GIL while it works). Each thread of the
        # pool tokenises serially and at a lower CPU priority, so a huge prompt cannot take the cores
        # from the model services that share the host with the gateway.
        self._tokenize_pool = ThreadPoolExecutor(max(1, config.tokenizer_threads), thread_name_prefix="tokenize",
                                                 initializer=lower_thread_priority)
        self._created = int(time.time())

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id:.+}", self.model),
        ]

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        parsed = await self._parse(request, "chat", parse_chat_request)
        return await self._serve(request, parsed)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = await self._parse(request, "completion", parse_completion_request)
        return await self._serve(request, parsed)

    async def models(self, request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [self._model_object()]})

    async def model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self._served_model:
            raise ModelNotFound("model", f"model {model_id!r} does not exist; this server serves "
                                         f"{self._served_model!r}")
        return _json_response(self._model_object())

    def _model_object(self) -> Json:
        return {"id": self._served_model, "object": "model", "created": self._created, "owned_by": "pdd",
                "max_model_len": self._max_context_tokens}

    async def _parse(self, request: web.Request, kind: str,
                     parse: Callable[..., ParsedRequest]) -> ParsedRequest:
        limit = self._config.max_body_bytes
        body = decode_json_body(await read_body(request, self._config.body_timeout_s, limit), limit)
        check_prompt_bytes(body, kind, self._max_prompt_bytes)
        job = functools.partial(parse, body, self._tokenizer, self._served_model, self._config,
                                self._max_context_tokens)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, job)

    async def _serve(self, request: web.Request, parsed: ParsedRequest) -> web.StreamResponse:
        deadline_at = request.get(STARTED_AT, time.monotonic()) + self._config.request_timeout_s
        async with self._admission.slot(deadline_at, lambda: client_gone(request)) as queued_s:
            trace.get_current_span().set_attribute("pdd.queued_s", queued_s)
            if parsed.sampling.max_tokens == 0:  # echo of the prompt alone: P scores it, nobody decodes
                return await self._prompt_only.serve(request, parsed, deadline_at)
            return await self._serve_admitted(request, parsed, deadline_at)

    async def _serve_admitted(self, request: web.Request, parsed: ParsedRequest,
                              deadline_at: float) -> web.StreamResponse:
        request_id = new_request_id()
        shapes = _Shapes(response_id=("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + request_id[4:],
                         created=int(time.time()), model=self._served_model, chat=parsed.kind == "chat",
                         include_usage=parsed.include_usage)
        choices = _Choices(self, parsed, shapes, request_id, deadline_at)
        try:
            await choices.start_first()
            # Before its first token nothing is written that could fail: the watch notices the
            # client gone within a second, and the run's close aborts the request on every tier.
            with ClientWatch(request):
                if parsed.stream:
                    return await self._stream(request, parsed, choices)
                return await self._respond(request, parsed, choices)
        except ClientLeft:
            choices.set_close_reason("client_disconnected")
            raise
        except asyncio.CancelledError:
            # aiohttp cancels the handler on disconnect when run with handler_cancellation.
            choices.set_close_reason("client_disconnected" if client_gone(request) else "cancelled")
            raise
        finally:
            await choices.close(request)

    def _usage_of(self, parsed: ParsedRequest, choices: _Choices) -> Json:
        first = choices.started[0].generation
        completion_tokens = sum(c.generation.completion_tokens for c in choices.started)
        return _usage(len(parsed.prompt_ids), completion_tokens, first.run.cached_tokens)

    async def _respond(self, request: web.Request, parsed: ParsedRequest, choices: _Choices) -> web.StreamResponse:
        steps: list[list[_Step]] = [[] for _ in range(parsed.n)]
        async for choice, step in choices.steps():
            steps[choice.index].append(step)
            if client_gone(request):
                choices.set_close_reason("client_disconnected")
                return web.Response(status=499, reason="Client Closed Request")  # nobody reads it
        bodies = [c.shapes.choice("".join(s.text for s in steps[c.index]), steps[c.index],
                                  c.generation.finish_reason or "stop", c.tool_names) for c in choices.started]
        pdd = choices.started[0].pdd_summary()
        if parsed.n > 1:
            pdd = {**pdd, "choices": [c.pdd_summary() for c in choices.started]}
        body = choices.shapes.completion(bodies, self._usage_of(parsed, choices), pdd)
        return _json_response(body, headers={"X-Request-Id": choices.started[0].generation.run.request_id})

    async def _stream(self, request: web.Request, parsed: ParsedRequest, choices: _Choices) -> web.StreamResponse:
        first_run = choices.started[0].generation.run
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
            "X-Request-Id": first_run.request_id})
        try:
            await response.prepare(request)
            try:
                async for choice, step in choices.steps():
                    generation = choice.generation
                    delta = None if choice.tool_deltas is None else choice.tool_deltas.delta(step)
                    await _send(response, _sse(choice.shapes.token_chunk(step, generation.run.pipeline, delta)))
                    if step.finish_reason is not None:
                        finish_reason = (step.finish_reason if choice.tool_deltas is None
                                         else choice.tool_deltas.finish_reason(step.finish_reason))
                        await _send(response, _sse(choice.shapes.final_chunk(finish_reason, generation.summary(),
                                                                             generation.take_handoff())))
                if choices.shapes.include_usage:
                    await _send(response, _sse(choices.shapes.usage_chunk(self._usage_of(parsed, choices))))
            except _ClientGone:
                raise
            except Exception as exc:  # the status line is sent: the error travels as an SSE event
                if not isinstance(exc, PddError):
                    log.exception("%s: unhandled error while streaming", first_run.request_id)
                else:
                    log.warning("%s: failed while streaming: %s: %s", first_run.request_id, type(exc).__name__, exc)
                tracing.record_error(trace.get_current_span(), exc)
                await _send(response, _sse(error_payload(exc)[1]))
            await _send(response, b"data: [DONE]\n\n")
            await response.write_eof()
        except (_ClientGone, ConnectionError):
            choices.set_close_reason("client_disconnected")
            log.info("%s: client disconnected", first_run.request_id)
        return response


@dataclass
class _Choice:
    """One of a request's n answers: its run turned into steps, and how its objects are shaped."""

    index: int
    generation: _Generation
    shapes: _Shapes
    tool_names: frozenset[str]
    tool_deltas: _ToolDeltas | None

    def pdd_summary(self) -> Json:
        handoff = self.generation.run.handoff
        return {**self.generation.summary(), "handoff": None if handoff is None else _handoff_json(handoff)}


class _Choices:
    """A request's n choices, each a run of its own with choice_seed(seed, i). Choice 0 starts first;
    the others once P has reported it done (PrefillDone, seen at choice 0's next token; P keeps the
    prompt in its prefix cache before it reports), so P computes the prompt once. Owns their runs
    and the tasks that read them: close() closes every one it started."""

    def __init__(self, handlers: OpenAIHandlers, parsed: ParsedRequest, shapes: _Shapes, request_id: str,
                 deadline_at: float) -> None:
        self._handlers = handlers
        self._parsed = parsed
        self.shapes = shapes
        self._request_id = request_id
        self._deadline_at = deadline_at
        self.started: list[_Choice] = []
        self._readers: set[asyncio.Task] = set()

    async def start_first(self) -> None:
        await self._start(0)

    async def _start(self, index: int) -> _Choice:
        parsed, handlers = self._parsed, self._handlers
        request_id = self._request_id if index == 0 else new_request_id()  # the KV wire needs an id of this shape
        sampling = dataclasses.replace(parsed.sampling, seed=choice_seed(parsed.sampling.seed, index))
        run = await handlers._dispatcher.start(GenerationRequest(
            request_id=request_id, prompt_ids=list(parsed.prompt_ids), sampling=sampling,
            pipeline=parsed.pipeline, handoff_at=parsed.handoff_at, md_kv_delay_s=parsed.md_kv_delay_s,
            handoff_mode=parsed.handoff_mode, failure_policy=parsed.failure_policy, deadline_at=self._deadline_at,
            prompt_logprobs=parsed.prompt_logprobs, max_tokens_param=parsed.max_tokens_param))
        log.info("%s: %s, %d prompt tokens, max_tokens %d, pipeline %s, stream %s", request_id, parsed.kind,
                 len(parsed.prompt_ids), sampling.max_tokens, run.pipeline, parsed.stream)
        generation = _Generation(run, parsed, handlers._tokenizer, handlers._config)
        handlers._telemetry.started(generation)
        logprobs = None if parsed.sampling.logprobs is None else _Logprobs(handlers._token_strings,
                                                                           parsed.kind == "chat")
        tool_names = parsed.tools.names if parsed.reads_tool_calls and parsed.tools else frozenset()
        choice = _Choice(index, generation, self.shapes.for_choice(index, logprobs), tool_names,
                         _ToolDeltas(tool_names) if tool_names else None)
        self.started.append(choice)
        return choice

    async def steps(self) -> AsyncIterator[tuple[_Choice, _Step]]:
        """Every choice's steps as they come, each choice's in order, until all have finished."""
        queue: asyncio.Queue[tuple[_Choice, _Step | BaseException]] = asyncio.Queue()
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

    def _read(self, choice: _Choice, queue: asyncio.Queue) -> None:
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
                self._handlers._telemetry.finished(request, len(self._parsed.prompt_ids), generation)


def _json_response(body: Json, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)
