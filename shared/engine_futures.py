"""Settling a caller's asyncio future from the engine thread, on the future's own loop.

A caller that gave up (its future cancelled, its loop closed) is skipped, never an error.
"""
from __future__ import annotations

import asyncio


def settle(future: asyncio.Future, result: object = None, exc: BaseException | None = None,
           cancel: bool = False) -> None:
    """On the future's loop: settle it, unless the caller gave up (cancelled it)."""
    if future.done():
        return
    if cancel:
        future.cancel()
    elif exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def notify(future: asyncio.Future, result: object = None, exc: BaseException | None = None,
           cancel: bool = False) -> None:
    """Settle a future from the engine thread, on its own loop."""
    try:
        future.get_loop().call_soon_threadsafe(settle, future, result, exc, cancel)
    except RuntimeError:  # its loop is closed: nobody is waiting any more
        pass


def follow(source: asyncio.Future, target: asyncio.Future) -> None:
    """From the engine thread: settle `target` (a feed-only work's, result None) as `source` settles."""
    def settle_target(done: asyncio.Future) -> None:
        if done.cancelled():
            settle(target, cancel=True)
        else:
            settle(target, exc=done.exception())

    try:  # registered before source's own settling, which also goes through call_soon_threadsafe
        source.get_loop().call_soon_threadsafe(source.add_done_callback, settle_target)
    except RuntimeError:  # its loop is closed: nobody is waiting any more
        pass
