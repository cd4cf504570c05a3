"""The gateway's one mapping from exception to HTTP error response (OpenAI error shape)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from services.gateway.http.admission import ClientLeft, Overloaded, Unauthorized
from services.gateway.http.body_reading import BodyTimeout, answer_and_close
from services.gateway.http.request_parsing import NotFound, PayloadTooLarge
from shared.errors import BadRequest, DeadlineExceeded, PddError, PeerGone

log = logging.getLogger(__name__)

Json = dict[str, object]


def error_payload(exc: BaseException) -> tuple[int, Json]:
    """HTTP status and OpenAI-style error body for an exception (also sent as an SSE event mid-stream)."""
    if isinstance(exc, NotFound):
        status = 404
    elif isinstance(exc, Unauthorized):
        status = 401
    elif isinstance(exc, Overloaded):
        status = 429
    elif isinstance(exc, BodyTimeout):
        status = 408
    elif isinstance(exc, ClientLeft):
        status = 499  # nobody reads it; counted as the client going away
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
    headers = {"Retry-After": str(getattr(exc, "retry_after_s", 1))} if status in (429, 503) else {}
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
        elif not isinstance(exc, (BadRequest, BodyTimeout)):
            log.warning("%s %s: %s: %s", request.method, request.path, type(exc).__name__, exc)
        if isinstance(exc, BodyTimeout):
            return await answer_and_close(request, error_response(exc))
        return error_response(exc)


