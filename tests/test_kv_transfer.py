"""KV transfer over real loopback sockets: delivery, dtype conversion, refusals and aborts."""
from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from shared import kv_wire
from shared.errors import DeadlineExceeded, IncompatiblePeer, ProtocolError, RequestAborted
from shared.kv_transfer import KVReceiver, KVSender, OutgoingTransfer, TransferState
from shared.messages import KVTarget
from shared.models import KVLayout

LAYOUT = KVLayout("tiny@abc", num_layers=4, kv_heads=2, head_dim=16)


def _rid() -> str:
    return "req-" + uuid.uuid4().hex


@pytest.fixture
async def receiver():
    recv = KVReceiver(LAYOUT, torch.float32)
    port = await recv.start("127.0.0.1", 0)
    recv.port = port
    yield recv
    await recv.stop()


async def _send(sender: KVSender, port: int, rid: str, kv: torch.Tensor, chunk: int) -> OutgoingTransfer:
    transfer = OutgoingTransfer(sender, KVTarget("main", "127.0.0.1", port), rid, queue_chunks=2, deadline_s=5)
    for start in range(0, kv.shape[3], chunk):
        await transfer.put(start, kv[:, :, :, start:start + chunk])
    return transfer


async def test_chunks_arrive_complete_and_in_place(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    kv = torch.randn(4, 2, 2, 50, 16)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 50)
    transfer = await _send(sender, receiver.port, rid, kv, chunk=16)
    result = await transfer.finish(50)
    got = await inbox.wait(5)
    assert result.state is TransferState.DONE and inbox.state is TransferState.DONE
    assert torch.equal(got, kv)
    assert result.kv_bytes == inbox.bytes_received + 4 * kv_wire.FRAME_HEADER.size
    await sender.close()


async def test_bf16_wire_is_converted_by_the_receiver(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.bfloat16, 2.0)
    kv = torch.randn(4, 2, 2, 8, 16)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 8)
    await (await _send(sender, receiver.port, rid, kv, chunk=8)).finish(8)
    got = await inbox.wait(5)
    assert got.dtype == torch.float32
    assert torch.equal(got, kv.to(torch.bfloat16).to(torch.float32))
    await sender.close()


async def test_incompatible_sender_is_refused(receiver: KVReceiver) -> None:
    sender = KVSender(KVLayout("other-model@123", 4, 2, 16), torch.float32, 2.0)
    with pytest.raises(IncompatiblePeer, match="model_id"):
        await sender.connection("127.0.0.1", receiver.port)
    await asyncio.sleep(0.05)
    assert receiver.open_connections == 0


async def test_garbage_closes_only_that_connection(receiver: KVReceiver) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
    writer.write(b"\x00\x00\x00\x05hello" + b"\xff" * 100)
    await writer.drain()
    async with asyncio.timeout(5):
        await reader.read()  # the receiver answers with a refusal and closes
    writer.close()
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 4)
    await (await _send(sender, receiver.port, rid, torch.randn(4, 2, 2, 4, 16), 4)).finish(4)
    assert (await inbox.wait(5)).shape[3] == 4
    await sender.close()


async def test_garbage_frame_after_handshake_fails_the_connection_not_the_server(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    conn = await sender.connection("127.0.0.1", receiver.port)
    await conn.write(b"NOPE" + b"\x00" * (kv_wire.FRAME_HEADER.size - 4))
    async with asyncio.timeout(5):
        assert await conn.reader.read() == b""
    assert receiver.open_connections == 0
    await sender.close()


async def test_frames_for_unknown_or_released_requests_are_dropped(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 8)
    receiver.release(rid, "client gone")
    assert inbox.state is TransferState.ABORTED
    await (await _send(sender, receiver.port, rid, torch.randn(4, 2, 2, 8, 16), 4)).finish(8)
    await asyncio.sleep(0.1)
    assert receiver.frames_dropped == 3 and rid not in receiver.inboxes
    await sender.close()


async def test_abort_from_the_sender_ends_the_inbox(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 8)
    transfer = await _send(sender, receiver.port, rid, torch.randn(4, 2, 2, 4, 16), 4)
    transfer.abort("prefill cancelled")
    with pytest.raises(RequestAborted):
        await inbox.wait(5)
    assert transfer.state is TransferState.ABORTED
    transfer.abort("again")  # idempotent
    await sender.close()


async def test_missing_kv_fails_within_its_deadline(receiver: KVReceiver) -> None:
    inbox = receiver.expect(_rid(), 0, 8)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(DeadlineExceeded):
        await inbox.wait(0.3)
    assert loop.time() - t0 < 2.0
    assert inbox.state is TransferState.FAILED


async def test_send_to_a_dead_port_fails_the_transfer() -> None:
    sender = KVSender(LAYOUT, torch.float32, 1.0)
    transfer = OutgoingTransfer(sender, KVTarget("main", "127.0.0.1", 1), _rid(), 2, 5)
    await transfer.put(0, torch.randn(4, 2, 2, 4, 16))
    result = await transfer.finish(4)
    assert result.state is TransferState.FAILED and "failed" in result.error


async def test_parallel_connections_carry_one_transfer(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0, connections_per_peer=4)
    kv = torch.randn(4, 2, 2, 4096, 16)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 4096)
    result = await (await _send(sender, receiver.port, rid, kv, chunk=1024)).finish(4096)
    assert result.state is TransferState.DONE
    assert torch.equal(await inbox.wait(5), kv)
    assert receiver.open_connections == 4 and sender.open_connections == 4
    assert f"127.0.0.1:{receiver.port}" in sender.throughput.bytes_per_s
    await sender.close()


async def test_a_stalled_transfer_fails_on_both_sides_within_the_stall_deadline(receiver: KVReceiver) -> None:
    """A peer that stops reading (a cut link that drops packets) fails the transfer by its stall deadline."""
    silent_server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent_server.sockets[0].getsockname()[1]
    sender = KVSender(LAYOUT, torch.float32, connect_timeout_s=0.5, stall_timeout_s=0.5)
    transfer = OutgoingTransfer(sender, KVTarget("main", "127.0.0.1", port), _rid(), 2, deadline_s=30)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    result = await transfer.finish(0)
    assert result.state is TransferState.FAILED and loop.time() - t0 < 5
    silent_server.close()

    rid = _rid()
    inbox = receiver.expect(rid, 0, 8)
    good = KVSender(LAYOUT, torch.float32, 2.0)
    half = await _send(good, receiver.port, rid, torch.randn(4, 2, 2, 4, 16), 4)  # only half the tokens come
    t0 = loop.time()
    with pytest.raises(DeadlineExceeded, match="stalled"):
        await inbox.wait(30, stall_timeout_s=0.3)
    assert loop.time() - t0 < 5
    half.abort("test over")
    await good.close()


async def test_kv_peers_authenticate_each_other_with_a_shared_secret() -> None:
    secured = KVReceiver(LAYOUT, torch.float32, secret=b"s3cret")
    port = await secured.start("127.0.0.1", 0)
    try:
        good = KVSender(LAYOUT, torch.float32, 2.0, secret=b"s3cret")
        rid = _rid()
        inbox = secured.expect(rid, 0, 4)
        await (await _send(good, port, rid, torch.randn(4, 2, 2, 4, 16), 4)).finish(4)
        assert (await inbox.wait(5)).shape[3] == 4
        await good.close()
        for secret in (b"wrong", None):
            with pytest.raises(IncompatiblePeer, match="authentication"):
                await KVSender(LAYOUT, torch.float32, 2.0, secret=secret).connection("127.0.0.1", port)
        assert secured.refused_connections == 2
    finally:
        await secured.stop()


async def test_a_sender_with_a_secret_refuses_an_unauthenticated_receiver(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0, secret=b"s3cret")
    with pytest.raises(ProtocolError, match="authentication"):
        await sender.connection("127.0.0.1", receiver.port)
