"""Fast death notice: the gateway pings every instance it has requests on, several times a second.

Heartbeats notice a dead instance only after several missed beats (3.5 s at the default 1 s).
A killed process's NATS connection closes at once, and with it its subscriptions, so a ping to
it gets NATS's "no responders" within a round trip: the instance is marked gone in the registry,
and every request on it recovers at its next watchdog check. A ping that times out proves
nothing (a slow or cut link); the heartbeats still decide those.
"""
from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NATS

from shared import bus, subjects
from services.gateway.registry import InstanceRegistry

log = logging.getLogger(__name__)

PING_INTERVAL_S = 0.25
PING_TIMEOUT_S = 0.5


async def ping_instances_in_use(nc: NATS, registry: InstanceRegistry, interval_s: float = PING_INTERVAL_S,
                                timeout_s: float = PING_TIMEOUT_S) -> None:
    """Runs until cancelled."""
    while True:
        instances = registry.in_use()
        answers = await asyncio.gather(*(
            bus.ping(nc, subjects.ping(i.heartbeat.role, i.heartbeat.instance_id), timeout_s) for i in instances))
        for instance, answer in zip(instances, answers):
            if answer is False:
                log.warning("%s %s: nobody answers its ping: gone", instance.heartbeat.role,
                            instance.heartbeat.instance_id)
                registry.mark_gone(instance.heartbeat.instance_id)
        await asyncio.sleep(interval_s)
