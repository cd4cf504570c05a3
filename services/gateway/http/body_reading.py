"""Reading a request body under a deadline, so a client that sends half a body cannot hold a
connection (aiohttp has no body timeout of its own; its keep-alive timer bounds the head)."""
from __future__ import annotations

import asyncio

from aiohttp import web

from services.gateway.http.request_parsing import PayloadTooLarge
from shared.errors import PddError


class BodyTimeout(PddError):
    """The body did not arrive whole within its deadline: answered 408, and the connection closed."""

    code = "request_timeout"


async def read_body(request: web.Request, deadline_s: float, max_bytes: int | None = None) -> bytes:
    """The whole body; past `max_bytes` (else the app's client_max_size) a 413."""
    if max_bytes is not None and request.content_length is not None and request.content_length > max_bytes:
        raise PayloadTooLarge(f"request body is {request.content_length} bytes; the limit is {max_bytes}")
    try:
        async with asyncio.timeout(deadline_s):
            return await request.read()
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive whole within {deadline_s:g}s") from None


async def answer_and_close(request: web.Request, response: web.Response) -> web.Response:
    """Send `response` now and close the connection: aiohttp would otherwise linger, reading the
    rest of a body that a slow client may never send."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if request.transport is not None:
        request.transport.close()  # flushes what was written first
    return response
