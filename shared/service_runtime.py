"""What every pdd service does the same way: logging, signals, heartbeats, ordered shutdown.

A service object has `async start()` and `async stop()`, and runs `heartbeat_loop` with a function that
describes it as a `Heartbeat` (published every interval and the answer to liveness pings);
`serve` sets up logging and tracing and runs it; `run_service` starts it, waits for SIGINT/SIGTERM (signals only
set an Event; a second one forces exit) or for the service to say it cannot go on (`ServiceFailure`: its engine
thread died), then stops it within a deadline; a failed service exits with status 1, so whatever supervises it
(`pdd up --on-child-exit`, compose's restart policy, systemd) sees it gone rather than a live
process that answers pings and fails every request.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared import bus, gc_heap, messages, subjects, tracing
from shared.config import CommonConfig
from shared.errors import InstanceStopping
from shared.messages import Heartbeat

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0


class Service(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


class ServiceFailure:
    """Set, from any thread, when a service cannot go on; run_service then stops it and exits 1."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early: str | None = None  # a failure before the loop was bound
        self._lock = threading.Lock()

    def bind(self) -> None:
        """On the service's loop (run_service does it before start)."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            early = self._early
        if early is not None:
            self._set(early)

    def fail(self, reason: str) -> None:
        """Thread-safe; the first reason wins."""
        with self._lock:
            if self._loop is None:
                self._early = self._early or reason
                return
            loop = self._loop
        try:
            loop.call_soon_threadsafe(self._set, reason)
        except RuntimeError:  # the loop closed: the service is gone anyway
            pass

    def _set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self._event.set()

    async def wait(self) -> str:
        await self._event.wait()
        return self.reason or ""

    def reported(self, code: str, message: str) -> tuple[str, str]:
        """A request's failure as the service reports it (code, message): once the service cannot
        go on, any failure is its stopping, so the gateway moves the request elsewhere rather than
        back to an instance that may answer pings for a moment longer. The engine settles a dead
        loop's futures after calling `fail`, on the same loop, so their failures see it set."""
        if self.reason is None:
            return code, message
        return InstanceStopping.code, f"{message} (the instance is stopping: {self.reason})"


def setup_logging(level: str, instance_id: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {instance_id} %(name)s: %(message)s")


async def heartbeat_loop(nc: NATS, role: str, interval_s: float, describe: Callable[[], Heartbeat],
                         failure: ServiceFailure | None = None) -> None:
    """Announce this instance every interval (the gateway forgets instances that go quiet) and answer
    liveness pings with a heartbeat (a dead instance's ping subject has no responders at once).
    Once `failure` is set, both stop at once, before the service's stop: an instance that cannot go
    on must not look alive, and its pings find nobody, as a dead one's do."""
    async def on_ping(msg: Msg) -> None:
        await msg.respond(messages.encode(describe()))

    pings = await nc.subscribe(subjects.ping(role, describe().instance_id), cb=on_ping)
    failed = asyncio.ensure_future(failure.wait() if failure is not None else asyncio.Event().wait())
    try:
        while not failed.done():
            if nc.is_connected:
                try:
                    await bus.publish(nc, subjects.heartbeat(role), describe())
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a missed beat is retried next interval
                    log.debug("heartbeat not sent: %s", exc)
            await asyncio.wait({failed}, timeout=interval_s)
        log.warning("%s: no more heartbeats or ping answers: the service is stopping", role)
        try:
            await pings.unsubscribe()
            await nc.flush(timeout=2)  # the server has it: pings find nobody from now on
        except Exception as exc:  # the connection is closing: its subscriptions go with it
            log.debug("ping subscription not closed: %s", exc)
    finally:
        failed.cancel()


def now() -> float:
    return time.time()


# What an operator names wrongly at start (a file, a model, a port, NATS credentials): one line that
# says so, not a traceback (a container's log shows only its last lines).
START_ERRORS = (bus.NatsConfigError, OSError)


def serve(name: str, common: CommonConfig, make_service: Callable[[], Service]) -> None:
    """A service's whole life as its __main__ runs it: logging and tracing set up, then run_service."""
    setup_logging(common.log_level, common.instance_id)
    provider = tracing.setup_tracing(f"pdd-{name}", common.instance_id, common.otlp_endpoint)
    try:
        service = make_service()
    except START_ERRORS as exc:
        raise SystemExit(f"{name} cannot start: {exc}") from exc
    status = asyncio.run(run_service(service, name, freeze_heap=common.gc_freeze == "on"))
    # The interpreter's own teardown of torch and transformers takes seconds (3 s on a loaded 2-core
    # machine) and frees nothing the OS would not: flush what would be lost (spans, log lines), then go.
    provider.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


async def run_service(service: Service, name: str, *, freeze_heap: bool = False) -> int:
    """Start the service, run it until a signal or its failure, stop it; the exit status (1: it failed).
    With `freeze_heap` (a service's own process: `serve`), what start-up left on the heap is frozen
    once it has started (`gc_heap`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            log.warning("second signal: exiting now")
            os._exit(1)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    failure: ServiceFailure | None = getattr(service, "failure", None)
    if failure is not None:
        failure.bind()
    try:
        await service.start()
    except START_ERRORS as exc:
        raise SystemExit(f"{name} cannot start: {exc}") from exc
    if freeze_heap:
        heap = gc_heap.freeze_startup_heap()
        log.info("froze %d start-up objects out of the garbage collector's sight: a full collection took "
                 "%.3fs before, %.4fs after", heap.objects, heap.full_collection_s, heap.full_collection_after_s)
    log.info("%s ready", name)
    waits: set[asyncio.Future[object]] = {asyncio.ensure_future(stop.wait())}
    if failure is not None:
        waits.add(asyncio.ensure_future(failure.wait()))
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    failed = failure.reason if failure is not None else None
    if failed is not None:
        log.critical("%s cannot go on: %s; stopping, exit status 1", name, failed)
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(SHUTDOWN_TIMEOUT_S):
            await service.stop()
    except TimeoutError:
        log.warning("%s: shutdown took over %.0fs; exiting anyway", name, SHUTDOWN_TIMEOUT_S)
    log.info("%s stopped in %.2fs", name, time.monotonic() - t0)
    return 1 if failed is not None else 0
