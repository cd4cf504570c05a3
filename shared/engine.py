"""The engine thread: the one thread per service that runs blocking model work.

asyncio code awaits `EngineThread.run(fn, ...)`; the event loop itself never runs a forward
pass, so NATS, sockets and heartbeats stay responsive while the model computes.
"""
from __future__ import annotations

import asyncio
import functools
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

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
