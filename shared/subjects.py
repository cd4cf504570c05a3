"""NATS subject names: each is built here, by one function, and never spelled elsewhere.

See docs/protocol.md for who publishes and who subscribes to each.
"""
from __future__ import annotations

PREFIX = "pdd"


def heartbeat(role: str) -> str:
    """Instances of `role` announce themselves and their load here."""
    return f"{PREFIX}.hb.{role}"


def heartbeat_all() -> str:
    return f"{PREFIX}.hb.*"


def ping(role: str, instance_id: str) -> str:
    """Request/reply: is this instance there? It answers with a Heartbeat."""
    return f"{PREFIX}.{role}.{instance_id}.ping"


def prefill(instance_id: str) -> str:
    """Request/reply: a PrefillRequest to one P instance."""
    return f"{PREFIX}.prefill.{instance_id}.run"


def release_kv(prefill_instance_id: str) -> str:
    """The gateway tells P to send the KV paths it holds back for a request (ReleaseKV)."""
    return f"{PREFIX}.prefill.{prefill_instance_id}.release"


def decode_assign(role: str, instance_id: str) -> str:
    """Request/reply: a DecodeAssign to one RLD or MD instance."""
    return f"{PREFIX}.{role}.{instance_id}.assign"


def kv_ready(relay_instance_id: str) -> str:
    """MD tells RLD that it holds the request's prompt KV (KVReady)."""
    return f"{PREFIX}.relay.{relay_instance_id}.kv_ready"


def main_lost(relay_instance_id: str) -> str:
    """The gateway tells RLD that MD is gone: finish alone (MainLost)."""
    return f"{PREFIX}.relay.{relay_instance_id}.main_lost"


def handoff(main_instance_id: str) -> str:
    """RLD hands the eager token IDs to MD, or says it finished first (Handoff)."""
    return f"{PREFIX}.main.{main_instance_id}.handoff"


def request_events(request_id: str) -> str:
    """Every tier publishes a request's tokens, stats and errors here; the gateway that made the
    request listens. The subject carries the id's event shard, which each gateway makes its own, so
    a gateway hears its own requests' events, not every gateway's."""
    return f"{PREFIX}.req.{event_shard(request_id)}.{request_id}"


EVENT_SHARD_DIGITS = 8


def event_shard(request_id: str) -> str:
    """The first hex digits of the id's UUID: a gateway puts its own there (new_request_id)."""
    return request_id.removeprefix("req-")[:EVENT_SHARD_DIGITS].split(".")[0] or "_"


def request_events_of_shard(shard: str) -> str:
    """A gateway's one subscription to the events of every request it makes, made at its start."""
    return f"{PREFIX}.req.{shard}.*"


def request_id_of_events(subject: str) -> str:
    """The request whose events subject this is (the inverse of request_events)."""
    return subject.split(".", 3)[3]


def cache_events(instance_id: str) -> str:
    """P and MD publish their cache's stored/evicted events here (CacheEvents)."""
    return f"{PREFIX}.cache.{instance_id}"


def cache_events_all() -> str:
    return f"{PREFIX}.cache.*"


def abort(instance_id: str) -> str:
    """The instance drops what it holds for the named request. The gateway sends one to each instance
    of the request (and again to one that still holds it, from its heartbeat), not one to every
    instance: a broadcast costs every instance a message per request (docs/scale.md)."""
    return f"{PREFIX}.abort.{instance_id}"


def abort_all() -> str:
    """Every instance's abort subject, for watching them (tests, tools)."""
    return f"{PREFIX}.abort.*"
