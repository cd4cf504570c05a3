"""KV wire format: the connection handshake and the binary frame that carries KV bytes.

A connection opens with a CHALLENGE (length-prefixed JSON with a nonce) from the receiver, a
HELLO from the sender (its model layout, its own nonce, and, when a shared secret is set, an
HMAC of the receiver's nonce), and a WELCOME (with an HMAC of the sender's nonce: the
authentication is mutual) or a REFUSE from the receiver; after that, frames only. A frame is a
fixed header (see FRAME_HEADER) and, for DATA, a payload of `payload_len` bytes holding K and V
for a layer range and a token range, laid out as [layers, 2 (K, V), kv_heads, tokens, head_dim]
in the frame's dtype, checked by a CRC32C (Castagnoli, hardware) of the payload. A payload is
written and read as rows (`payload_rows`): one [tokens, head_dim] run per (layer, K/V, head), each
contiguous in the KV tensor, so neither side copies a frame together or apart. This module only
packs and checks bytes; it owns no sockets.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c
import orjson
import torch

from shared.errors import IncompatiblePeer, ProtocolError
from shared.models import KVLayout
from shared.names import DType
from shared.request_ids import request_id_bytes

MAGIC = b"PDKV"
PROTOCOL_VERSION = 4  # 4: the checksum is CRC32C (3: zlib CRC-32; KEEPALIVE frames; no END frame)
MAX_HELLO_BYTES = 64 * 1024
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024  # the format's ceiling; a receiver holds frames to max_payload_bytes
FRAME_PAYLOAD_BYTES = 2 * 1024 * 1024  # what a sender puts in one frame, unless one token's KV alone is more

# magic, version, kind, dtype code, pad, request id (16 bytes), layer start/end, token start/end,
# kv heads, head dim, payload length, crc32c of the payload
FRAME_HEADER = struct.Struct("!4sBBBx16sHHIIHHII")
_LENGTH = struct.Struct("!I")


class FrameKind(enum.IntEnum):
    DATA = 1
    # 2 was END (version 2): never read, since a transfer is complete when every cell has arrived
    ABORT = 3  # the sender gave up on this request; no payload
    KEEPALIVE = 4  # the sender still holds this request open and the link works; no payload


WIRE_DTYPES: dict[int, torch.dtype] = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16}
DTYPE_CODES = {dtype: code for code, dtype in WIRE_DTYPES.items()}
DTYPE_NAMES: dict[str, torch.dtype] = {  # by DType or its plain string
    DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}


@dataclass(frozen=True)
class FrameHeader:
    kind: FrameKind
    request_id: str
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    dtype: torch.dtype
    kv_heads: int
    head_dim: int
    payload_len: int
    crc32: int

    @property
    def expected_payload_len(self) -> int:
        if self.kind != FrameKind.DATA:
            return 0
        elements = (self.layer_end - self.layer_start) * 2 * self.kv_heads * (self.token_end - self.token_start)
        return elements * self.head_dim * self.dtype.itemsize


def checksum(parts: Sequence[bytes | bytearray | memoryview], crc: int = 0) -> int:
    """CRC32C of the parts back to back (hardware-accelerated; releases the GIL on large parts)."""
    for part in parts:
        crc = crc32c.crc32c(part, crc)
    return crc


def pack_header(kind: FrameKind, request_id: str, layer_range: tuple[int, int], token_range: tuple[int, int],
                dtype: torch.dtype, kv_heads: int, head_dim: int,
                payload: Sequence[bytes | bytearray | memoryview] | bytes = ()) -> bytes:
    """A frame header; `payload` is the payload, whole or as its parts (rows) in order."""
    parts = [payload] if isinstance(payload, bytes) else payload
    return FRAME_HEADER.pack(
        MAGIC, PROTOCOL_VERSION, kind, DTYPE_CODES[dtype], request_id_bytes(request_id),
        layer_range[0], layer_range[1], token_range[0], token_range[1], kv_heads, head_dim,
        sum(len(part) for part in parts), checksum(parts))


def pack_control_frame(kind: FrameKind, request_id: str, layout: KVLayout, dtype: torch.dtype) -> bytes:
    """A frame without payload (ABORT, KEEPALIVE) for a request."""
    return pack_header(kind, request_id, (0, 0), (0, 0), dtype, layout.kv_heads, layout.head_dim)


def rows_in_place(kv: torch.Tensor) -> bool:
    """Whether kv [layers, 2, kv_heads, tokens, head_dim] is on the CPU with each row contiguous."""
    return kv.device.type == "cpu" and kv.stride(4) == 1 and (kv.shape[3] <= 1 or kv.stride(3) == kv.shape[4])


def payload_rows(kv: torch.Tensor) -> list[memoryview] | None:
    """kv [layers, 2, kv_heads, tokens, head_dim] on the CPU as the payload's rows, views of its own
    memory: one per (layer, K/V, head), each [tokens, head_dim] contiguous. None when a row is not
    contiguous in memory (then the caller makes a contiguous copy first)."""
    if not rows_in_place(kv):
        return None
    if not kv.numel():
        return []
    array = kv.view(torch.uint8).numpy()  # uint8 [layers, 2, kv_heads, tokens, head_dim * itemsize], shares kv's memory
    return [memoryview(array[layer, half, head]).cast("B")
            for layer in range(array.shape[0]) for half in range(2) for head in range(array.shape[2])]


def pack_data_frame(request_id: str, layer_start: int, token_start: int,
                    kv: torch.Tensor, wire_dtype: torch.dtype) -> tuple[bytes, list[memoryview]]:
    """kv: [layers, 2, kv_heads, tokens, head_dim]. Returns (header, payload rows) to write back to back:
    the rows are views of kv's own memory where it is on the CPU in the wire dtype with contiguous
    rows, else of one contiguous copy."""
    if kv.dtype != wire_dtype or (rows := payload_rows(kv)) is None:
        kv = kv.to(device="cpu", dtype=wire_dtype).contiguous()
        rows = payload_rows(kv)
        assert rows is not None  # a contiguous CPU tensor has contiguous rows
    layers, _, kv_heads, tokens, head_dim = kv.shape
    header = pack_header(FrameKind.DATA, request_id, (layer_start, layer_start + layers),
                         (token_start, token_start + tokens), wire_dtype, kv_heads, head_dim, rows)
    return header, rows


def max_payload_bytes(layout: KVLayout) -> int:
    """The largest payload a receiver accepts: a sender's frame, or one token of every layer in the
    widest wire dtype where that is more (a sender cuts frames between tokens, never inside one)."""
    token_bytes = layout.num_layers * 2 * layout.kv_heads * layout.head_dim * torch.float32.itemsize
    return max(FRAME_PAYLOAD_BYTES, token_bytes)


def unpack_header(data: bytes, request_id_prefix: str = "req-",
                  max_payload: int = MAX_PAYLOAD_BYTES) -> FrameHeader:
    try:
        (magic, version, kind, dtype_code, rid, ls, le, ts, te, heads, dim, length, crc) = FRAME_HEADER.unpack(data)
    except struct.error as exc:
        raise ProtocolError(f"short frame header: {exc}") from exc
    if magic != MAGIC:
        raise ProtocolError("bad frame magic")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"frame version {version}, expected {PROTOCOL_VERSION}")
    try:
        header = FrameHeader(FrameKind(kind), request_id_prefix + uuid.UUID(bytes=rid).hex, ls, le, ts, te,
                             WIRE_DTYPES[dtype_code], heads, dim, length, crc)
    except (ValueError, KeyError) as exc:
        raise ProtocolError(f"bad frame field: {exc}") from exc
    if length > max_payload:
        raise ProtocolError(f"frame payload {length} bytes exceeds {max_payload}")
    if header.kind == FrameKind.DATA and (ls >= le or ts >= te):
        raise ProtocolError("empty layer or token range")
    if length != header.expected_payload_len:
        raise ProtocolError(f"payload length {length} does not match its shape ({header.expected_payload_len})")
    return header


def payload_to_tensor(header: FrameHeader, payload: bytes | bytearray) -> torch.Tensor:
    """Check the checksum and view a whole payload as [layers, 2, kv_heads, tokens, head_dim]."""
    if crc32c.crc32c(payload) != header.crc32:
        raise ProtocolError(f"checksum mismatch in frame for {header.request_id}")
    flat = torch.frombuffer(bytearray(payload) if isinstance(payload, bytes) else payload, dtype=header.dtype)
    return flat.view(header.layer_end - header.layer_start, 2, header.kv_heads,
                     header.token_end - header.token_start, header.head_dim)


# --- handshake -----------------------------------------------------------------------------

def pack_message(obj: dict) -> bytes:
    body = orjson.dumps(obj)
    return _LENGTH.pack(len(body)) + body


def unpack_length(prefix: bytes) -> int:
    (length,) = _LENGTH.unpack(prefix)
    if length > MAX_HELLO_BYTES:
        raise ProtocolError(f"handshake message of {length} bytes exceeds {MAX_HELLO_BYTES}")
    return length


LENGTH_PREFIX_BYTES = _LENGTH.size


def new_nonce() -> str:
    return secrets.token_hex(16)


def challenge(nonce: str) -> dict:
    return {"magic": MAGIC.decode(), "version": PROTOCOL_VERSION, "nonce": nonce}


def proof(secret: bytes | None, nonce: str, role: str) -> str | None:
    """HMAC-SHA256 over a peer's nonce; `role` keeps the two directions' proofs distinct."""
    if secret is None:
        return None
    return hmac.new(secret, f"{role}:{nonce}".encode(), hashlib.sha256).hexdigest()


def check_proof(secret: bytes | None, nonce: str, role: str, got: object) -> None:
    """Raise ProtocolError unless `got` proves knowledge of the secret (no secret: nothing to check)."""
    expected = proof(secret, nonce, role)
    if expected is not None and not (isinstance(got, str) and hmac.compare_digest(expected, got)):
        raise ProtocolError("KV peer failed authentication")


def hello(layout: KVLayout, wire_dtype: torch.dtype, extra: dict | None = None) -> dict:
    return {
        "magic": MAGIC.decode(), "version": PROTOCOL_VERSION, "model_id": layout.model_id,
        "num_layers": layout.num_layers, "kv_heads": layout.kv_heads, "head_dim": layout.head_dim,
        "wire_dtype": str(wire_dtype).removeprefix("torch."), **(extra or {}),
    }


def check_hello(msg: dict, layout: KVLayout) -> None:
    """Raise IncompatiblePeer naming the first field that differs from this decoder's layout."""
    if msg.get("magic") != MAGIC.decode():
        raise ProtocolError("not a pdd KV peer")
    expected = {"version": PROTOCOL_VERSION, "model_id": layout.model_id, "num_layers": layout.num_layers,
                "kv_heads": layout.kv_heads, "head_dim": layout.head_dim}
    for key, value in expected.items():
        if msg.get(key) != value:
            raise IncompatiblePeer(f"peer {key}={msg.get(key)!r}, this decoder has {value!r}")
    if msg.get("wire_dtype") not in DTYPE_NAMES:
        raise IncompatiblePeer(f"unknown wire dtype {msg.get('wire_dtype')!r}")
