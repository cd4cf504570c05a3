"""Who gets in at the gateway: the optional API key, and a bound on requests in flight.

Up to --max-running-requests run at once. Past that, a new request waits in a FIFO queue of at
most --max-queued-requests, until a running one ends, its own deadline passes, or its client goes
away. Past the queue it is refused at once with 429 and a Retry-After worked out from the queue,
so the client knows when to come back, and no request once accepted fails for want of room.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from shared.errors import DeadlineExceeded, PddError

# how often a waiting request looks at its client's connection (aiohttp does not cancel the handler):
# a client gone is noticed well within a second, queued (here) or waiting for its first token (client_watch)
CLIENT_CHECK_S = 0.25
RUN_S_GUESS = 1.0  # a request's duration until one has been measured
RUN_S_WEIGHT = 0.2  # weight of the newest duration in the moving mean


class Unauthorized(PddError):
    code = "invalid_api_key"


class Overloaded(PddError):
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ClientLeft(PddError):
    """The client went away while its request waited in the queue."""

    code = "client_disconnected"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Admission:
    def __init__(self, max_running: int, max_queued: int, api_key: str | None) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.api_key = api_key
        self.running = 0
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()  # a turn is set when it may run
        self._mean_run_s: float | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def check_key(self, request: web.Request) -> None:
        if self.api_key is None:
            return
        # The scheme is required and case-insensitive (RFC 9110, section 11.1): "bearer <key>" is good, "<key>" is not.
        scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise Unauthorized("a valid API key is required: Authorization: Bearer <key>")

    def retry_after_s(self) -> int:
        """When a refused client may expect room: the queue ahead of it drained at the running limit."""
        mean_s = self._mean_run_s or RUN_S_GUESS
        return max(1, math.ceil(self.queued * mean_s / max(1, self.max_running)))

    @contextlib.asynccontextmanager
    async def slot(self, deadline_at: float, client_gone: Callable[[], bool]) -> AsyncIterator[float]:
        """Run the body in one of the running slots, once it has one; yields the seconds it queued.

        `deadline_at` (time.monotonic()) bounds the wait: past it, DeadlineExceeded. Raises
        Overloaded when the queue is full, ClientLeft when `client_gone()` while it waits."""
        queued_at = time.monotonic()
        if self.max_running and (self.running >= self.max_running or self._queue):
            await self._wait_turn(deadline_at, client_gone)  # the slot is handed over with the turn
        else:
            self.running += 1
        started_at = time.monotonic()
        try:
            yield started_at - queued_at
        finally:
            self._observe(time.monotonic() - started_at)
            self._release()

    async def _wait_turn(self, deadline_at: float, client_gone: Callable[[], bool]) -> None:
        if len(self._queue) >= self.max_queued:
            raise Overloaded(f"the gateway is at its limit of {self.max_running} requests in flight and "
                             f"{self.max_queued} queued; retry shortly", self.retry_after_s())
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        try:
            while not turn.done():
                left_s = deadline_at - time.monotonic()
                if left_s <= 0:
                    raise DeadlineExceeded(f"the request deadline passed while it waited for one of the "
                                           f"{self.max_running} running slots")
                if client_gone():
                    raise ClientLeft("the client went away while its request was queued")
                await asyncio.wait([turn], timeout=min(left_s, CLIENT_CHECK_S))
        except BaseException:
            if turn.done():  # the slot came just as the wait ended: pass it on
                self._release()
            else:
                turn.cancel()
                self._queue.remove(turn)
            raise

    def _release(self) -> None:
        """A running slot is free: the first request queued takes it, or it goes."""
        if self._queue:
            self._queue.popleft().set_result(None)
        else:
            self.running -= 1

    def _observe(self, run_s: float) -> None:
        mean_s = self._mean_run_s
        self._mean_run_s = run_s if mean_s is None else mean_s + RUN_S_WEIGHT * (run_s - mean_s)


def key_middleware(admission: Admission, open_paths: frozenset[str]) -> Middleware:
    """Every route needs the API key (when one is set) but `open_paths`: a route added later is
    closed unless someone opens it."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in open_paths:
            admission.check_key(request)
        return await handler(request)

    return middleware
