"""A decoder's KV port against peers that mean harm, over real loopback sockets: authentication on
by default under `pdd up`, oversize frames refused without being buffered, frames for unknown
requests dropped as they stream in, idle and trickling connections closed on their deadlines,
connection caps, and P's own idle connections reopened transparently."""
from __future__ import annotations

import asyncio
import contextlib
import stat
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest
import torch

from shared import kv_wire
from shared.config import KVLimits
from shared.errors import KVUnreachable
from shared.kv_handshake import read_message
from shared.kv_receiver import KVReceiver
from shared.kv_sender import KVSender, OutgoingTransfer
from shared.kv_transfer_state import TransferState
from shared.messages import KVTarget
from shared.models import KVLayout, kv_layout
from shared.names import Role
from tools.api_client import stream_completion
from tools.stack_config import KV_SECRET_FILE

from helpers import fresh_heartbeats, random_prompt

LAYOUT = KVLayout("tiny@abc", num_layers=4, kv_heads=2, head_dim=16)
MIB = 1024 * 1024
IDLE_S = 0.5
READ_WINDOW_S = 0.5
LIMITS = KVLimits(idle_timeout_s=IDLE_S, read_window_s=READ_WINDOW_S, read_min_bytes=1024,
                  max_connections=5, max_connections_per_peer=3)


def _rid() -> str:
    return "req-" + uuid.uuid4().hex


@contextlib.asynccontextmanager
async def running_receiver(limits: KVLimits):
    recv = KVReceiver(LAYOUT, torch.float32, limits=limits)
    recv.port = await recv.start("127.0.0.1", 0)
    try:
        yield recv
    finally:
        await recv.stop()


@pytest.fixture
async def receiver():
    """Short deadlines and small caps (LIMITS)."""
    async with running_receiver(LIMITS) as recv:
        yield recv


@pytest.fixture
async def patient_receiver():
    """LIMITS' caps with the default deadlines, for tests that hold connections open a while."""
    async with running_receiver(KVLimits(max_connections=LIMITS.max_connections,
                                         max_connections_per_peer=LIMITS.max_connections_per_peer)) as recv:
        yield recv


async def main_heartbeat(nats_url: str):
    return (await fresh_heartbeats(nats_url, ("main",)))["main"]


STACK = {"pipeline": "auto", "chunk_tokens": 256}  # `pdd up` as an operator runs it: default config, no secret given


async def connect(port: int, layout: KVLayout = LAYOUT, secret: bytes | None = None, source: str = "127.0.0.1",
                  host: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict]:
    """A raw KV peer through the handshake: (reader, writer, the decoder's answer)."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    async with asyncio.timeout(5):
        challenge = await read_message(reader)
        if challenge.get("ok") is False:
            return reader, writer, challenge
        writer.write(kv_wire.pack_message(kv_wire.hello(layout, torch.float32, {
            "nonce": kv_wire.new_nonce(), "auth": kv_wire.proof(secret, challenge["nonce"], "sender")})))
        await writer.drain()
        return reader, writer, await read_message(reader)


def data_header(rid: str, layout: KVLayout, tokens: int) -> bytes:
    """A well-formed DATA frame header for `tokens` tokens of every layer (float32)."""
    length = layout.num_layers * 2 * layout.kv_heads * tokens * layout.head_dim * 4
    return kv_wire.FRAME_HEADER.pack(kv_wire.MAGIC, kv_wire.PROTOCOL_VERSION, kv_wire.FrameKind.DATA, 1,
                                     kv_wire.request_id_bytes(rid), 0, layout.num_layers, 0, tokens,
                                     layout.kv_heads, layout.head_dim, length, 0)


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> float:
    """Seconds until the decoder closes the connection (fails the test past `timeout_s`)."""
    t0 = time.monotonic()
    async with asyncio.timeout(timeout_s):
        try:
            while await reader.read(65536):
                pass
        except ConnectionError:
            pass
    return time.monotonic() - t0


def rss_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


async def send_oversize_frame(port: int, layout: KVLayout, secret: bytes) -> int:
    """Handshake, then a DATA header of 256 MiB for a request nobody expects, and as much of its
    payload as the decoder takes. Returns the payload bytes it took before closing."""
    reader, writer, welcome = await connect(port, layout, secret)
    assert welcome["ok"], welcome
    tokens = kv_wire.MAX_PAYLOAD_BYTES // (layout.num_layers * 2 * layout.kv_heads * layout.head_dim * 4)
    writer.write(data_header(_rid(), layout, tokens))
    piece, sent = bytes(MIB), 0
    try:
        while sent < kv_wire.MAX_PAYLOAD_BYTES:
            writer.write(piece)
            await writer.drain()
            sent += len(piece)
    except ConnectionError:
        pass
    writer.close()
    return sent


# --- under `pdd up` defaults ------------------------------------------------------------------------

async def test_pdd_up_makes_a_private_kv_secret_and_refuses_an_unauthenticated_peer(stack, session, tiny_generate):
    secret_file = stack.log_dir / KV_SECRET_FILE
    assert stack.kv_secret_file == secret_file
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    beat = await main_heartbeat(stack.nats_url)
    layout = kv_layout(stack.model_path)
    assert beat.model_id == layout.model_id
    reader, writer, reply = await connect(beat.kv_port, layout, secret=None, host=beat.kv_host)  # auth: null
    assert reply == {"ok": False, "reason": "KV peer failed authentication"}
    await closed_within(reader, 5)
    writer.close()
    prompt = random_prompt(7, 40)
    result = await stream_completion(session, stack.api_url, {"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert result.token_ids == tiny_generate(prompt, 6), "P, RLD and MD share the secret the launcher made"


async def test_oversize_frames_for_unknown_requests_leave_md_memory_flat(stack):
    """Three authenticated connections each announce a 256 MiB frame for an unknown request: MD
    refuses each at its header, and its peak RSS over the attack stays within 50 MB of its start."""
    beat = await main_heartbeat(stack.nats_url)
    md = stack.processes[Role.MAIN].pid
    Path(f"/proc/{md}/clear_refs").write_text("5")  # reset MD's peak RSS (VmHWM) to its RSS now
    start = rss_bytes(md, "VmRSS")
    secret = stack.kv_secret_file.read_bytes().strip()
    async with asyncio.timeout(60):
        taken = await asyncio.gather(*(send_oversize_frame(beat.kv_port, kv_layout(stack.model_path), secret)
                                       for _ in range(3)))
    await asyncio.sleep(0.5)
    peak = rss_bytes(md, "VmHWM")
    print(f"MD RSS at start {start / MIB:.0f} MiB, peak during the attack {peak / MIB:.0f} MiB, "
          f"payload MiB the sockets took: {[t // MIB for t in taken]}")
    assert peak - start < 50 * 1000 * 1000
    assert max(taken) < 64 * MIB, "MD closed the connection at the header, not after reading the payload"
    after = await main_heartbeat(stack.nats_url)
    assert after.stats["kv_refused_connections"] >= beat.stats["kv_refused_connections"] + 3


# --- one KVReceiver in this process --------------------------------------------------------------

async def test_a_frame_for_an_unknown_request_is_dropped_as_it_streams_in() -> None:
    """The largest frame a decoder takes (here one 8 MiB token of a big model), for a request it
    does not expect, is read and dropped in pieces: never held whole, and the connection goes on."""
    big = KVLayout("big@abc", num_layers=64, kv_heads=64, head_dim=256)
    receiver = KVReceiver(big, torch.float32)
    port = await receiver.start("127.0.0.1", 0)
    reader, writer, welcome = await connect(port, big)
    assert welcome["ok"] and welcome["idle_timeout_s"] == KVLimits().idle_timeout_s
    payload = bytes(receiver.max_payload)
    assert len(payload) == 8 * MIB
    tracemalloc.start()
    try:
        writer.write(data_header(_rid(), big, 1))
        for offset in range(0, len(payload), 64 * 1024):
            writer.write(payload[offset:offset + 64 * 1024])
            await writer.drain()
        async with asyncio.timeout(5):
            while receiver.frames_dropped == 0:
                await asyncio.sleep(0.01)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(payload) / 4, f"{peak} bytes allocated while dropping a {len(payload)} byte frame"
    rid = _rid()
    inbox = receiver.expect(rid, 0, 1)
    writer.write(kv_wire.pack_control_frame(kv_wire.FrameKind.ABORT, rid, big, torch.float32))
    await writer.drain()
    async with asyncio.timeout(5):
        while not inbox.ended:
            await asyncio.sleep(0.01)
    assert inbox.state is TransferState.ABORTED, "the same connection still carries frames"
    writer.close()
    await receiver.stop()


async def test_a_frame_over_the_size_limit_is_refused_and_closes_the_connection(receiver: KVReceiver) -> None:
    reader, writer, _ = await connect(receiver.port)
    per_token = LAYOUT.num_layers * 2 * LAYOUT.kv_heads * LAYOUT.head_dim * 4
    writer.write(data_header(_rid(), LAYOUT, receiver.max_payload // per_token + 1))
    await writer.drain()
    await closed_within(reader, 2)
    assert receiver.refused_connections == 1 and receiver.frames_dropped == 0
    writer.close()


@pytest.mark.parametrize("where", ["header", "payload of an expected request", "payload of an unknown request"])
async def test_a_trickling_peer_is_closed_within_the_read_deadline(receiver: KVReceiver, where: str) -> None:
    """1 byte/s inside a frame: the read deadline asks for read_min_bytes per window."""
    rid = _rid()
    if where == "payload of an expected request":
        receiver.expect(rid, 0, 8)
    reader, writer, _ = await connect(receiver.port)
    frame = data_header(rid, LAYOUT, 8) + bytes(LAYOUT.num_layers * 2 * LAYOUT.kv_heads * 8 * LAYOUT.head_dim * 4)
    sent = 1 if where == "header" else kv_wire.FRAME_HEADER.size
    writer.write(frame[:sent])

    async def trickle() -> None:
        for i in range(sent, len(frame)):
            await asyncio.sleep(1.0)
            writer.write(frame[i:i + 1])

    trickling = asyncio.create_task(trickle())
    took = await closed_within(reader, 2 * READ_WINDOW_S + 1.0)
    trickling.cancel()
    writer.close()
    assert took < 2 * READ_WINDOW_S + 0.5
    assert receiver.slow_closes == 1


async def test_an_idle_peer_after_the_handshake_is_closed_within_the_idle_deadline(receiver: KVReceiver) -> None:
    reader, writer, welcome = await connect(receiver.port)
    assert welcome["ok"]
    took = await closed_within(reader, IDLE_S + 1.0)
    writer.close()
    assert IDLE_S * 0.8 < took < IDLE_S + 0.5
    assert receiver.idle_closes == 1 and receiver.open_connections == 0


async def test_a_connection_that_carries_an_open_transfer_is_not_idle(receiver: KVReceiver) -> None:
    """Silence on a connection whose transfer is open is that transfer's stall (its own deadline),
    not idling; once the transfer ends, the idle deadline applies again."""
    rid = _rid()
    receiver.expect(rid, 0, 8)
    reader, writer, _ = await connect(receiver.port)
    writer.write(kv_wire.pack_control_frame(kv_wire.FrameKind.KEEPALIVE, rid, LAYOUT, torch.float32))
    await writer.drain()
    await asyncio.sleep(4 * IDLE_S)
    assert receiver.open_connections == 1 and receiver.idle_closes == 0
    receiver.release(rid, "client gone")
    await closed_within(reader, 2 * IDLE_S + 1.0)
    assert receiver.idle_closes == 1
    writer.close()


async def test_connections_beyond_the_caps_are_refused(patient_receiver: KVReceiver) -> None:
    """3 per peer address and 5 in all (LIMITS), counted once a connection has authenticated: the
    refusal answers the hello, and P takes it as the decoder unreachable, not incompatible."""
    receiver = patient_receiver
    held = []
    for _ in range(LIMITS.max_connections_per_peer):
        held.append(await connect(receiver.port, source="127.0.0.1"))
    _, refused, reply = await connect(receiver.port, source="127.0.0.1")
    refused.close()
    assert reply["ok"] is False and "from 127.0.0.1" in reply["reason"]
    for _ in range(LIMITS.max_connections - LIMITS.max_connections_per_peer):
        held.append(await connect(receiver.port, source="127.0.0.2"))
    _, refused, reply = await connect(receiver.port, source="127.0.0.3")
    refused.close()
    assert reply["ok"] is False and "KV connections open," in reply["reason"]
    assert all(welcome["ok"] for _, _, welcome in held) and receiver.open_connections == LIMITS.max_connections
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    with pytest.raises(KVUnreachable, match="refused"):
        await sender.connection("127.0.0.1", receiver.port)
    assert receiver.refused_connections == 3
    for _, writer, _ in held:
        writer.close()
    async with asyncio.timeout(5):
        while receiver.open_connections:
            await asyncio.sleep(0.01)
    await transfer(sender, receiver, torch.randn(4, 2, 2, 8, 16))
    await sender.close()


async def test_unauthenticated_connections_have_their_own_budget_and_a_short_deadline() -> None:
    """Strangers that never answer the challenge take no slot of the caps; past their own budget the
    oldest is closed for a newer one, and each is closed at the handshake deadline. P gets through."""
    receiver = KVReceiver(LAYOUT, torch.float32, limits=KVLimits(max_connections_per_peer=3), max_handshakes=4,
                          handshake_timeout_s=1.0)
    receiver.port = await receiver.start("127.0.0.1", 0)
    try:
        strangers = []
        for _ in range(6):  # more than the per-peer cap (3) and the handshake budget (4)
            strangers.append(await asyncio.open_connection("127.0.0.1", receiver.port))
            await asyncio.sleep(0.02)
        for reader, _ in strangers[:2]:  # the oldest, closed to make room
            await closed_within(reader, 0.5)
        assert receiver.handshake_evictions == 2 and receiver.handshaking_connections == 4
        assert receiver.open_connections == 0
        sender = KVSender(LAYOUT, torch.float32, 2.0)
        await transfer(sender, receiver, torch.randn(4, 2, 2, 8, 16))
        assert receiver.open_connections == 1 and receiver.handshake_evictions == 3
        for reader, _ in strangers[3:]:  # the rest, at the handshake deadline
            await closed_within(reader, 1.0 + 1.0)
        assert receiver.handshaking_connections == 0 and receiver.open_connections == 1
        await sender.close()
        for _, writer in strangers:
            writer.close()
    finally:
        await receiver.stop()


async def transfer(sender: KVSender, receiver: KVReceiver, kv: torch.Tensor) -> None:
    rid = _rid()
    inbox = receiver.expect(rid, 0, kv.shape[3])
    outgoing = OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", receiver.port), rid, 0, deadline_s=5)
    await outgoing.put(0, kv)
    result = await outgoing.finish()
    assert result.state is TransferState.DONE, result.error
    assert torch.equal(await inbox.wait(5, stall_timeout_s=2.0), kv)


async def test_p_sends_the_next_request_after_a_long_idle(receiver: KVReceiver) -> None:
    """P keeps its connection between requests; the decoder closes it once idle past its deadline,
    and P's next request opens a fresh one instead of failing on the closed one."""
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    await transfer(sender, receiver, torch.randn(4, 2, 2, 8, 16))
    await asyncio.sleep(4 * IDLE_S)  # long past the decoder's idle deadline
    assert receiver.idle_closes == 1 and receiver.open_connections == 0
    await transfer(sender, receiver, torch.randn(4, 2, 2, 8, 16))
    assert sender.open_connections == 1
    await sender.close()


async def test_p_retires_an_idle_connection_before_the_decoder_would_close_it(receiver: KVReceiver) -> None:
    """Past half the decoder's idle deadline P opens a new connection rather than write into one the
    decoder may be closing at that moment (a frame written into it would be lost)."""
    sender = KVSender(LAYOUT, torch.float32, 2.0)
    await transfer(sender, receiver, torch.randn(4, 2, 2, 8, 16))
    first = await sender.connection("127.0.0.1", receiver.port)
    await asyncio.sleep(0.7 * IDLE_S)
    await transfer(sender, receiver, torch.randn(4, 2, 2, 8, 16))
    assert (await sender.connection("127.0.0.1", receiver.port)) is not first and first.closed
    assert receiver.idle_closes == 0
    await sender.close()


async def test_every_connection_of_a_queued_transfer_keeps_alive(receiver: KVReceiver) -> None:
    """P spreads a transfer over several connections; while its chunks wait for P's engine longer
    than the decoder's idle deadline, none of them is closed as idle."""
    sender = KVSender(LAYOUT, torch.float32, 2.0, connections_per_peer=3, stall_timeout_s=0.4)
    rid = _rid()
    kv = torch.randn(4, 2, 2, 96, 16)
    inbox = receiver.expect(rid, 0, 96)
    outgoing = OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", receiver.port), rid, 0, deadline_s=10)
    await asyncio.sleep(4 * IDLE_S)  # queued at P
    assert receiver.open_connections == 3 and receiver.idle_closes == 0
    for start in range(0, 96, 32):
        await outgoing.put(start, kv[:, :, :, start:start + 32])
    assert (await outgoing.finish()).state is TransferState.DONE
    assert torch.equal(await inbox.wait(5), kv)
    await sender.close()
