"""A request's id: made by the gateway, carried by every message and, as 16 bytes, by the KV wire."""
from __future__ import annotations

import uuid


def new_request_id() -> str:
    """A request's (or a migration attempt's) id: the KV wire carries it as a UUID."""
    return f"req-{uuid.uuid4().hex}"


def request_id_bytes(request_id: str) -> bytes:
    """Request ids are uuid4 hex strings, optionally with a short 'req-' prefix."""
    return uuid.UUID(request_id.removeprefix("req-")).bytes
