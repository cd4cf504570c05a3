"""shared/service_runtime.py: a service that says it cannot go on (its engine thread died) is
stopped in order and its process exits with status 1, so a supervisor sees it gone; from the moment
it says so, it neither beats nor answers pings, and reports its requests' failures as its stopping.
The heartbeat test runs on a real nats-server."""
from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import AsyncIterator

import pytest

from shared import bus, messages, subjects
from shared.errors import InstanceStopping
from shared.messages import Heartbeat
from shared.service_runtime import ServiceFailure, heartbeat_loop, run_service
from tools.nats_config import find_nats_server
from tools.stack_config import LOOPBACK, free_port


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


def test_once_failed_a_requests_failure_is_reported_as_the_instance_stopping() -> None:
    failure = ServiceFailure()
    assert failure.reported("not_admitted", "the engine stopped") == ("not_admitted", "the engine stopped")
    failure._set("the engine thread died")  # what `fail` schedules on the service's loop
    code, message = failure.reported("not_admitted", "the engine stopped")
    assert code == InstanceStopping.code and "the engine stopped" in message and "the engine thread died" in message


@pytest.fixture
async def nats_url(tmp_path) -> AsyncIterator[str]:
    port = free_port()
    server = subprocess.Popen([str(find_nats_server()), "-a", LOOPBACK, "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"nats://{LOOPBACK}:{port}"
        async with asyncio.timeout(10):
            while True:
                try:
                    await (await bus.connect(url, "probe")).close()
                    break
                except Exception:
                    await asyncio.sleep(0.05)
        yield url
    finally:
        server.kill()
        server.wait()


async def test_a_failed_service_stops_beating_and_its_pings_find_nobody_at_once(nats_url) -> None:
    """Before its stop (which may take a while): the gateway must not see it alive and give it work."""
    service_nc, gateway_nc = await bus.connect(nats_url, "service"), await bus.connect(nats_url, "gateway")
    failure = ServiceFailure()
    failure.bind()
    beats: list[float] = []

    async def on_beat(msg) -> None:
        beats.append(messages.decode(msg.data).sent_at)

    await gateway_nc.subscribe(subjects.heartbeat("main"), cb=on_beat)
    await gateway_nc.flush()  # the server has the subscription before the first beat
    describe = lambda: Heartbeat("main", "main-1", "127.0.0.1", 1, "tiny", 0, 0, time.time())  # noqa: E731
    beating = asyncio.create_task(heartbeat_loop(service_nc, "main", 60.0, describe, failure))
    try:
        async with asyncio.timeout(5):  # it answers pings (its first beat went at once; the next is a minute away)
            while await bus.ping(gateway_nc, subjects.ping("main", "main-1"), 0.5) is not True:
                await asyncio.sleep(0.05)
        failure.fail("the engine thread died")
        await asyncio.wait_for(beating, 2.0)  # it ends at once, not at the next beat
        assert len(beats) <= 1, "no beat after the failure"
        # nobody answers: NATS says so (a ping that times out, which the server now and then lets
        # happen just after an unsubscribe, proves nothing either way; the gateway pings again)
        answers = [await bus.ping(gateway_nc, subjects.ping("main", "main-1"), 0.5) for _ in range(3)]
        assert False in answers and True not in answers, answers
        assert service_nc.is_connected, "the connection itself is the service's stop to close"
    finally:
        beating.cancel()
        await service_nc.close()
        await gateway_nc.close()
