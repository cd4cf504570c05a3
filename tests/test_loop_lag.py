"""The event-loop lag monitor and what rests on it: a clock that stands still while the loop is
stalled, so the gateway never declares an instance gone for a delay that was its own; and the
lag in each service's metrics."""
from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from services.gateway.routing.registry import InstanceRegistry
from shared.loop_lag import LoopLagMonitor
from shared.messages import Heartbeat
from shared.metrics import GatewayMetrics
from shared.names import Role

STALL_S = 1.2


def heartbeat(instance_id: str = "main-1") -> Heartbeat:
    return Heartbeat(Role.MAIN, instance_id, "127.0.0.1", 1, "model", 0, 0, time.time(), {}, {}, {})


async def settle(monitor: LoopLagMonitor) -> None:
    """Let the sampling task run a few times."""
    await asyncio.sleep(monitor.interval_s * 3)


def stall_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a blocking call on the loop does: nothing else runs meanwhile


async def test_the_clock_does_not_count_a_stall_even_before_the_monitor_has_woken_to_measure_it() -> None:
    monitor = LoopLagMonitor().start()
    try:
        await settle(monitor)
        before_clock, before = monitor.clock(), time.monotonic()
        stall_loop(STALL_S)
        # still inside the stall as far as the loop knows: the sampling task has not run yet
        assert time.monotonic() - before >= STALL_S
        assert monitor.clock() - before_clock < STALL_S / 2
        await settle(monitor)
        assert monitor.stalled_s >= STALL_S - monitor.interval_s - monitor.slack_s
        assert monitor.max_lag_s >= STALL_S - monitor.interval_s
        # and afterwards it runs again
        resumed = monitor.clock()
        await asyncio.sleep(0.3)
        assert monitor.clock() - resumed >= 0.25
    finally:
        monitor.stop()


async def test_an_unstalled_loop_leaves_the_clock_at_monotonic_pace() -> None:
    monitor = LoopLagMonitor().start()
    try:
        await settle(monitor)
        clock0, mono0 = monitor.clock(), time.monotonic()
        await asyncio.sleep(0.5)
        assert abs((monitor.clock() - clock0) - (time.monotonic() - mono0)) < 0.1
    finally:
        monitor.stop()


async def test_a_stalled_gateway_loop_does_not_make_a_live_instance_look_gone() -> None:
    monitor = LoopLagMonitor().start()
    lagging = InstanceRegistry(stale_after_s=0.5, clock=monitor.clock)
    naive = InstanceRegistry(stale_after_s=0.5)  # the registry before: wall-clock ages
    try:
        await settle(monitor)
        for registry in (lagging, naive):
            registry.observe(heartbeat())
        stall_loop(STALL_S)  # heartbeats sent meanwhile sit unread in a socket buffer
        assert not naive.is_alive("main-1")
        assert lagging.is_alive("main-1")
        assert [i.heartbeat.instance_id for i in lagging.alive(Role.MAIN)] == ["main-1"]
        # an instance that really went quiet is still noticed once our loop runs again
        await asyncio.sleep(0.8)
        assert not lagging.is_alive("main-1")
    finally:
        monitor.stop()


async def test_each_services_metrics_carry_its_loop_lag() -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    monitor = metrics.loop_lag_monitor().start()
    try:
        await settle(monitor)
        stall_loop(0.3)
        await settle(monitor)
        samples = metrics.registry.get_sample_value("pdd_event_loop_lag_seconds_count")
        slow = samples - metrics.registry.get_sample_value("pdd_event_loop_lag_seconds_bucket", {"le": "0.2"})
        assert samples >= 3 and slow >= 1
        assert metrics.registry.get_sample_value("pdd_event_loop_lag_max_seconds") >= 0.25
    finally:
        monitor.stop()
