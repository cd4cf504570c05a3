"""Fast death notice: the gateway pings every live instance several times a second.

Heartbeats notice a dead instance only after several missed beats (3.5 s at the default 1 s).
A killed process's NATS connection closes at once, and with it its subscriptions, so a ping to
it gets NATS's "no responders" within a round trip: the instance is marked gone in the registry,
and every request on it recovers at its next watchdog check. A ping that times out proves
nothing (a slow or cut link); the heartbeats still decide those. An answered ping's round trip
feeds the policy's estimate of when MD can start (services/gateway/routing/cost_model.py).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.aio.client import Client as NATS

from services.gateway.routing.registry import InstanceRegistry
from shared import bus, subjects
from shared.messages import Heartbeat

log = logging.getLogger(__name__)

PING_INTERVAL_S = 0.25
PING_TIMEOUT_S = 0.5


async def ping_instances(nc: NATS, registry: InstanceRegistry, on_round_trip: Callable[[str, float], None],
                         interval_s: float = PING_INTERVAL_S, timeout_s: float = PING_TIMEOUT_S) -> None:
    """Runs until cancelled."""
    while True:
        instances = registry.watched()
        await asyncio.gather(*(_ping(nc, registry, i.heartbeat, on_round_trip, timeout_s) for i in instances))
        await asyncio.sleep(interval_s)


async def _ping(nc: NATS, registry: InstanceRegistry, beat: Heartbeat, on_round_trip: Callable[[str, float], None],
                timeout_s: float) -> None:
    started = registry.clock()  # a round trip is not stretched by a stall of our own loop
    answer = await bus.ping(nc, subjects.ping(beat.role, beat.instance_id), timeout_s)
    if answer is True:
        registry.mark_answered(beat.instance_id)
        on_round_trip(beat.instance_id, registry.clock() - started)
    elif answer is False:
        log.warning("%s %s: nobody answers its ping: gone", beat.role, beat.instance_id)
        registry.mark_gone(beat.instance_id)
