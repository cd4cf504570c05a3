"""The KV port's handshake, both halves: the decoder challenges, P answers with its layout and a
proof of the shared secret, the decoder answers with its own proof (or a refusal and why).

Messages are length-prefixed JSON objects (`shared.kv_wire` builds and checks their fields); this
module only orders them. Deadlines belong to the callers.
"""
from __future__ import annotations

import asyncio
from typing import Protocol

import orjson
import torch

from shared import kv_wire
from shared.errors import IncompatiblePeer, KVUnreachable, ProtocolError
from shared.models import KVLayout


class MessageReader(Protocol):
    """What the handshake reads from: an asyncio.StreamReader, or P's own socket (`KVConnection`'s)."""

    async def readexactly(self, n: int) -> bytes: ...


class MessageWriter(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


async def read_message(reader: MessageReader) -> dict:
    """One length-prefixed JSON object of the handshake."""
    length = kv_wire.unpack_length(await reader.readexactly(kv_wire.LENGTH_PREFIX_BYTES))
    try:
        msg = orjson.loads(await reader.readexactly(length))
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"handshake message is not JSON: {exc}") from exc
    if not isinstance(msg, dict):
        raise ProtocolError("handshake message is not a JSON object")
    return msg


def refuse(writer: asyncio.StreamWriter, reason: str, *, busy: bool = False) -> None:
    """The decoder's no, in place of its welcome; `busy`: its connection caps are full (the sender is
    fine and may try again), not the sender's hello that is wrong."""
    writer.write(kv_wire.pack_message({"ok": False, "reason": reason, **({"busy": True} if busy else {})}))


# --- the decoder's half --------------------------------------------------------------------------

async def check_sender(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, layout: KVLayout,
                       secret: bytes | None) -> str:
    """Challenge the peer and check its hello: its layout, and its proof of `secret` (no secret:
    nothing to prove). Returns the peer's nonce, which `welcome` answers; a peer that fails is told
    why and IncompatiblePeer raised."""
    nonce = kv_wire.new_nonce()
    writer.write(kv_wire.pack_message(kv_wire.challenge(nonce)))
    await writer.drain()
    try:
        msg = await read_message(reader)
        kv_wire.check_hello(msg, layout)
        kv_wire.check_proof(secret, nonce, "sender", msg.get("auth"))
    except (ProtocolError, IncompatiblePeer) as exc:
        refuse(writer, str(exc))
        await writer.drain()
        raise IncompatiblePeer(str(exc)) from exc
    return str(msg.get("nonce"))


async def welcome(writer: asyncio.StreamWriter, layout: KVLayout, secret: bytes | None, sender_nonce: str,
                  idle_timeout_s: float) -> None:
    """The decoder's yes: its own proof, and how long it lets a connection idle (0: forever)."""
    writer.write(kv_wire.pack_message({
        "ok": True, "model_id": layout.model_id, "auth": kv_wire.proof(secret, sender_nonce, "receiver"),
        "idle_timeout_s": idle_timeout_s or None}))
    await writer.drain()


# --- P's half ------------------------------------------------------------------------------------

async def greet_receiver(reader: MessageReader, writer: MessageWriter, layout: KVLayout,
                         wire_dtype: torch.dtype, secret: bytes | None, peer: str) -> float | None:
    """Answer the decoder's challenge and check its proof; returns its idle deadline (None: none).
    KVUnreachable when it refuses for its connection caps, IncompatiblePeer for anything else."""
    challenge = await read_message(reader)
    if challenge.get("ok") is False:  # a decoder before protocol 3's counting after authentication: caps full
        raise KVUnreachable(f"decoder {peer} refused: {challenge.get('reason')}")
    if challenge.get("magic") != kv_wire.MAGIC.decode() or not isinstance(challenge.get("nonce"), str):
        raise IncompatiblePeer(f"{peer} is not a pdd KV receiver of protocol {kv_wire.PROTOCOL_VERSION}")
    nonce = kv_wire.new_nonce()
    writer.write(kv_wire.pack_message(kv_wire.hello(layout, wire_dtype, {
        "nonce": nonce, "auth": kv_wire.proof(secret, challenge["nonce"], "sender")})))
    await writer.drain()
    reply = await read_message(reader)
    if reply.get("ok") is False and reply.get("busy") is True:
        raise KVUnreachable(f"decoder {peer} refused: {reply.get('reason')}")
    if not reply.get("ok"):
        raise IncompatiblePeer(f"decoder {peer} refused: {reply.get('reason')}")
    kv_wire.check_proof(secret, nonce, "receiver", reply.get("auth"))
    idle_s = reply.get("idle_timeout_s")
    return float(idle_s) if isinstance(idle_s, (int, float)) and idle_s > 0 else None
