"""The KV frame format: round trips, refusals, and a property test of the header parser."""
from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import kv_wire
from shared.errors import IncompatiblePeer, ProtocolError
from shared.models import KVLayout

LAYOUT = KVLayout("tiny@abc", num_layers=4, kv_heads=2, head_dim=16)


def _rid() -> str:
    return "req-" + uuid.uuid4().hex


@pytest.mark.parametrize("wire_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_data_frame_round_trip(wire_dtype: torch.dtype) -> None:
    rid = _rid()
    kv = torch.randn(4, 2, 2, 7, 16)
    header_bytes, payload = kv_wire.pack_data_frame(rid, 0, 10, kv, wire_dtype)
    header = kv_wire.unpack_header(header_bytes)
    assert (header.request_id, header.token_start, header.token_end) == (rid, 10, 17)
    assert header.dtype == wire_dtype and header.payload_len == sum(len(row) for row in payload)
    back = kv_wire.payload_to_tensor(header, b"".join(payload))
    assert torch.equal(back, kv.to(wire_dtype))


def test_corrupted_payload_fails_checksum() -> None:
    header_bytes, payload = kv_wire.pack_data_frame(_rid(), 0, 0, torch.randn(4, 2, 2, 3, 16), torch.float32)
    corrupted = bytearray(b"".join(payload))
    corrupted[5] ^= 0xFF
    with pytest.raises(ProtocolError, match="checksum"):
        kv_wire.payload_to_tensor(kv_wire.unpack_header(header_bytes), bytes(corrupted))


def test_header_with_wrong_shape_length_is_refused() -> None:
    rid = _rid()
    bad = kv_wire.pack_header(kv_wire.FrameKind.DATA, rid, (0, 4), (0, 3), torch.float32, 2, 16, b"x" * 10)
    with pytest.raises(ProtocolError, match="does not match"):
        kv_wire.unpack_header(bad)


@pytest.mark.parametrize("kind", [kv_wire.FrameKind.KEEPALIVE, kv_wire.FrameKind.ABORT])
def test_control_frame_round_trip(kind: kv_wire.FrameKind) -> None:
    rid = _rid()
    header = kv_wire.unpack_header(kv_wire.pack_control_frame(kind, rid, LAYOUT, torch.bfloat16))
    assert (header.kind, header.request_id, header.payload_len) == (kind, rid, 0)


def test_the_end_frame_of_protocol_2_is_refused() -> None:
    header = bytearray(kv_wire.pack_control_frame(kv_wire.FrameKind.KEEPALIVE, _rid(), LAYOUT, torch.float32))
    header[5] = 2  # kind: END, sent by version 2 senders and never read
    with pytest.raises(ProtocolError, match="bad frame field"):
        kv_wire.unpack_header(bytes(header))


def test_handshake_refuses_other_model_and_layout() -> None:
    kv_wire.check_hello(kv_wire.hello(LAYOUT, torch.bfloat16), LAYOUT)
    other = KVLayout("other@def", 4, 2, 16)
    with pytest.raises(IncompatiblePeer, match="model_id"):
        kv_wire.check_hello(kv_wire.hello(other, torch.float32), LAYOUT)
    fewer_heads = KVLayout("tiny@abc", 4, 1, 16)
    with pytest.raises(IncompatiblePeer, match="kv_heads"):
        kv_wire.check_hello(kv_wire.hello(fewer_heads, torch.float32), LAYOUT)
    with pytest.raises(IncompatiblePeer, match="version"):
        kv_wire.check_hello({**kv_wire.hello(LAYOUT, torch.float32), "version": 99}, LAYOUT)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=kv_wire.FRAME_HEADER.size, max_size=kv_wire.FRAME_HEADER.size))
def test_header_parser_never_fails_unexpectedly(data: bytes) -> None:
    try:
        header = kv_wire.unpack_header(data)
    except ProtocolError:
        return
    assert header.payload_len == header.expected_payload_len <= kv_wire.MAX_PAYLOAD_BYTES


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3), st.integers(1, 4), st.integers(0, 1000), st.integers(1, 9),
       st.sampled_from(list(kv_wire.DTYPE_CODES)))
def test_any_valid_frame_parses_back(layer_start: int, layers: int, token_start: int, tokens: int,
                                     dtype: torch.dtype) -> None:
    kv = torch.randn(layers, 2, 2, tokens, 16)
    header_bytes, payload = kv_wire.pack_data_frame(_rid(), layer_start, token_start, kv, dtype)
    header = kv_wire.unpack_header(header_bytes)
    assert (header.layer_start, header.layer_end) == (layer_start, layer_start + layers)
    assert torch.equal(kv_wire.payload_to_tensor(header, b"".join(payload)), kv.to(dtype))


def test_a_token_slice_is_sent_from_its_own_memory() -> None:
    """A chunk cut out of P's KV (strided over tokens) goes out as rows of that KV's memory, no copy,
    and its payload is the same bytes as the contiguous copy's."""
    kv = torch.randn(4, 2, 2, 64, 16, dtype=torch.bfloat16)
    chunk = kv[:, :, :, 16:40]
    header_bytes, rows = kv_wire.pack_data_frame(_rid(), 0, 16, chunk, torch.bfloat16)
    base = kv.data_ptr()
    assert len(rows) == 4 * 2 * 2
    assert all(base <= _address(row) < base + kv.nbytes for row in rows)
    header = kv_wire.unpack_header(header_bytes)
    assert torch.equal(kv_wire.payload_to_tensor(header, b"".join(rows)), chunk.contiguous())
    assert header.crc32 == kv_wire.checksum([chunk.contiguous().view(torch.uint8).numpy().tobytes()])


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data
