"""Noticing a client that went away while its request waits (for its first token, say), when
no write would fail to tell us: aiohttp does not cancel handlers on disconnect by default."""
from __future__ import annotations

import asyncio
from types import TracebackType

from aiohttp import web

from services.gateway.http.admission import CLIENT_CHECK_S, ClientLeft


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class ClientWatch:
    """`with ClientWatch(request):` cancels the body once the client has gone, and turns that
    cancellation into ClientLeft (as asyncio.timeout turns its own into TimeoutError)."""

    def __init__(self, request: web.Request, every_s: float = CLIENT_CHECK_S) -> None:
        self._request = request
        self._every_s = every_s
        self._task: asyncio.Task | None = None
        self._handle: asyncio.TimerHandle | None = None
        self.gone = False

    def __enter__(self) -> ClientWatch:
        self._task = asyncio.current_task()
        self._schedule()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self.gone and exc_type is asyncio.CancelledError and self._task is not None \
                and self._task.uncancel() == 0:
            raise ClientLeft("the client went away before its response was complete") from None

    def _schedule(self) -> None:
        self._handle = asyncio.get_running_loop().call_later(self._every_s, self._check)

    def _check(self) -> None:
        if not client_gone(self._request):
            self._schedule()
        elif self._task is not None and not self._task.done():
            self.gone = True
            self._task.cancel()
