"""Server-sent events as OpenAI streams them: `data: <json>` frames, `data: [DONE]` at the end,
and a write that fails because the client went away raised as ClientGone.

Framing and writing only; what the events say is response_shapes.py's.
"""
from __future__ import annotations

import orjson
from aiohttp import web

Json = dict[str, object]

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


def event(payload: Json) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def send(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one
        raise ClientGone(str(exc)) from exc
