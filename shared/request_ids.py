"""A request's id: made by the gateway, carried by every message and, as 16 bytes, by the KV wire."""
from __future__ import annotations

import uuid

from shared import subjects

# This process's event shard: the first digits of every id it makes, so the tiers publish the events of
# a gateway's requests on subjects only that gateway subscribes to (shared/subjects.py); random, so no
# two gateways share one.
EVENT_SHARD = uuid.uuid4().hex[:subjects.EVENT_SHARD_DIGITS]


def new_request_id() -> str:
    """A request's (or a migration attempt's) id: the KV wire carries it as a UUID, whose first digits
    are this gateway's EVENT_SHARD."""
    return f"req-{EVENT_SHARD}{uuid.uuid4().hex[len(EVENT_SHARD):]}"


def request_id_bytes(request_id: str) -> bytes:
    """Request ids are uuid4 hex strings, optionally with a short 'req-' prefix."""
    return uuid.UUID(request_id.removeprefix("req-")).bytes
