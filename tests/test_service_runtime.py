"""shared/service_runtime.py: a service that says it cannot go on (its engine thread died) is
stopped in order and its process exits with status 1, so a supervisor sees it gone."""
from __future__ import annotations

import asyncio
import threading

from shared.service_runtime import ServiceFailure, run_service


class Recorder:
    """A service whose work thread fails once started (as an engine thread that dies)."""

    def __init__(self, fail_before_start: bool = False) -> None:
        self.failure = ServiceFailure()
        self.calls: list[str] = []
        if fail_before_start:
            self.failure.fail("died while loading")

    async def start(self) -> None:
        self.calls.append("start")
        threading.Thread(target=self.failure.fail, args=("the engine thread died: RuntimeError()",)).start()

    async def stop(self) -> None:
        self.calls.append("stop")


async def test_a_failed_service_is_stopped_and_exits_with_status_1() -> None:
    service = Recorder()
    assert await asyncio.wait_for(run_service(service, "test"), 10) == 1
    assert service.calls == ["start", "stop"]
    assert service.failure.reason == "the engine thread died: RuntimeError()"


async def test_a_failure_before_the_loop_runs_is_kept_for_it() -> None:
    service = Recorder(fail_before_start=True)
    assert await asyncio.wait_for(run_service(service, "test"), 10) == 1
    assert service.failure.reason == "died while loading", "the first reason wins"
