"""A radix cache used from an event loop: every call runs on one worker thread, in call order.

Gathers and inserts copy KV (inserting a 4k-token prompt clones about 190 MB of SmolLM2's), so on
the event loop they would hold every socket and heartbeat of the service for that long. On one
worker they run beside the loop, and since there is only one, the tree is never touched by two
threads at once. `call` waits for the result; `post` does not (a release on a path that must not
wait), and still runs after everything called before it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from shared.radix_cache import RadixCache

log = logging.getLogger(__name__)
T = TypeVar("T")


class CacheWorker:
    def __init__(self, tree: RadixCache, name: str) -> None:
        self.tree = tree  # only ever touched through call and post
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._gauges = tree.gauges()

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the worker. Cancelling the caller does not stop a call that has begun."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._run, fn, args)

    def post(self, fn: Callable[..., object], *args: object) -> None:
        """`fn(*args)` on the worker, without waiting; an error is logged."""
        self._pool.submit(self._run, fn, args).add_done_callback(_log_failure)

    def gauges(self) -> dict[str, float]:
        """The cache's gauges as the last call left them (reading the tree here could race the worker)."""
        return self._gauges

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def _run(self, fn: Callable[..., T], args: tuple) -> T:
        try:
            return fn(*args)
        finally:
            self._gauges = self.tree.gauges()


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("cache call failed", exc_info=future.exception())
