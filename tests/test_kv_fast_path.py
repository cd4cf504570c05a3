"""The KV path's fast path (issue 44): payloads land in the inbox's own memory, which is reused
once released; a corrupted payload is caught by its CRC32C; a released request's memory is never
written after; frames stripe over connections by who is free, across chunks; an abort mid-frame
leaves the connection whole for the transfers that share it."""
from __future__ import annotations

import asyncio

import pytest
import torch
from kv_helpers import LAYOUT, running_receiver
from kv_helpers import new_rid as _rid
from kv_helpers import send_chunks as _transfer

from shared import kv_wire
from shared.errors import ProtocolError
from shared.kv_handshake import read_message
from shared.kv_inbox import KVBuffers
from shared.kv_receiver import KVReceiver
from shared.kv_sender import KVSender
from shared.kv_transfer_state import TransferState

TOKEN_BYTES = LAYOUT.bytes_per_token_fp32


@pytest.fixture
async def receiver():
    async with running_receiver() as recv:
        yield recv


async def _raw_peer(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A peer that speaks the handshake itself and then writes whatever a test wants."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    challenge = await read_message(reader)
    writer.write(kv_wire.pack_message(kv_wire.hello(LAYOUT, torch.float32, {"nonce": kv_wire.new_nonce(),
                                                                          "auth": None})))
    welcome = await read_message(reader)
    assert challenge["nonce"] and welcome["ok"] is True
    return reader, writer


async def _until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def test_kv_lands_in_the_inbox_memory_which_the_next_request_reuses(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    first, second = torch.randn(4, 2, 2, 40, 16), torch.randn(4, 2, 2, 40, 16)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 40)
    address = inbox.kv.data_ptr()
    await (await _transfer(sender, receiver.port, rid, first, chunk=16)).finish()
    assert torch.equal(await inbox.wait(5), first) and inbox.kv.data_ptr() == address
    receiver.release(rid)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 40)
    assert inbox.kv.data_ptr() == address, "a released inbox's memory is the next one's"
    await (await _transfer(sender, receiver.port, rid, second, chunk=16)).finish()
    assert torch.equal(await inbox.wait(5), second)
    await sender.close()


def test_the_buffer_pool_hands_out_a_fitting_buffer_and_keeps_its_bound() -> None:
    pool = KVBuffers(capacity_bytes=3000)
    small, large = pool.take(1000), pool.take(2000)
    pool.give(large)
    pool.give(small)
    assert pool.take(1500).data_ptr() == large.data_ptr()  # the one that fits, not the first
    assert pool.take(100).numel() == 100  # a buffer over twice the need stays for a bigger request
    pool.give(pool.take(2500))
    assert pool.free_bytes <= 3000


def test_the_buffer_pool_keeps_no_more_than_its_inboxes_held_at_once() -> None:
    pool = KVBuffers(capacity_bytes=10_000)
    for nbytes in (100, 300, 700, 1500):  # one request at a time, each too big for the buffers before it
        pool.give(pool.take(nbytes))
    assert pool.free_bytes == 1500 and pool.take(1500).numel() == 1500  # the last, not all four
    both = [pool.take(1000), pool.take(1000)]
    for buffer in both:
        pool.give(buffer)
    assert pool.free_bytes == 2000  # two at once: both kept for the next two


async def test_a_corrupted_payload_fails_the_transfer_and_closes_that_connection(receiver: KVReceiver) -> None:
    rid = _rid()
    inbox = receiver.expect(rid, 0, 2)
    _, writer = await _raw_peer(receiver.port)
    kv = torch.randn(4, 2, 2, 2, 16)
    header, rows = kv_wire.pack_data_frame(rid, 0, 0, kv, torch.float32)
    payload = bytearray(b"".join(rows))
    payload[100] ^= 0x01
    writer.write(header + payload)
    with pytest.raises(ProtocolError, match="checksum"):
        await inbox.wait(5)
    await _until(lambda: receiver.open_connections == 0)
    writer.close()


async def test_a_request_released_mid_frame_is_never_written_after(receiver: KVReceiver) -> None:
    rid = _rid()
    receiver.expect(rid, 0, 64)
    _, writer = await _raw_peer(receiver.port)
    header, rows = kv_wire.pack_data_frame(rid, 0, 0, torch.ones(4, 2, 2, 64, 16), torch.float32)
    payload = b"".join(rows)
    writer.write(header + payload[:len(payload) // 2])
    await _until(lambda: receiver.inboxes[rid].state is TransferState.TRANSFERRING)
    await asyncio.sleep(0.1)  # the first half is in
    receiver.release(rid)
    later = receiver.expect(_rid(), 0, 64)  # the same memory, now another request's
    later.kv.zero_()
    dropped = receiver.frames_dropped
    writer.write(payload[len(payload) // 2:])
    await _until(lambda: receiver.frames_dropped == dropped + 1)
    assert not later.kv.any(), "the rest of the released request's frame went to the scratch buffer"
    writer.close()


async def test_frames_go_to_whichever_connection_is_free(receiver: KVReceiver) -> None:
    """Within a chunk and across two: a connection held by other requests' frames holds back only
    the frame it took, not the chunk after it."""
    sender = KVSender(LAYOUT, torch.float32, 2.0, connections_per_peer=4)
    conns = await sender.connections("127.0.0.1", receiver.port)
    rid = _rid()
    chunk = 16384  # one layer of it is 4 MiB: a chunk goes as eight 2 MiB frames (a layer's half each)
    inbox = receiver.expect(rid, 0, 2 * chunk)
    kv = torch.randn(4, 2, 2, 2 * chunk, 16)
    frame_bytes = kv.nbytes // 16
    async with conns[0].lock:  # other requests' frames hold one connection
        transfer = await _transfer(sender, receiver.port, rid, kv, chunk=chunk)
        await _until(lambda: inbox.bytes_received == 14 * frame_bytes)  # all but one frame of each chunk
    result = await transfer.finish()
    assert result.state is TransferState.DONE
    assert torch.equal(await inbox.wait(5), kv)
    await sender.close()


async def test_an_abort_mid_frame_leaves_the_connection_whole_for_the_others(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    big, small = torch.randn(4, 2, 2, 32768, 16), torch.randn(4, 2, 2, 8, 16)  # 64 MiB: it is mid-write
    big_rid, small_rid = _rid(), _rid()
    receiver.expect(big_rid, 0, 32768)
    small_inbox = receiver.expect(small_rid, 0, 8)
    aborted = await _transfer(sender, receiver.port, big_rid, big, chunk=32768)
    await asyncio.sleep(0.05)
    aborted.abort("client gone")
    await aborted.wait_closed()
    follower = await _transfer(sender, receiver.port, small_rid, small, chunk=8)
    assert (await follower.finish()).state is TransferState.DONE
    assert torch.equal(await small_inbox.wait(10), small)
    assert receiver.open_connections == 1  # the same connection carried on: no frame was cut short
    await sender.close()
