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
    """Every tier publishes a request's tokens, stats and errors here; the gateway listens."""
    return f"{PREFIX}.req.{request_id}"


def request_events_all() -> str:
    """The gateway's one subscription to every request's events, made at its start."""
    return f"{PREFIX}.req.*"


def request_id_of_events(subject: str) -> str:
    """The request whose events subject this is (the inverse of request_events)."""
    return subject.removeprefix(f"{PREFIX}.req.")


def cache_events(instance_id: str) -> str:
    """P and MD publish their cache's stored/evicted events here (CacheEvents)."""
    return f"{PREFIX}.cache.{instance_id}"


def cache_events_all() -> str:
    return f"{PREFIX}.cache.*"


def abort() -> str:
    """Broadcast: every instance drops what it holds for the named request."""
    return f"{PREFIX}.abort"
