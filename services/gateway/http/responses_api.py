"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) on the chat path:
a request is turned into the chat request pdd serves (responses_items.py), parsed, admitted and run
as chat is, and its answer written as a response object or its typed events (responses_stream.py).

Owns the routes, the answer's writing and the memory of recent responses (for previous_response_id);
parsing, admission and the runs are the chat path's, reached through `ChatServing`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, cast

import orjson
from aiohttp import web
from opentelemetry import trace

from services.gateway.http import sse
from services.gateway.http.answers import json_response
from services.gateway.http.body_reading import read_body
from services.gateway.http.client_watch import client_gone
from services.gateway.http.http_errors import error_payload
from services.gateway.http.request_parsing import NotFound, ParsedRequest, decode_json_body, parse_chat_request
from services.gateway.http.responses_items import ResponsesRequest, to_chat_request
from services.gateway.http.responses_store import ResponseStore
from services.gateway.http.responses_stream import ResponseOutput, as_input_items, responses_usage
from services.gateway.observe.request_telemetry import STREAM_FAILED_STATUS
from shared import tracing
from shared.errors import InvalidParam, PddError

if TYPE_CHECKING:
    from services.gateway.http.choices import Choice, Choices
    from services.gateway.http.generation import Step
    from services.gateway.http.logprob_shapes import Logprobs
    from shared.config import GatewayConfig

log = logging.getLogger(__name__)

Json = dict[str, object]
AnswerWriter = Callable[[web.Request, "Choices"], Awaitable[web.StreamResponse]]


class ChatServing(Protocol):
    """What the Responses API uses of the chat path (OpenAIHandlers)."""

    async def parse_body(self, body: object, kind: str, parse: Callable[..., ParsedRequest]) -> ParsedRequest: ...

    async def serve(self, request: web.Request, parsed: ParsedRequest,
                    answer: AnswerWriter | None = None) -> web.StreamResponse: ...


class ResponseNotFound(NotFound):
    """GET or DELETE of an id this gateway does not hold: 404, as OpenAI answers."""
    code = "response_not_found"


class PreviousResponseNotFound(InvalidParam):
    """previous_response_id names an id this gateway does not hold: 400 with OpenAI's code, which clients
    and proxies match to resend the whole conversation instead."""
    code = "previous_response_not_found"


class ResponsesAPI:
    """The /v1/responses routes. `store` keeps answered responses (those with `store` not false)."""

    def __init__(self, chat: ChatServing, served_model: str, config: GatewayConfig,
                 store: ResponseStore | None = None) -> None:
        self._chat = chat
        self._served_model = served_model
        self._config = config
        self.store = store or ResponseStore()

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/responses", self.create),
                web.get("/v1/responses/{response_id}", self.retrieve),
                web.delete("/v1/responses/{response_id}", self.delete)]

    async def create(self, request: web.Request) -> web.StreamResponse:
        limit = self._config.max_body_bytes
        body = decode_json_body(await read_body(request, self._config.body_timeout_s, limit), limit)
        previous_id = body.get("previous_response_id") if isinstance(body, dict) else None
        responses_request = to_chat_request(body, self._history(previous_id), previous_id)
        try:
            parsed = await self._chat.parse_body(responses_request.chat_body, "chat", parse_chat_request)
        except InvalidParam as exc:
            raise responses_request.rename(exc) from None
        if parsed.max_tokens_param is not None:  # a limit the decoders' KV budget refuses names our field
            parsed = dataclasses.replace(parsed, max_tokens_param="max_output_tokens")
        answer = ResponseAnswer(responses_request, self.store, self._served_model)
        return await self._chat.serve(request, parsed, answer.write)

    async def retrieve(self, request: web.Request) -> web.Response:
        if request.query:  # include, stream, starting_after: a stored response is only ever given back whole
            name = sorted(request.query)[0]
            raise InvalidParam(name, f"{name} is not supported by this server on GET /v1/responses/{{id}}")
        stored = self.store.get(request.match_info["response_id"])
        if stored is None:
            raise self._not_found(request.match_info["response_id"], "response_id")
        return json_response(stored.response)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not self.store.delete(response_id):
            raise self._not_found(response_id, "response_id")
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    def _history(self, previous_id: object) -> list[Json]:
        if previous_id is None:
            return []
        if not isinstance(previous_id, str):
            raise InvalidParam("previous_response_id", "previous_response_id must be a string")
        stored = self.store.get(previous_id)
        if stored is None:
            raise PreviousResponseNotFound("previous_response_id", self._not_held(previous_id))
        return stored.items

    def _not_found(self, response_id: str, param: str) -> ResponseNotFound:
        return ResponseNotFound(param, self._not_held(response_id))

    def _not_held(self, response_id: str) -> str:
        return (f"no response with id {response_id!r}: this gateway keeps the responses it answered with store "
                f"not false, the most recent {len(self.store)} of them, in memory (a restart forgets them)")


class ResponseAnswer:
    """Writes one request's answer, whole or as typed events, and stores it when asked to."""

    def __init__(self, responses_request: ResponsesRequest, store: ResponseStore, model: str) -> None:
        self._request = responses_request
        self._store = store
        self._model = model

    async def write(self, request: web.Request, choices: Choices) -> web.StreamResponse:
        logprobs = choices.started[0].shapes.logprobs
        output = ResponseOutput("resp_" + choices.request_id.removeprefix("req-"), int(time.time()), self._model,
                                self._request, None if logprobs is None else _step_logprobs(logprobs))
        if self._request.stream:
            return await self._streamed(request, choices, output)
        return await self._whole(request, choices, output)

    async def _whole(self, request: web.Request, choices: Choices, output: ResponseOutput) -> web.StreamResponse:
        finish_reason = "stop"
        async for choice, step in choices.steps():
            output.step(step, _delta(choice, step))
            finish_reason = step.finish_reason or finish_reason
            if client_gone(request):
                choices.set_close_reason("client_disconnected")
                return web.Response(status=499, reason="Client Closed Request")  # nobody reads it
        usage, pdd = self._summary(choices, choices.started[0])
        output.finish(finish_reason, usage, pdd)
        body = output.response(usage, pdd)
        self._keep(output, body)
        return json_response(body, headers={"X-Request-Id": choices.request_id})

    async def _streamed(self, request: web.Request, choices: Choices, output: ResponseOutput) -> web.StreamResponse:
        """As chat streams: the status line goes out with the first token, so a failure before it is
        an HTTP error; after it, a response.failed event."""
        response = web.StreamResponse(headers={**sse.HEADERS, "X-Request-Id": choices.request_id})
        async with contextlib.aclosing(choices.steps()) as steps:
            first = await anext(steps)
            try:
                await response.prepare(request)
                try:
                    await _send(response, output.start())
                    await self._send_step(response, output, choices, *first)
                    async for choice, step in steps:
                        await self._send_step(response, output, choices, choice, step)
                except sse.ClientGone:
                    raise
                except Exception as exc:  # the status line is sent: the error travels as an event
                    if not isinstance(exc, PddError):
                        log.exception("%s: unhandled error while streaming", choices.request_id)
                    else:
                        log.warning("%s: failed while streaming: %s: %s", choices.request_id, type(exc).__name__, exc)
                    tracing.record_error(trace.get_current_span(), exc)
                    status, body = error_payload(exc)
                    request[STREAM_FAILED_STATUS] = status
                    error = body["error"]
                    assert isinstance(error, dict)
                    code = "rate_limit_exceeded" if status == 429 else "server_error"  # OpenAI's codes for it
                    await _send(response, [output.failed(code, str(error["message"]))])
                await response.write_eof()
            except (sse.ClientGone, ConnectionError):
                choices.set_close_reason("client_disconnected")
                log.info("%s: client disconnected", choices.request_id)
        return response

    async def _send_step(self, response: web.StreamResponse, output: ResponseOutput, choices: Choices,
                         choice: Choice, step: Step) -> None:
        await _send(response, output.step(step, _delta(choice, step)))
        if step.finish_reason is not None:
            usage, pdd = self._summary(choices, choice)
            await _send(response, output.finish(step.finish_reason, usage, pdd))
            self._keep(output, output.response(usage, pdd))

    def _summary(self, choices: Choices, choice: Choice) -> tuple[Json, Json]:
        return responses_usage(choices.usage()), choice.generation.pdd_summary()

    def _keep(self, output: ResponseOutput, body: Json) -> None:
        if self._request.store:
            self._store.put(body, [*self._request.items, *as_input_items(output.items)])


async def _send(response: web.StreamResponse, events: list[Json]) -> None:
    for event in events:
        await sse.send(response, b"event: " + str(event["type"]).encode() + b"\n" + b"data: " + orjson.dumps(event)
                       + b"\n\n")


def _step_logprobs(logprobs: Logprobs) -> Callable[[Step], list[Json]]:
    """A step's entries in output_text.logprobs: chat's logprobs.content entries for its token."""
    return lambda step: cast("list[Json]", logprobs.of([step])["content"])


def _delta(choice: Choice, step: Step) -> Json | None:
    """The step's text read for tool calls, as chat reads it; None when the text is not read for calls."""
    return None if choice.tool_deltas is None else choice.tool_deltas.delta(step)
