"""Who gets in at the gateway: the optional API key, and a bound on requests in flight.

When the stack is full a new request is refused at once with 429 and Retry-After, instead of
queueing where its client cannot see it and timing out later.
"""
from __future__ import annotations

import contextlib
import hmac
from collections.abc import Iterator

from aiohttp import web

from shared.errors import PddError


class Unauthorized(PddError):
    code = "invalid_api_key"


class Overloaded(PddError):
    code = "overloaded"


class Admission:
    def __init__(self, max_running: int, api_key: str | None) -> None:
        self.max_running = max_running
        self.api_key = api_key
        self.running = 0

    def check_key(self, request: web.Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise Unauthorized("a valid API key is required: Authorization: Bearer <key>")

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        if self.max_running and self.running >= self.max_running:
            raise Overloaded(f"the gateway is at its limit of {self.max_running} requests in flight; retry shortly")
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
