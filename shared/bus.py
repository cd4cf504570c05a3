"""NATS plumbing shared by every service: connect, publish and request with pdd's messages.

Errors from NATS become pdd's own (PeerGone, DeadlineExceeded, BadRequest) here, so services
never handle nats-py exceptions themselves.
"""
from __future__ import annotations

import logging

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from shared import messages
from shared.errors import (BadRequest, DeadlineExceeded, IncompatiblePeer, PddError, PeerGone, ProtocolError,
                           RequestAborted)

log = logging.getLogger(__name__)

_ERRORS_BY_CODE: dict[str, type[PddError]] = {
    cls.code: cls for cls in (BadRequest, DeadlineExceeded, IncompatiblePeer, PeerGone, ProtocolError, RequestAborted)
}


async def connect(url: str, name: str) -> NATS:
    async def on_error(exc: Exception) -> None:
        log.warning("NATS error: %s", exc)

    async def on_disconnected() -> None:
        log.warning("NATS disconnected")

    async def on_reconnected() -> None:
        log.info("NATS reconnected")

    return await nats.connect(
        url, name=name, connect_timeout=5, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
        error_cb=on_error, disconnected_cb=on_disconnected, reconnected_cb=on_reconnected)


def _payload(nc: NATS, msg: object) -> bytes:
    data = messages.encode(msg)
    if len(data) > nc.max_payload:
        raise BadRequest(f"{type(msg).__name__} of {len(data)} bytes exceeds NATS max_payload {nc.max_payload}")
    return data


async def publish(nc: NATS, subject: str, msg: object, headers: dict[str, str] | None = None) -> None:
    try:
        await nc.publish(subject, _payload(nc, msg), headers=headers or None)
    except MaxPayloadError as exc:
        raise BadRequest(str(exc)) from exc


async def request(nc: NATS, subject: str, msg: object, reply_type: type, timeout_s: float,
                  headers: dict[str, str] | None = None) -> object:
    """Request/reply with a deadline; an ErrorReply comes back raised as the matching PddError."""
    try:
        reply = await nc.request(subject, _payload(nc, msg), timeout=timeout_s, headers=headers or None)
    except NoRespondersError as exc:
        raise PeerGone(f"nobody serves {subject}") from exc
    except NatsTimeout as exc:
        raise DeadlineExceeded(f"no reply on {subject} within {timeout_s:.1f}s") from exc
    answer = messages.decode_as(reply.data, reply_type)
    if isinstance(answer, messages.ErrorReply):
        raise _ERRORS_BY_CODE.get(answer.code, PddError)(answer.message)
    return answer


async def reply_error(msg: Msg, exc: Exception) -> None:
    code = exc.code if isinstance(exc, PddError) else PddError.code
    await msg.respond(messages.encode(messages.ErrorReply(code, str(exc))))
