"""The engine thread: the one thread per service that runs blocking model work.

asyncio code awaits `EngineThread.run(fn, ...)`; the event loop itself never runs a forward
pass, so NATS, sockets and heartbeats stay responsive while the model computes.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class EngineThread:
    def __init__(self, name: str, torch_threads: int = 0) -> None:
        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{name}")
        self._queued = 0  # calls submitted and not yet started (or given up while waiting)
        self._lock = threading.Lock()

    @property
    def queued(self) -> int:
        """Calls waiting for the engine thread (the one running is not counted)."""
        return self._queued

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return (await self.run_timed(fn, *args))[0]

    async def run_timed(self, fn: Callable[..., T], *args: object) -> tuple[T, int, int]:
        """The call's result, and when it was submitted and when it started (time.time_ns)."""
        loop = asyncio.get_running_loop()
        submitted_ns = time.time_ns()
        started_ns = submitted_ns
        left_queue = False

        def leave_queue() -> None:
            nonlocal left_queue
            with self._lock:
                if not left_queue:
                    left_queue = True
                    self._queued -= 1

        def call() -> T:
            nonlocal started_ns
            started_ns = time.time_ns()
            leave_queue()
            return fn(*args)

        with self._lock:
            self._queued += 1
        try:
            result = await loop.run_in_executor(self._executor, call)
        finally:
            leave_queue()  # a call cancelled before it started never runs
        return result, submitted_ns, started_ns

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
