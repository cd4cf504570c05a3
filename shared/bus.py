"""NATS plumbing shared by every service: connect, publish and request with pdd's messages.

Errors from NATS become pdd's own (PeerGone, DeadlineExceeded, BadRequest) here, so services
never handle nats-py exceptions themselves. `connect` also owns NATS credentials: it reads the
password file and builds the TLS context that shared/config.py's NatsAuth names.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
from pathlib import Path
from typing import TypedDict

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from shared import messages
from shared.config import NatsAuth
from shared.errors import (
    BadRequest,
    DeadlineExceeded,
    IncompatiblePeer,
    PddError,
    PeerGone,
    ProtocolError,
    RequestAborted,
)

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 1.0

_ERRORS_BY_CODE: dict[str, type[PddError]] = {
    cls.code: cls for cls in (BadRequest, DeadlineExceeded, IncompatiblePeer, PeerGone, ProtocolError, RequestAborted)
}


class NatsConfigError(RuntimeError):
    """A NATS credential is missing or unreadable, or the server refused it; retrying will not help."""


async def connect(url: str, name: str, auth: NatsAuth | None = None) -> NATS:
    """Connect, retrying while the server is unreachable; fail at once on bad or refused credentials."""
    credentials = nats_credentials(auth or NatsAuth())
    connected = False

    async def on_error(exc: Exception) -> None:
        # nats-py reports each failed first attempt here before it retries; a refusal is raised
        # out of connect instead, since no retry can fix a wrong password or an untrusted cert.
        if not connected and (hint := _refusal_hint(exc)):
            raise NatsConfigError(f"{name} could not log in to NATS at {_redact(url)}: {exc} ({hint})") from exc
        log.warning("NATS error: %s", exc)

    async def on_disconnected() -> None:
        if nc.is_closed:  # our own close (a drain at shutdown): nats-py calls this then too
            log.debug("NATS connection closed")
        else:
            log.warning("NATS disconnected")

    async def on_reconnected() -> None:
        log.info("NATS reconnected")

    nc = NATS()
    try:
        # nats-py annotates reconnect_time_wait as int; it only sleeps that long, so a float works
        await nc.connect(
            url, name=name, connect_timeout=5, max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]
            error_cb=on_error, disconnected_cb=on_disconnected, reconnected_cb=on_reconnected, **credentials)
    except NatsConfigError:
        # After a failed TLS handshake nats-py's close() can wait forever on the dead socket.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                await nc.close()
        raise
    connected = True
    return nc


class NatsCredentials(TypedDict, total=False):
    """The keyword arguments of nats-py's connect() that carry credentials."""

    user: str
    password: str
    tls: ssl.SSLContext


def nats_credentials(auth: NatsAuth) -> NatsCredentials:
    """nats-py's keyword arguments for `auth`: user, password and an SSLContext, each when set."""
    credentials: NatsCredentials = {}
    if auth.user:
        credentials.update({"user": auth.user, "password": _read_password(auth.password_file)})
    if auth.tls:
        credentials["tls"] = _tls_context(auth)
    return credentials


def _read_password(path: str) -> str:
    try:
        password = _readable("--nats-password-file", path).read_text().strip()
    except OSError as exc:  # e.g. a secret mounted with its host owner, unreadable to this user
        raise NatsConfigError(f"--nats-password-file {path}: {exc.strerror}") from exc
    if not password:
        raise NatsConfigError(f"--nats-password-file {path}: the file is empty")
    return password


def _tls_context(auth: NatsAuth) -> ssl.SSLContext:
    ca = str(_readable("--nats-tls-ca", auth.tls_ca)) if auth.tls_ca else None
    try:
        context = ssl.create_default_context(cafile=ca)
        if auth.tls_cert:
            context.load_cert_chain(_readable("--nats-tls-cert", auth.tls_cert),
                                    _readable("--nats-tls-key", auth.tls_key))
    except OSError as exc:  # ssl.SSLError (not PEM, key does not match) or unreadable
        raise NatsConfigError(f"NATS TLS files {auth.tls_ca} {auth.tls_cert} {auth.tls_key}: {exc}") from exc
    return context


def _readable(flag: str, path: str) -> Path:
    file = Path(path)
    if not file.is_file():
        raise NatsConfigError(f"{flag} {path}: no such file")
    return file


def _refusal_hint(exc: Exception) -> str:
    """What to check when `exc` is NATS refusing our credentials (or us refusing its certificate); else ""."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return "the server's certificate: is --nats-tls-ca the CA that signed it?"
    if "authorization violation" in str(exc).lower():
        return "check --nats-user and --nats-password-file, or the user and password in --nats-url"
    return ""


def _redact(url: str) -> str:
    return re.sub(r"//[^/@]*@", "//", url)


def _payload(nc: NATS, msg: messages.Message) -> bytes:
    data = messages.encode(msg)
    if len(data) > nc.max_payload:
        raise BadRequest(f"{type(msg).__name__} of {len(data)} bytes exceeds NATS max_payload {nc.max_payload}")
    return data


async def publish(nc: NATS, subject: str, msg: messages.Message, headers: dict[str, str] | None = None) -> None:
    try:
        await nc.publish(subject, _payload(nc, msg), headers=headers or None)
    except MaxPayloadError as exc:
        raise BadRequest(str(exc)) from exc


async def request(nc: NATS, subject: str, msg: messages.Message, reply_type: type[messages.M], timeout_s: float,
                  headers: dict[str, str] | None = None) -> messages.M:
    """Request/reply with a deadline; an ErrorReply comes back raised as the matching PddError."""
    try:
        reply = await nc.request(subject, _payload(nc, msg), timeout=timeout_s, headers=headers or None)
    except NoRespondersError as exc:
        raise PeerGone(f"nobody serves {subject}") from exc
    except NatsTimeout as exc:
        raise DeadlineExceeded(f"no reply on {subject} within {timeout_s:.1f}s") from exc
    answer = messages.decode_reply(reply.data, reply_type)
    if isinstance(answer, messages.ErrorReply):
        raise _ERRORS_BY_CODE.get(answer.code, PddError)(answer.message)
    return answer


async def ping(nc: NATS, subject: str, timeout_s: float) -> bool | None:
    """Request/reply with an empty body: True if answered, False when NATS says nobody listens on
    `subject` (a dead instance's subscriptions go with its connection), None when no answer came
    in time (slow, or a link cut: that proves nothing either way)."""
    try:
        await nc.request(subject, b"", timeout=timeout_s)
    except NoRespondersError:
        return False
    except Exception:
        return None
    return True


async def reply_error(msg: Msg, exc: Exception) -> None:
    code = exc.code if isinstance(exc, PddError) else PddError.code
    await msg.respond(messages.encode(messages.ErrorReply(code, str(exc))))
