"""Helpers shared by the end-to-end tests: deterministic prompts and fresh heartbeats."""
from __future__ import annotations

import asyncio
import random
import time

from shared import bus, messages, subjects


def random_prompt(seed: int, n: int) -> list[int]:
    """n token ids in the tiny model's vocabulary, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


async def fresh_heartbeats(nats_url: str, roles: tuple[str, ...] = ("prefill", "relay", "main"),
                           timeout_s: float = 10.0) -> dict[str, messages.Heartbeat]:
    """One heartbeat per role, each sent after this call began (so it reflects the present)."""
    after = time.time() + 0.05
    nc = await bus.connect(nats_url, "test-heartbeats")
    seen: dict[str, messages.Heartbeat] = {}

    async def on_beat(msg) -> None:
        beat = messages.decode(msg.data)
        if beat.sent_at > after:
            seen[beat.role] = beat

    await nc.subscribe(subjects.heartbeat_all(), cb=on_beat)
    try:
        async with asyncio.timeout(timeout_s):
            while not set(roles) <= set(seen):
                await asyncio.sleep(0.05)
    finally:
        await nc.close()
    return seen


async def busy_instance(nats_url: str, role: str, timeout_s: float = 10.0) -> str:
    """The id of an instance of `role` whose fresh heartbeat shows a request running on it."""
    after = time.time() + 0.05
    nc = await bus.connect(nats_url, "test-busy-instance")
    found: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_beat(msg) -> None:
        beat = messages.decode(msg.data)
        if beat.role == role and beat.sent_at > after and beat.running > 0 and not found.done():
            found.set_result(beat.instance_id)

    await nc.subscribe(subjects.heartbeat_all(), cb=on_beat)
    try:
        async with asyncio.timeout(timeout_s):
            return await found
    finally:
        await nc.close()
