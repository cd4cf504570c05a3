"""Writing a request's answer from its choices: whole, as one JSON object, or streamed, a chunk
per step over SSE, its status line sent with the first token, so that a failure before it is an
HTTP error and only one after it an error event.

Owns the response; the steps are choices.py's, the objects' shapes response_shapes.py's.
"""
from __future__ import annotations

import collections
import contextlib
import logging

import orjson
from aiohttp import web
from opentelemetry import trace

from services.gateway.http import sse
from services.gateway.http.choices import Choice, Choices
from services.gateway.http.client_watch import client_gone
from services.gateway.http.generation import Step
from services.gateway.http.http_errors import error_payload
from services.gateway.observe.request_telemetry import STREAM_FAILED_STATUS
from shared import tracing
from shared.errors import PddError

log = logging.getLogger(__name__)

Json = dict[str, object]


def json_response(body: Json, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


async def whole_answer(request: web.Request, choices: Choices) -> web.StreamResponse:
    """Every choice read to its end, then one chat.completion or text_completion."""
    steps: dict[int, list[Step]] = collections.defaultdict(list)
    async for choice, step in choices.steps():
        steps[choice.index].append(step)
        if client_gone(request):
            choices.set_close_reason("client_disconnected")
            return web.Response(status=499, reason="Client Closed Request")  # nobody reads it
    bodies = [c.shapes.choice("".join(s.text for s in steps[c.index]), steps[c.index],
                              c.generation.finish_reason or "stop", c.tools) for c in choices.started]
    pdd = choices.started[0].generation.pdd_summary()
    if len(choices.started) > 1:
        pdd = {**pdd, "choices": [c.generation.pdd_summary() for c in choices.started]}
    body = choices.shapes.completion(bodies, choices.usage(), pdd)
    return json_response(body, headers={"X-Request-Id": choices.request_id})


async def streamed_answer(request: web.Request, choices: Choices) -> web.StreamResponse:
    """A chunk per step as it comes, each choice's final chunk, the usage chunk when asked for, [DONE].

    The status line goes out with the first token: a failure before it (no P to serve the request,
    say) is raised, and answered with its own status like any other error. After it, the error is an
    SSE event, and the response metric counts it under the status it would have had."""
    request_id = choices.request_id
    response = web.StreamResponse(headers={**sse.HEADERS, "X-Request-Id": request_id})
    async with contextlib.aclosing(choices.steps()) as steps:
        first = await anext(steps)
        try:
            await response.prepare(request)
            try:
                await _send_step(response, *first)
                async for choice, step in steps:
                    await _send_step(response, choice, step)
                if choices.shapes.include_usage:
                    await sse.send(response, sse.event(choices.shapes.usage_chunk(choices.usage())))
            except sse.ClientGone:
                raise
            except Exception as exc:  # the status line is sent: the error travels as an SSE event
                if not isinstance(exc, PddError):
                    log.exception("%s: unhandled error while streaming", request_id)
                else:
                    log.warning("%s: failed while streaming: %s: %s", request_id, type(exc).__name__, exc)
                tracing.record_error(trace.get_current_span(), exc)
                status, body = error_payload(exc)
                request[STREAM_FAILED_STATUS] = status
                await sse.send(response, sse.event(body))
            await sse.send(response, sse.DONE)
            await response.write_eof()
        except (sse.ClientGone, ConnectionError):
            choices.set_close_reason("client_disconnected")
            log.info("%s: client disconnected", request_id)
    return response


async def _send_step(response: web.StreamResponse, choice: Choice, step: Step) -> None:
    """The step's chunk, and its choice's final chunk when the step ends it."""
    generation = choice.generation
    delta = None if choice.tool_deltas is None else choice.tool_deltas.delta(step)
    await sse.send(response, sse.event(choice.shapes.token_chunk(step, generation.run.pipeline, delta)))
    if step.finish_reason is not None:
        finish_reason = (step.finish_reason if choice.tool_deltas is None
                         else choice.tool_deltas.finish_reason(step.finish_reason))
        await sse.send(response, sse.event(choice.shapes.final_chunk(finish_reason, generation.summary(),
                                                                     generation.take_handoff())))
