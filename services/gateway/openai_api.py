"""The gateway's OpenAI-compatible HTTP API: parse a request, run it, answer as JSON or SSE.

Owns the HTTP shape only; which instances serve a request is the dispatcher's business.
`error_middleware` (through `error_payload`) is the one place exceptions become HTTP errors.
"""
from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jinja2
import orjson
from aiohttp import web

from services.gateway.detokenizer import OutputText
from services.gateway.dispatcher import GenerationRequest
from shared.config import GatewayConfig
from shared.errors import BadRequest, DeadlineExceeded, PddError, PeerGone, RequestAborted
from shared.messages import PIPELINES
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from services.gateway.dispatcher import Dispatcher, RequestRun, TokenEvent
    from shared.messages import HandoffStats

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # ints travel to the workers as JSON, which orjson caps at 64 bits
PDD_EXTENSION_FIELDS = ("pipeline", "handoff_at", "md_kv_delay_ms")
Json = dict[str, object]


class InvalidParam(BadRequest):
    """A bad value in one named request field; OpenAI clients show the field as `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(InvalidParam):
    code = "model_not_found"


class PayloadTooLarge(BadRequest):
    code = "payload_too_large"


# --- request parsing: pure functions, every failure a BadRequest -------------------------------


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "chat" | "completion"
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    pipeline: str | None
    handoff_at: int | None
    md_kv_delay_s: float


def decode_json_body(raw: bytes, max_body_bytes: int) -> object:
    if len(raw) > max_body_bytes:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {max_body_bytes}")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


def parse_chat_request(body: object, tokenizer: PreTrainedTokenizerBase, served_model: str,
                       config: GatewayConfig, max_context_tokens: int) -> ParsedRequest:
    fields = _request_object(body, served_model)
    prompt_ids = _chat_prompt_ids(fields.get("messages"), tokenizer)
    return _parse_generation(fields, "chat", prompt_ids, tokenizer, config, max_context_tokens)


def parse_completion_request(body: object, tokenizer: PreTrainedTokenizerBase, served_model: str,
                             config: GatewayConfig, max_context_tokens: int) -> ParsedRequest:
    fields = _request_object(body, served_model)
    prompt_ids = _completion_prompt_ids(fields.get("prompt"), tokenizer)
    return _parse_generation(fields, "completion", prompt_ids, tokenizer, config, max_context_tokens)


def _request_object(body: object, served_model: str) -> Mapping[str, object]:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    # Lenient where OpenAI is strict: a missing model means the one we serve.
    if model is not None and model != served_model:
        raise ModelNotFound("model", f"model {model!r} does not exist; this server serves {served_model!r}")
    return body


def _chat_prompt_ids(messages: object, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise InvalidParam("messages", "messages must be a non-empty list of {role, content} objects")
    conversation = [_chat_message(message, i) for i, message in enumerate(messages)]
    try:
        encoded = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        raise InvalidParam("messages", f"the model's chat template cannot render these messages: {exc}") from None
    return _input_ids(encoded)


def _chat_message(message: object, i: int) -> dict[str, str]:
    if not isinstance(message, dict):
        raise InvalidParam(f"messages[{i}]", f"messages[{i}] must be an object with role and content")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidParam(f"messages[{i}].role", f"messages[{i}].role must be a non-empty string")
    content = message.get("content")
    if content is None:  # an assistant turn that only called tools
        return {"role": role, "content": ""}
    if isinstance(content, str):
        return {"role": role, "content": content}
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return {"role": role, "content": "\n".join(texts)}  # vLLM joins text parts the same way
    raise InvalidParam(f"messages[{i}].content",
                       f"messages[{i}].content must be a string or a list of {{type: 'text', text}} parts")


def _input_ids(encoded: object) -> list[int]:
    """apply_chat_template returns a list in transformers 4 and a BatchEncoding in 5."""
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]  # type: ignore[union-attr]


def _completion_prompt_ids(prompt: object, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one is one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParam("prompt", "the prompt is empty")
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab_size = len(tokenizer)
        if any(not 0 <= t < vocab_size for t in prompt):
            raise InvalidParam("prompt", f"prompt token ids must be in [0, {vocab_size})")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidParam("prompt", "only one prompt per request is supported")
    raise InvalidParam("prompt", "prompt must be a string or a list of token ids")


def _parse_generation(fields: Mapping[str, object], kind: str, prompt_ids: list[int],
                      tokenizer: PreTrainedTokenizerBase, config: GatewayConfig,
                      max_context_tokens: int) -> ParsedRequest:
    prompt_param = "messages" if kind == "chat" else "prompt"
    if not prompt_ids:
        raise InvalidParam(prompt_param, "the prompt is empty")
    if len(prompt_ids) > max_context_tokens - 1:
        raise InvalidParam(prompt_param, f"the prompt is {len(prompt_ids)} tokens; this model's context is "
                                         f"{max_context_tokens} tokens, so a prompt may have at most "
                                         f"{max_context_tokens - 1}")
    if _int(fields, "n", minimum=1) not in (None, 1):
        raise InvalidParam("n", "only n=1 is supported")
    stream = _bool(fields, "stream")
    stream_options = _object(fields, "stream_options")
    pipeline, handoff_at, md_kv_delay_s = _pdd_extension(_object(fields, "pdd"))
    seed = _int(fields, "seed", minimum=INT64_MIN)
    top_k = _int(fields, "top_k", minimum=-1)
    temperature = _number(fields, "temperature")
    top_p = _number(fields, "top_p")
    sampling = SamplingParams(
        max_tokens=_max_tokens(fields, len(prompt_ids), config, max_context_tokens),
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k in (None, -1) else top_k,  # vLLM spells "off" as -1, we as 0
        # A drawn seed rather than none: the tiers then sample the same token at each index.
        seed=secrets.randbits(63) if seed is None else seed,
        stop_token_ids=() if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),),
        ignore_eos=_bool(fields, "ignore_eos"),
    )
    return ParsedRequest(
        kind=kind, prompt_ids=tuple(prompt_ids), sampling=sampling, stop=_stop_strings(fields.get("stop")),
        stream=stream, include_usage=stream and _bool(stream_options, "include_usage", "stream_options."),
        pipeline=pipeline, handoff_at=handoff_at, md_kv_delay_s=md_kv_delay_s,
    )


def _max_tokens(fields: Mapping[str, object], prompt_tokens: int, config: GatewayConfig,
                max_context_tokens: int) -> int:
    name = "max_completion_tokens" if fields.get("max_completion_tokens") is not None else "max_tokens"
    requested = _int(fields, name, minimum=1)
    room = max_context_tokens - prompt_tokens
    if requested is None:
        return max(1, min(config.default_max_tokens, room))
    if requested > room:  # like vLLM: an explicit limit that cannot fit is the client's error
        raise InvalidParam(name, f"{name}={requested} plus the prompt's {prompt_tokens} tokens exceeds this "
                                 f"model's context of {max_context_tokens} tokens")
    return requested


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise InvalidParam("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    return tuple(stops)


def _pdd_extension(ext: Mapping[str, object]) -> tuple[str | None, int | None, float]:
    unknown = sorted(set(ext) - set(PDD_EXTENSION_FIELDS))
    if unknown:  # our own knobs: a typo should fail loudly, not run the default silently
        raise InvalidParam("pdd", f"unknown pdd fields {unknown}; known: {list(PDD_EXTENSION_FIELDS)}")
    pipeline = ext.get("pipeline")
    if pipeline is not None and pipeline not in PIPELINES:
        raise InvalidParam("pdd.pipeline", f"pdd.pipeline must be one of {list(PIPELINES)}")
    delay_ms = _number(ext, "md_kv_delay_ms", "pdd.")
    if delay_ms is not None and delay_ms < 0:
        raise InvalidParam("pdd.md_kv_delay_ms", "pdd.md_kv_delay_ms must be >= 0")
    handoff_at = _int(ext, "handoff_at", minimum=0, prefix="pdd.")
    return (None if pipeline is None else str(pipeline)), handoff_at, (delay_ms or 0.0) / 1000.0


def _object(fields: Mapping[str, object], name: str) -> Mapping[str, object]:
    value = fields.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidParam(name, f"{name} must be an object")
    return value


def _int(fields: Mapping[str, object], name: str, *, minimum: int, prefix: str = "") -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= INT64_MAX:
        raise InvalidParam(prefix + name, f"{prefix}{name} must be an integer from {minimum} to {INT64_MAX}")
    return value


def _number(fields: Mapping[str, object], name: str, prefix: str = "") -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return number
    raise InvalidParam(prefix + name, f"{prefix}{name} must be a finite number")


def _bool(fields: Mapping[str, object], name: str, prefix: str = "") -> bool:
    value = fields.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidParam(prefix + name, f"{prefix}{name} must be true or false")
    return value


# --- errors: the one mapping from exception to HTTP response -----------------------------------


def error_payload(exc: BaseException) -> tuple[int, Json]:
    """HTTP status and OpenAI-style error body for an exception (also sent as an SSE event mid-stream)."""
    if isinstance(exc, ModelNotFound):
        status = 404
    elif isinstance(exc, (PayloadTooLarge, web.HTTPRequestEntityTooLarge)):
        status = 413
    elif isinstance(exc, BadRequest):
        status = 400
    elif isinstance(exc, PeerGone):
        status = 503
    elif isinstance(exc, DeadlineExceeded):
        status = 504
    elif isinstance(exc, web.HTTPException):
        status = exc.status
    else:
        status = 500
    if isinstance(exc, PddError):
        message, code = str(exc) or type(exc).__name__, exc.code
    elif isinstance(exc, web.HTTPException):
        message, code = exc.text or exc.reason, "payload_too_large" if status == 413 else f"http_{status}"
    else:  # a bug: the details go to the log, not to the client
        message, code = "internal server error", "internal_error"
    error = {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
             "param": getattr(exc, "param", None), "code": code}
    return status, {"error": error}


def error_response(exc: BaseException) -> web.Response:
    status, body = error_payload(exc)
    headers = {"Retry-After": "1"} if status == 503 else {}
    if isinstance(exc, web.HTTPException) and "Allow" in exc.headers:
        headers["Allow"] = exc.headers["Allow"]
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc)
    except Exception as exc:
        if not isinstance(exc, PddError):
            log.exception("%s %s: unhandled error", request.method, request.path)
        elif not isinstance(exc, BadRequest):
            log.warning("%s %s: %s: %s", request.method, request.path, type(exc).__name__, exc)
        return error_response(exc)


# --- running a request: token events to text steps ---------------------------------------------


@dataclass(frozen=True)
class _Step:
    index: int
    tier: str
    text: str
    finish_reason: str | None
    handoff: Json | None  # set on the one step that first reports MD's takeover


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


def _handoff_json(stats: HandoffStats) -> Json:
    return {"eager_tokens": stats.eager_tokens, "kv_wait_s": stats.kv_wait_s,
            "handoff_s": stats.handoff_s, "extend_s": stats.extend_s}


class _Generation:
    """One run's token events turned into text steps, under the request and per-token deadlines."""

    def __init__(self, run: RequestRun, parsed: ParsedRequest, tokenizer: PreTrainedTokenizerBase,
                 config: GatewayConfig) -> None:
        self.run = run
        self._events = run.tokens()
        self._text = OutputText(tokenizer, parsed.prompt_ids, parsed.stop)
        self._deadline = asyncio.get_running_loop().time() + config.request_timeout_s
        self._token_timeout_s = config.token_timeout_s
        self._handoff_reported = False
        self.tokens_by_tier = {"relay": 0, "main": 0}
        self.finish_reason: str | None = None
        self.close_reason = "error"  # what run.close() is told; replaced once we know better

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens_by_tier.values())

    async def next_step(self) -> _Step:
        event = await self._next_event()
        self.tokens_by_tier[event.tier] = self.tokens_by_tier.get(event.tier, 0) + 1
        if event.finish_reason == "stop":
            # A stop token ends the text without showing it, as OpenAI and vLLM do.
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
        handoff = self.take_handoff() if event.tier == "main" and self.tokens_by_tier["relay"] else None
        return _Step(event.index, event.tier, text, finish, handoff)

    def take_handoff(self) -> Json | None:
        """MD's handoff stats, the first time they are known; None before and after."""
        if self._handoff_reported or self.run.handoff is None:
            return None
        self._handoff_reported = True
        return _handoff_json(self.run.handoff)

    async def _next_event(self) -> TokenEvent:
        loop = asyncio.get_running_loop()
        request_left_s = self._deadline - loop.time()
        wait_s = max(0.0, min(self._token_timeout_s, request_left_s))
        try:
            async with asyncio.timeout(wait_s):
                return await anext(self._events)
        except StopAsyncIteration:
            raise RequestAborted("the token stream ended without a finish reason") from None
        except TimeoutError:
            what = "the request deadline passed" if request_left_s <= self._token_timeout_s else \
                f"no token came within {self._token_timeout_s:g}s"
            raise DeadlineExceeded(f"{self.run.request_id}: {what}") from None

    async def close(self, reason: str) -> None:
        try:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            await self.run.close(reason)


# --- response shapes ---------------------------------------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Json:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class _Shapes:
    """Builds one response's OpenAI objects: chat.completion(.chunk) or text_completion."""

    response_id: str
    created: int
    model: str
    chat: bool
    include_usage: bool

    def _head(self, object_name: str) -> Json:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model}

    def _chunk(self, choices: list[Json]) -> Json:
        chunk = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": choices}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI sends null usage on every chunk but the last
        return chunk

    def _choice(self, text: str, finish_reason: str | None, *, first: bool = False) -> Json:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if first:
            delta: Json = {"role": "assistant", "content": ""}
        else:
            delta = {} if finish_reason is not None else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def role_chunk(self) -> Json:
        return self._chunk([self._choice("", None, first=True)])

    def token_chunk(self, step: _Step, pipeline: str) -> Json:
        pdd: Json = {"tokens": [{"index": step.index, "tier": step.tier}], "pipeline": pipeline}
        if step.handoff is not None:
            pdd["handoff"] = step.handoff
        return {**self._chunk([self._choice(step.text, None)]), "pdd": pdd}

    def final_chunk(self, finish_reason: str, pipeline: str, handoff: Json | None) -> Json:
        pdd: Json = {"tokens": [], "pipeline": pipeline}
        if handoff is not None:
            pdd["handoff"] = handoff
        return {**self._chunk([self._choice("", finish_reason)]), "pdd": pdd}

    def usage_chunk(self, usage: Json) -> Json:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"),
                "choices": [], "usage": usage}

    def completion(self, text: str, finish_reason: str, usage: Json, pdd: Json) -> Json:
        if self.chat:
            choice: Json = {"index": 0, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": [choice], "usage": usage, "pdd": pdd}


def _sse(payload: Json) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _send(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one
        raise _ClientGone(str(exc)) from exc


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


# --- handlers ----------------------------------------------------------------------------------


class OpenAIHandlers:
    """aiohttp handlers for /v1/chat/completions, /v1/completions and /v1/models."""

    def __init__(self, dispatcher: Dispatcher, tokenizer: PreTrainedTokenizerBase, served_model: str,
                 config: GatewayConfig, max_context_tokens: int) -> None:
        self._dispatcher = dispatcher
        self._tokenizer = tokenizer
        self._served_model = served_model
        self._config = config
        self._max_context_tokens = max_context_tokens
        self._created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
        ]

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        parsed = parse_chat_request(body, self._tokenizer, self._served_model, self._config,
                                    self._max_context_tokens)
        return await self._serve(request, parsed)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        parsed = parse_completion_request(body, self._tokenizer, self._served_model, self._config,
                                          self._max_context_tokens)
        return await self._serve(request, parsed)

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self._served_model, "object": "model", "created": self._created, "owned_by": "pdd",
                 "max_model_len": self._max_context_tokens}
        return _json_response({"object": "list", "data": [model]})

    async def _read_json(self, request: web.Request) -> object:
        limit = self._config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(f"request body is {request.content_length} bytes; the limit is {limit}")
        return decode_json_body(await request.read(), limit)

    async def _serve(self, request: web.Request, parsed: ParsedRequest) -> web.StreamResponse:
        request_id = f"req-{uuid.uuid4().hex}"
        run = await self._dispatcher.start(GenerationRequest(
            request_id=request_id, prompt_ids=list(parsed.prompt_ids), sampling=parsed.sampling,
            pipeline=parsed.pipeline, handoff_at=parsed.handoff_at, md_kv_delay_s=parsed.md_kv_delay_s))
        log.info("%s: %s, %d prompt tokens, max_tokens %d, pipeline %s, stream %s", request_id, parsed.kind,
                 len(parsed.prompt_ids), parsed.sampling.max_tokens, run.pipeline, parsed.stream)
        generation = _Generation(run, parsed, self._tokenizer, self._config)
        shapes = _Shapes(response_id=("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + request_id[4:],
                         created=int(time.time()), model=self._served_model, chat=parsed.kind == "chat",
                         include_usage=parsed.include_usage)
        try:
            if parsed.stream:
                return await self._stream(request, parsed, generation, shapes)
            return await self._respond(request, parsed, generation, shapes)
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client's connection drops mid-response.
            generation.close_reason = "client_disconnected" if _client_gone(request) else "cancelled"
            raise
        finally:
            log.info("%s: closed (%s), finish %s, %d tokens %s", request_id, generation.close_reason,
                     generation.finish_reason, generation.completion_tokens, generation.tokens_by_tier)
            await generation.close(generation.close_reason)

    def _usage_of(self, parsed: ParsedRequest, generation: _Generation) -> Json:
        return _usage(len(parsed.prompt_ids), generation.completion_tokens, generation.run.cached_tokens)

    async def _respond(self, request: web.Request, parsed: ParsedRequest, generation: _Generation,
                       shapes: _Shapes) -> web.StreamResponse:
        texts: list[str] = []
        while True:
            step = await generation.next_step()
            texts.append(step.text)
            if step.finish_reason is not None:
                break
            if _client_gone(request):
                generation.close_reason = "client_disconnected"
                return web.Response(status=499, reason="Client Closed Request")  # nobody reads it
        handoff = generation.run.handoff
        pdd = {"pipeline": generation.run.pipeline, "tokens_by_tier": generation.tokens_by_tier,
               "handoff": None if handoff is None else _handoff_json(handoff)}
        body = shapes.completion("".join(texts), step.finish_reason, self._usage_of(parsed, generation), pdd)
        return _json_response(body, headers={"X-Request-Id": generation.run.request_id})

    async def _stream(self, request: web.Request, parsed: ParsedRequest, generation: _Generation,
                      shapes: _Shapes) -> web.StreamResponse:
        run = generation.run
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
            "X-Request-Id": run.request_id})
        try:
            await response.prepare(request)
            if shapes.chat:
                await _send(response, _sse(shapes.role_chunk()))
            try:
                while True:
                    step = await generation.next_step()
                    await _send(response, _sse(shapes.token_chunk(step, run.pipeline)))
                    if step.finish_reason is not None:
                        break
                await _send(response, _sse(shapes.final_chunk(step.finish_reason, run.pipeline,
                                                              generation.take_handoff())))
                if shapes.include_usage:
                    await _send(response, _sse(shapes.usage_chunk(self._usage_of(parsed, generation))))
            except _ClientGone:
                raise
            except Exception as exc:  # the status line is sent: the error travels as an SSE event
                if not isinstance(exc, PddError):
                    log.exception("%s: unhandled error while streaming", run.request_id)
                else:
                    log.warning("%s: failed while streaming: %s: %s", run.request_id, type(exc).__name__, exc)
                await _send(response, _sse(error_payload(exc)[1]))
            await _send(response, b"data: [DONE]\n\n")
            await response.write_eof()
        except (_ClientGone, ConnectionError):
            generation.close_reason = "client_disconnected"
            log.info("%s: client disconnected", run.request_id)
        return response


def _json_response(body: Json, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)
