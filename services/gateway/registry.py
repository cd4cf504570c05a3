"""The gateway's view of live instances, fed by their heartbeats (routing never has to ask)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from shared.errors import PeerGone
from shared.messages import Heartbeat
from shared.subjects import ROLES


@dataclass
class Instance:
    heartbeat: Heartbeat
    last_seen: float
    in_flight: int = 0  # requests this gateway sent since the last heartbeat counted them

    @property
    def load(self) -> int:
        return self.heartbeat.running + self.heartbeat.waiting + self.in_flight


class InstanceRegistry:
    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self._instances: dict[str, Instance] = {}

    def observe(self, heartbeat: Heartbeat) -> None:
        self._instances[heartbeat.instance_id] = Instance(heartbeat, time.monotonic())

    def alive(self, role: str) -> list[Instance]:
        cutoff = time.monotonic() - self.stale_after_s
        return [i for i in self._instances.values() if i.heartbeat.role == role and i.last_seen >= cutoff]

    def pick(self, role: str) -> Instance:
        """The least-loaded live instance of `role`."""
        candidates = self.alive(role)
        if not candidates:
            raise PeerGone(f"no live {role} instance")
        chosen = min(candidates, key=lambda i: (i.load, i.heartbeat.instance_id))
        chosen.in_flight += 1
        return chosen

    def counts(self) -> dict[str, int]:
        return {role: len(self.alive(role)) for role in ROLES}
