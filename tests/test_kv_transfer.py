"""KV transfer over real loopback sockets: delivery, dtype conversion, refusals and aborts."""
from __future__ import annotations

import asyncio
import functools
import socket
import time
from typing import Self

import pytest
import torch
from kv_helpers import LAYOUT, running_receiver, send_chunks
from kv_helpers import new_rid as _rid

from shared import kv_wire
from shared.errors import DeadlineExceeded, IncompatiblePeer, KVUnreachable, ProtocolError, RequestAborted
from shared.kv_receiver import KVReceiver
from shared.kv_sender import TRANSFER_FAILED, KVSender, OutgoingTransfer
from shared.kv_transfer_state import TransferState
from shared.messages import KVTarget
from shared.models import KVLayout
from shared.names import Role

_send = functools.partial(send_chunks, queue_chunks=2, deadline_s=5)  # a bounded queue, a short deadline


@pytest.fixture
async def receiver():
    async with running_receiver() as recv:
        yield recv


async def test_chunks_arrive_complete_and_in_place(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    kv = torch.randn(4, 2, 2, 50, 16)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 50)
    transfer = await _send(sender, receiver.port, rid, kv, chunk=16)
    result = await transfer.finish()
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
    await (await _send(sender, receiver.port, rid, kv, chunk=8)).finish()
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
    await (await _send(sender, receiver.port, rid, torch.randn(4, 2, 2, 4, 16), 4)).finish()
    assert (await inbox.wait(5)).shape[3] == 4
    await sender.close()


async def test_garbage_frame_after_handshake_fails_the_connection_not_the_server(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    conn = await sender.connection("127.0.0.1", receiver.port)
    await conn.write(b"NOPE" + b"\x00" * (kv_wire.FRAME_HEADER.size - 4))
    async with asyncio.timeout(5):
        while not conn.closed:  # the decoder closed it: P sees its end of the stream
            await asyncio.sleep(0.01)
    assert receiver.open_connections == 0
    await sender.close()


async def test_frames_for_unknown_or_released_requests_are_dropped(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 8)
    receiver.release(rid, "client gone")
    assert inbox.state is TransferState.ABORTED
    await (await _send(sender, receiver.port, rid, torch.randn(4, 2, 2, 8, 16), 4)).finish()
    await asyncio.sleep(0.1)
    assert receiver.frames_dropped == 2 and rid not in receiver.inboxes  # both DATA frames (no END since protocol 3)
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
    transfer = OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", 1), _rid(), 2, 5)
    await transfer.put(0, torch.randn(4, 2, 2, 4, 16))
    result = await transfer.finish()
    assert result.state is TransferState.FAILED and "failed" in result.error
    assert result.code == KVUnreachable.code, "P never reached the decoder: the path failed, not the decoder"


async def test_a_path_that_breaks_once_connected_reports_the_transfer_failed() -> None:
    receiver = KVReceiver(LAYOUT, torch.float32)
    port = await receiver.start("127.0.0.1", 0)
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    rid = _rid()
    receiver.expect(rid, 0, 8)
    transfer = OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", port), rid, 0, deadline_s=5)
    await transfer.put(0, torch.randn(4, 2, 2, 4, 16))
    async with asyncio.timeout(5):
        while transfer.state is TransferState.WAITING:
            await asyncio.sleep(0.01)
    await receiver.stop()  # the decoder goes away mid-transfer
    await asyncio.sleep(0.1)
    await transfer.put(4, torch.randn(4, 2, 2, 4, 16))
    result = await transfer.finish()
    assert result.state is TransferState.FAILED and result.code == TRANSFER_FAILED, result.error
    await sender.close()


async def test_parallel_connections_carry_one_transfer(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0, connections_per_peer=4)
    kv = torch.randn(4, 2, 2, 4096, 16)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 4096)
    result = await (await _send(sender, receiver.port, rid, kv, chunk=1024)).finish()
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
    transfer = OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", port), _rid(), 2, deadline_s=30)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    result = await transfer.finish()
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
        await (await _send(good, port, rid, torch.randn(4, 2, 2, 4, 16), 4)).finish()
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


MIB = 1024 * 1024


class LoopbackLink:
    """A TCP relay to a receiver, like a WAN link: `bytes_per_s` caps what crosses from the sender,
    and `cut()` silences it like a cut link that drops packets (nothing crosses, nothing is read,
    so TCP's backpressure reaches the sender). Small socket buffers keep the sender's writes
    paced by the link, not absorbed by loopback's megabytes of buffer."""

    PIECE_BYTES = 16 * 1024

    def __init__(self, port: int, bytes_per_s: float | None = None) -> None:
        self.port = port
        self.bytes_per_s = bytes_per_s
        self._open = asyncio.Event()
        self._open.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._relays: set[asyncio.Task] = set()

    def cut(self) -> None:
        self._open.clear()

    async def __aenter__(self) -> Self:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)  # accepted sockets inherit it
        sock.bind(("127.0.0.1", 0))
        self._server = await asyncio.start_server(self._serve, sock=sock)
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        for relay in self._relays:
            relay.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers.add(up_writer)
        relays = {asyncio.create_task(self._pipe(reader, up_writer, self.bytes_per_s)),
                  asyncio.create_task(self._pipe(up_reader, writer, None))}
        self._relays |= relays
        await asyncio.gather(*relays, return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    bytes_per_s: float | None) -> None:
        while True:
            await self._open.wait()
            data = await reader.read(self.PIECE_BYTES)
            if not data:
                return
            if not self._open.is_set():
                continue  # read as the link was cut: lost
            writer.write(data)
            await writer.drain()
            if bytes_per_s:
                await asyncio.sleep(len(data) / bytes_per_s)


STALL_S = 0.3


async def test_a_transfer_queued_at_p_longer_than_the_stall_deadline_completes(receiver: KVReceiver) -> None:
    """P opens the transfer, then its engine makes the chunks late: before the first and between
    two, each wait longer than the stall deadline. Keepalives say P still holds the request."""
    sender = KVSender(LAYOUT, torch.float32, 2.0, stall_timeout_s=STALL_S)
    kv = torch.randn(4, 2, 2, 8, 16)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 8)
    waiting = asyncio.create_task(inbox.wait(30, stall_timeout_s=STALL_S))
    transfer = OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", receiver.port), rid, 0, deadline_s=30)
    await asyncio.sleep(3 * STALL_S)  # queued behind other prompts
    await transfer.put(0, kv[:, :, :, :4])
    await asyncio.sleep(3 * STALL_S)  # the second chunk queued again
    await transfer.put(4, kv[:, :, :, 4:])
    result = await transfer.finish()
    assert torch.equal(await waiting, kv)
    assert result.state is TransferState.DONE and inbox.state is TransferState.DONE
    assert inbox.keepalives >= 4 and receiver.frames_dropped == 0
    await sender.close()


async def test_a_link_that_goes_silent_mid_stream_fails_on_the_stall_deadline(receiver: KVReceiver) -> None:
    """Keepalives do not hide a cut: they stop crossing with everything else."""
    sender = KVSender(LAYOUT, torch.float32, 2.0, stall_timeout_s=STALL_S)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 8)
    async with LoopbackLink(receiver.port) as link:
        transfer = OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", link.listen_port), rid, 0, deadline_s=30)
        await transfer.put(0, torch.randn(4, 2, 2, 4, 16))
        while inbox.state is TransferState.WAITING:
            await asyncio.sleep(0.01)
        link.cut()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(DeadlineExceeded, match="stalled"):
            await inbox.wait(30, stall_timeout_s=STALL_S)
        assert loop.time() - t0 < 5 * STALL_S
        transfer.abort("test over")
        await sender.close()


async def test_closing_the_sender_delivers_pending_abort_frames_first(receiver: KVReceiver) -> None:
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 8)
    transfer = await _send(sender, receiver.port, rid, torch.randn(4, 2, 2, 4, 16), 4)
    transfer.abort("P shutting down")
    await sender.close()  # owns the ABORT frame's task: it goes out before the connections close
    with pytest.raises(RequestAborted, match="sender aborted"):
        await inbox.wait(5)
    await transfer.wait_closed()


async def test_a_frame_waiting_behind_other_requests_frames_is_not_a_stall(receiver: KVReceiver) -> None:
    """The stall deadline bounds the link taking a frame, not the frame's wait for the connection."""
    sender = KVSender(LAYOUT, torch.float32, 2.0, stall_timeout_s=STALL_S)
    kv = torch.randn(4, 2, 2, 4, 16)
    rid = _rid()
    inbox = receiver.expect(rid, 0, 4)
    conn = await sender.connection("127.0.0.1", receiver.port)
    async with conn.lock:  # other requests' frames hold the one connection
        transfer = await _send(sender, receiver.port, rid, kv, 4)
        await asyncio.sleep(3 * STALL_S)
    result = await transfer.finish()
    assert result.state is TransferState.DONE
    assert torch.equal(await inbox.wait(5, stall_timeout_s=STALL_S), kv)
    await sender.close()


async def test_requests_queued_behind_each_other_on_one_slow_connection_all_complete(receiver: KVReceiver) -> None:
    """Four transfers share one connection over a 2 MiB/s link, each with a 1 MiB frame: the last
    one's frame waits a second or more (over three stall deadlines) behind the others' without a
    word of its own. The connection moves the whole time, so neither side calls that a stall."""
    sender = KVSender(LAYOUT, torch.float32, 2.0, stall_timeout_s=STALL_S)
    kvs = [torch.randn(4, 2, 2, 1024, 16) for _ in range(4)]  # 1 KiB per token: 1 MiB, one frame each
    rids = [_rid() for _ in kvs]
    inboxes = [receiver.expect(rid, 0, 1024) for rid in rids]
    waits = [asyncio.create_task(inbox.wait(30, stall_timeout_s=STALL_S)) for inbox in inboxes]
    async with LoopbackLink(receiver.port, bytes_per_s=2 * MIB) as link:
        transfers = [OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", link.listen_port), rid, 0, deadline_s=30)
                     for rid in rids]
        while any(inbox.keepalives == 0 for inbox in inboxes):  # P has spoken for every request: stall clocks run
            await asyncio.sleep(0.01)
        sent_at = time.monotonic()
        for transfer, kv in zip(transfers, kvs):
            await transfer.put(0, kv)
        results = [await transfer.finish() for transfer in transfers]
        got = await asyncio.gather(*waits, return_exceptions=True)
        connections = sender.open_connections
    assert [result.state for result in results] == [TransferState.DONE] * 4, [result.error for result in results]
    assert all(isinstance(arrived, torch.Tensor) for arrived in got), [a for a in got if isinstance(a, Exception)]
    assert all(torch.equal(arrived, kv) for kv, arrived in zip(kvs, got))
    assert connections == 1
    assert max(inbox.first_frame_at for inbox in inboxes) - sent_at > 3 * STALL_S  # it did wait that long
    await sender.close()


async def test_a_silent_connection_fails_every_request_it_carries_on_both_sides(receiver: KVReceiver) -> None:
    """A cut link stops the request streaming on it and the one only keeping alive on it, each on
    the stall deadline; P's write stalls too (nothing leaves), and P fails both transfers."""
    sender = KVSender(LAYOUT, torch.float32, 2.0, stall_timeout_s=STALL_S)
    streaming, idle = _rid(), _rid()
    inboxes = [receiver.expect(streaming, 0, 32768), receiver.expect(idle, 0, 8)]
    async with LoopbackLink(receiver.port, bytes_per_s=2 * MIB) as link:
        transfers = [OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", link.listen_port), rid, 0, deadline_s=30)
                     for rid in (streaming, idle)]
        # 32 MiB in 512 KiB frames: more than the socket buffers hold (up to 4 MiB in P's kernel alone)
        # by the time the idle request's keepalive, queued behind them, has arrived
        kv = torch.randn(4, 2, 2, 32768, 16)
        for start in range(0, 32768, 512):
            await transfers[0].put(start, kv[:, :, :, start:start + 512])
        while inboxes[0].state is TransferState.WAITING or inboxes[1].keepalives == 0:
            await asyncio.sleep(0.01)
        link.cut()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for inbox in inboxes:
            with pytest.raises(DeadlineExceeded, match="stalled"):
                await inbox.wait(30, stall_timeout_s=STALL_S)
        assert loop.time() - t0 < 5 * STALL_S
        async with asyncio.timeout(10):
            results = [await transfer.finish() for transfer in transfers]
        assert [result.state for result in results] == [TransferState.FAILED] * 2
        assert "stalled" in results[0].error, results[0].error
        await sender.close()


async def test_a_silent_connection_stalls_its_requests_while_another_connection_moves(receiver: KVReceiver) -> None:
    """Progress belongs to the connection, not the decoder: bytes from another P do not keep alive
    a request whose own connection is cut."""
    cut_sender = KVSender(LAYOUT, torch.float32, 2.0, stall_timeout_s=STALL_S)
    live_sender = KVSender(LAYOUT, torch.float32, 2.0, stall_timeout_s=STALL_S)
    cut_rid, live_rid = _rid(), _rid()
    cut_inbox, live_inbox = receiver.expect(cut_rid, 0, 8), receiver.expect(live_rid, 0, 8)
    live = OutgoingTransfer(live_sender, KVTarget(Role.MAIN, "127.0.0.1", receiver.port), live_rid, 0, deadline_s=30)
    async with LoopbackLink(receiver.port) as link:
        cut = OutgoingTransfer(cut_sender, KVTarget(Role.MAIN, "127.0.0.1", link.listen_port), cut_rid, 0,
                               deadline_s=30)
        while cut_inbox.keepalives == 0 or live_inbox.keepalives == 0:
            await asyncio.sleep(0.01)
        link.cut()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(DeadlineExceeded, match="stalled"):
            await cut_inbox.wait(30, stall_timeout_s=STALL_S)
        assert loop.time() - t0 < 5 * STALL_S
        kv = torch.randn(4, 2, 2, 8, 16)
        await live.put(0, kv)
        assert (await live.finish()).state is TransferState.DONE
        assert torch.equal(await live_inbox.wait(5, stall_timeout_s=STALL_S), kv)
        cut.abort("test over")
        await cut_sender.close()
    await live_sender.close()


async def test_the_receiver_measures_the_link_not_the_pauses_between_chunks(receiver: KVReceiver) -> None:
    """Four 1 MiB chunks over a 4 MiB/s link with P's compute (1 s) between them: the inbox's rate
    counts only the time payload was arriving, so it is the link's (about 4 MiB/s, within this
    machine's scheduling noise), where bytes over the whole transfer would say under half of it."""
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    kv = torch.randn(4, 2, 2, 4096, 16)  # 1 KiB per token: 4 MiB
    rid = _rid()
    inbox = receiver.expect(rid, 0, 4096)
    async with LoopbackLink(receiver.port, bytes_per_s=4 * MIB) as link:
        transfer = OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", link.listen_port), rid, 0, deadline_s=30)
        for start in range(0, 4096, 1024):
            if start:
                await asyncio.sleep(1.0)
            await transfer.put(start, kv[:, :, :, start:start + 1024])
        await transfer.finish()
        assert torch.equal(await inbox.wait(30), kv)
    whole_s = inbox.done_at - inbox.first_frame_at
    assert inbox.bytes_received / whole_s < 2 * MIB, "the pauses are most of the transfer"
    assert 2 * MIB < inbox.link_bytes_per_s < 6 * MIB, inbox.link_bytes_per_s / MIB
    assert receiver.expect(_rid(), 0, 16).link_bytes_per_s is None, "under 1 MiB: buffers could deliver it"
    await sender.close()


async def test_a_background_transfer_waits_for_the_foreground_then_keeps_its_pace(receiver: KVReceiver) -> None:
    """RLD finished the request: MD's KV still goes, but only while no other transfer to MD is open,
    and no faster than the pace it was given (small frames, so a new transfer finds little ahead)."""
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    kv = torch.randn(4, 2, 2, 600, 16)  # 300 KB: three background frames, enough to measure a link from
    rid_fg, rid_bg = _rid(), _rid()
    inbox_fg = receiver.expect(rid_fg, 0, 50)
    inbox_bg = receiver.expect(rid_bg, 0, 600)
    foreground = OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", receiver.port), rid_fg, queue_chunks=2,
                                  deadline_s=10)
    held = KVTarget(Role.MAIN, "127.0.0.1", receiver.port, held=True)
    background = OutgoingTransfer(sender, held, rid_bg, queue_chunks=2, deadline_s=10)
    await background.put(0, kv)
    background.background(bytes_per_s=400_000)
    assert not background.held
    await asyncio.sleep(0.3)
    assert inbox_bg.bytes_received == 0, "nothing while the foreground transfer is open"

    await foreground.put(0, torch.randn(4, 2, 2, 50, 16))
    assert (await foreground.finish()).state is TransferState.DONE
    started = time.monotonic()
    result = await background.finish()
    took = time.monotonic() - started
    assert result.state is TransferState.DONE
    assert torch.equal(await inbox_bg.wait(5), kv)
    await inbox_fg.wait(5)
    assert background.background_bytes == result.kv_bytes > kv.numel() * 4
    assert took >= 0.8 * result.kv_bytes / 400_000, "paced"
    assert not sender.throughput.bytes_per_s, "a paced transfer is no measure of the link"
    await sender.close()
