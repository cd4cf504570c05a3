"""The gateway's view of live instances, fed by their heartbeats (routing never has to ask)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from shared.errors import PeerGone
from shared.messages import Heartbeat
from shared.names import Role


class NoLiveInstance(PeerGone):
    """No instance of a role is heard from at all: none started yet, all dead, or one restarting."""

    def __init__(self, role: Role, message: str) -> None:
        super().__init__(message)
        self.role = role


@dataclass
class Instance:
    heartbeat: Heartbeat
    last_seen: float  # on the registry's clock
    in_flight: int = 0  # this gateway's requests on the instance now (exact, unlike the heartbeat)
    gone_at: float | None = None  # wall time NATS said nobody answers its ping: dead until it beats again
    answered_at: float | None = None  # registry clock time its last ping was answered (both ways open)

    @property
    def load(self) -> int:
        """Requests on the instance. This gateway's own count is exact and current; a heartbeat's
        count may be a beat old, so it only adds what waits in the instance's queue."""
        return self.in_flight + self.heartbeat.waiting


class InstanceRegistry:
    """Live instances by role. An instance is alive while it is heard from: a fresh heartbeat, or a
    ping it answered lately (a busy instance whose beats lag is busy, not gone). It is dropped when
    both stop or its ping finds nobody (services/gateway/routing/liveness.py), and skipped for a
    while when a call to it failed and its pings go unanswered too. Ages are measured on `clock`:
    the gateway passes its loop-lag clock (shared/loop_lag.py), so a heartbeat still unread because
    the gateway's own loop was stalled never makes an instance look gone."""

    def __init__(self, stale_after_s: float, suspect_for_s: float = 5.0,
                 on_gone: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after_s
        self.clock = clock  # every age is measured on it: the gateway's stands still while its loop stalls
        self.suspect_for_s = suspect_for_s
        self._on_gone = on_gone  # told the id of an instance found dead (its caches died with it)
        self._instances: dict[str, Instance] = {}
        self._suspect_until: dict[str, float] = {}
        self._beat = asyncio.Event()  # set, and replaced, at every heartbeat: wakes `wait_alive`

    def observe(self, heartbeat: Heartbeat) -> None:
        known = self._instances.get(heartbeat.instance_id)
        if known is not None and known.gone_at is not None and heartbeat.sent_at <= known.gone_at:
            return  # sent before it died, arriving late
        self._instances[heartbeat.instance_id] = Instance(
            heartbeat, self.clock(), known.in_flight if known else 0,
            answered_at=known.answered_at if known else None)
        self._beat.set()
        self._beat = asyncio.Event()

    async def wait_alive(self, role: Role, timeout_s: float, poll_s: float = 0.25) -> bool:
        """Wait up to `timeout_s` for an instance of `role` to be alive (a restarted one beating, a
        suspect's time over); True once one is. Woken by heartbeats, and every `poll_s` for suspects."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.alive(role):
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                async with asyncio.timeout(min(left, poll_s)):
                    await self._beat.wait()
            except TimeoutError:
                pass
        return True

    def mark_gone(self, instance_id: str) -> None:
        """NATS says nobody answers the instance's ping: it is dead, whatever its last heartbeat says."""
        instance = self._instances.get(instance_id)
        if instance is not None and instance.gone_at is None:
            instance.gone_at = time.time()
            if self._on_gone is not None:
                self._on_gone(instance_id)

    def mark_answered(self, instance_id: str) -> None:
        instance = self._instances.get(instance_id)
        if instance is not None:
            instance.answered_at = self.clock()

    def answering(self, role: Role, within_s: float) -> list[Instance]:
        """Live instances of `role` whose ping was answered within the last `within_s`."""
        cutoff = self.clock() - within_s
        return [i for i in self.alive(role) if i.answered_at is not None and i.answered_at >= cutoff]

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def answered_within(self, instance_id: str, within_s: float) -> bool:
        """Its ping was answered within the last `within_s`: both ways open and the process serving."""
        instance = self._instances.get(instance_id)
        return (instance is not None and instance.gone_at is None and instance.answered_at is not None
                and instance.answered_at >= self.clock() - within_s)

    def watched(self) -> list[Instance]:
        """Instances believed alive (heard from lately, not gone), suspects included: the ones to ping."""
        now = self.clock()
        return [i for i in self._instances.values() if self._heard(i, now)]

    def _heard(self, instance: Instance, now: float) -> bool:
        cutoff = now - self.stale_after_s
        return instance.gone_at is None and (instance.last_seen >= cutoff or (
            instance.answered_at is not None and instance.answered_at >= cutoff))

    def done(self, instance_id: str) -> None:
        """A request picked on this instance ended."""
        instance = self._instances.get(instance_id)
        if instance is not None and instance.in_flight > 0:
            instance.in_flight -= 1

    def suspect(self, instance_id: str) -> None:
        self._suspect_until[instance_id] = self.clock() + self.suspect_for_s

    def alive(self, role: Role) -> list[Instance]:
        now = self.clock()
        return [i for i in self._instances.values() if i.heartbeat.role == role and self._heard(i, now)
                and self._suspect_until.get(i.heartbeat.instance_id, 0.0) <= now]

    def is_alive(self, instance_id: str) -> bool:
        """Heard from lately: heartbeats, or answered pings (a suspect instance may still be alive)."""
        instance = self._instances.get(instance_id)
        return instance is not None and self._heard(instance, self.clock())

    def pick(self, role: Role, score: Callable[[Instance], float] | None = None,
             avoid: Collection[str] = (), exclude: Collection[str] = ()) -> Instance:
        """The live instance of `role` with the best score (default: the least loaded).

        `avoid`: instances a request failed on. Another live instance is preferred; when there is
        none, one that still answers its pings is busy, not gone, and is picked again rather than
        report the role empty. `exclude`: never picked (the instance a request just failed on).
        Raises NoLiveInstance when no instance of `role` is alive, PeerGone when the only live ones
        are excluded, or failed this request and answer no ping."""
        every = self.alive(role)
        alive = [i for i in every if i.heartbeat.instance_id not in exclude]
        candidates = ([i for i in alive if i.heartbeat.instance_id not in avoid]
                      or [i for i in alive if self.answered_within(i.heartbeat.instance_id, self.stale_after_s)])
        if not every:
            raise NoLiveInstance(role, f"no live {role} instance")
        if not alive:
            raise PeerGone(f"no live {role} instance but {', '.join(sorted(exclude))}, which just failed this request")
        if not candidates:
            raise PeerGone(f"no live {role} instance but {', '.join(i.heartbeat.instance_id for i in alive)}, "
                           "which failed this request and stopped answering pings")
        key = score or (lambda i: -i.load)
        chosen = max(candidates, key=lambda i: (key(i), -i.load, i.heartbeat.instance_id))
        chosen.in_flight += 1
        return chosen

