"""KV transfer over TCP: the decoder's receiving side and P's sending side.

Each transfer is a small state machine (TransferState) moved only by `_move`. The receiver
(`KVReceiver`) listens on the decoder's KV port and fills one `KVInbox` per expected request;
the sender (`KVSender`) keeps one handshaken connection per decoder address, and an
`OutgoingTransfer` streams one request's chunks to one decoder through a queue. While a transfer
has nothing to send (its chunks still wait for P's engine) its sender writes a KEEPALIVE every
`keepalive_s`, so the receiver's stall deadline measures the link and P's liveness, never P's
queue; a held path (`KVTarget.held`) writes only KEEPALIVEs, its chunks queued, until P releases
it. A transfer moved to the background (`OutgoingTransfer.background`: RLD finished the request, MD
only keeps its KV for the session's next turn) writes small frames at a set pace, and only while
no other transfer to that decoder is open. Progress is counted per connection on both sides: bytes arriving on a
connection move every request it carries, and bytes leaving it move the frame P is writing, so frames queued
behind other requests' frames on a busy link wait, they do not stall. Frames for a request the
receiver does not expect (late, duplicate, aborted) are read and dropped as they stream in.

The receiver's port faces strangers (`KVLimits`): it caps connections per peer address and in
total, holds frames to a sane size, and closes a connection that idles without an open transfer
or trickles a frame; P retires a connection before the decoder's idle deadline could close it.

It is one module past 450 lines on purpose: both sides share the transfer states, the handshake and
the progress rule (a connection's bytes are progress for every request it carries), which change
together; split apart, each half would only make sense with the other open beside it.
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import fcntl
import logging
import struct
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass

import orjson
import torch

from shared import kv_wire
from shared.config import KVLimits
from shared.errors import DeadlineExceeded, IncompatiblePeer, PddError, PeerGone, ProtocolError, RequestAborted
from shared.messages import KVTarget
from shared.models import KVLayout

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
MAX_FRAME_BYTES = kv_wire.FRAME_PAYLOAD_BYTES
BACKGROUND_FRAME_BYTES = 128 * 1024  # a background frame: what a new transfer may find ahead of it on the link
PROGRESS_READ_BYTES = 256 * 1024  # the most a receiver reads at once inside one frame
LINK_SAMPLE_MIN_BYTES = 1024 * 1024  # a smaller transfer can arrive from buffers faster than the link
KEEPALIVE_MAX_S = 1.0  # an idle transfer speaks at least this often, whatever the stall timeout
ABORT_FRAME_TIMEOUT_S = 1.0
_TIOCOUTQ = getattr(termios, "TIOCOUTQ", None)  # a socket's unsent + unacknowledged bytes (Linux)


class TransferState(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


_ALLOWED = {
    TransferState.WAITING: {TransferState.TRANSFERRING, TransferState.DONE, TransferState.FAILED,
                            TransferState.ABORTED},
    TransferState.TRANSFERRING: {TransferState.DONE, TransferState.FAILED, TransferState.ABORTED},
    TransferState.DONE: set(),
    TransferState.FAILED: set(),
    TransferState.ABORTED: set(),
}


class _StateMachine:
    state = TransferState.WAITING

    def _move(self, new: TransferState) -> None:
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(f"illegal transfer transition {self.state.value} -> {new.value}")
        self.state = new

    @property
    def ended(self) -> bool:
        return not _ALLOWED[self.state]


async def read_message(reader: asyncio.StreamReader) -> dict:
    """One length-prefixed JSON object of the handshake."""
    length = kv_wire.unpack_length(await reader.readexactly(kv_wire.LENGTH_PREFIX_BYTES))
    try:
        msg = orjson.loads(await reader.readexactly(length))
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"handshake message is not JSON: {exc}") from exc
    if not isinstance(msg, dict):
        raise ProtocolError("handshake message is not a JSON object")
    return msg


# --- receiving side (RLD, MD) ---------------------------------------------------------------

class InboundLink:
    """One sender connection as the receiver sees it: when bytes last arrived on it.

    The requests whose frames it carries share its progress: on a busy link a request's next frame
    may queue behind many of other requests', and the link moving is what says it is not stalled.
    """

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.bytes_received = 0
        self.last_bytes_at = time.monotonic()
        self._inboxes: set[KVInbox] = set()  # the transfers whose frames it carried

    def saw_bytes(self, count: int) -> None:
        self.bytes_received += count
        self.last_bytes_at = time.monotonic()

    def carries(self, inbox: KVInbox) -> None:
        self._inboxes.add(inbox)

    @property
    def carries_open_transfer(self) -> bool:
        """Whether a transfer it carried is still open: then its silence is that transfer's stall, not idling."""
        self._inboxes = {inbox for inbox in self._inboxes if not inbox.ended}
        return bool(self._inboxes)


class KVInbox(_StateMachine):
    """One request's KV arriving at a decoder: tokens [token_start, token_end) of every layer."""

    def __init__(self, request_id: str, layout: KVLayout, token_start: int, token_end: int,
                 dtype: torch.dtype) -> None:
        self.request_id = request_id
        self.token_start = token_start
        self.token_end = token_end
        self.layout = layout
        tokens = token_end - token_start
        self.kv = torch.empty(layout.num_layers, 2, layout.kv_heads, tokens, layout.head_dim, dtype=dtype)
        self._cells_needed = layout.num_layers * tokens
        self._cells_filled = 0
        self._seen: set[tuple[int, int, int, int]] = set()
        self.bytes_received = 0
        self.keepalives = 0
        self.first_frame_at: float | None = None
        self._payload_spans: list[tuple[float, float]] = []  # (start, end) of reading each DATA payload
        self._links: set[InboundLink] = set()  # every connection that carried a frame of this request
        self.done_at: float | None = None
        self.error: PddError | None = None
        self._ended = asyncio.Event()
        if tokens == 0:
            self._finish()

    def accept(self, header: kv_wire.FrameHeader, kv: torch.Tensor) -> None:
        if self.ended:
            return
        key = (header.layer_start, header.layer_end, header.token_start, header.token_end)
        if key in self._seen:
            return  # a duplicate frame changes nothing
        if (header.layer_end > self.layout.num_layers or header.token_start < self.token_start
                or header.token_end > self.token_end):
            self.fail(ProtocolError(f"frame {key} outside the expected range"))
            return
        if self.state is TransferState.WAITING:
            self._move(TransferState.TRANSFERRING)
            self.first_frame_at = time.monotonic()
        self._seen.add(key)
        t0, t1 = header.token_start - self.token_start, header.token_end - self.token_start
        self.kv[header.layer_start:header.layer_end, :, :, t0:t1].copy_(kv)
        self._cells_filled += (header.layer_end - header.layer_start) * (t1 - t0)
        self.bytes_received += header.payload_len
        if self._cells_filled >= self._cells_needed:
            self._finish()

    def payload_read(self, started_at: float, ended_at: float) -> None:
        """A DATA frame's payload took [started_at, ended_at] (monotonic) to come in."""
        self._payload_spans.append((started_at, ended_at))

    @property
    def link_bytes_per_s(self) -> float | None:
        """The rate the KV arrived at while it arrived: payload bytes over the time any payload was
        coming in (the union of the frames' reads, so P's compute between chunks does not count).
        What P measures as its writes complete says more about buffers than the link; this is the
        link. None below LINK_SAMPLE_MIN_BYTES, which buffers alone could deliver."""
        if self.bytes_received < LINK_SAMPLE_MIN_BYTES:
            return None
        busy_s, reach = 0.0, float("-inf")
        for start, end in sorted(self._payload_spans):
            if end > reach:
                busy_s += end - max(start, reach)
                reach = end
        return self.bytes_received / busy_s if busy_s > 0 else None

    def heard_on(self, link: InboundLink) -> None:
        """A frame for this request arrived on `link`: from now on its bytes are this transfer's progress."""
        self._links.add(link)
        link.carries(self)

    @property
    def last_progress_at(self) -> float | None:
        """When bytes last arrived on a connection that carries this request (None before P's first word)."""
        return max((link.last_bytes_at for link in self._links), default=None)

    def keepalive(self) -> None:
        """The sender still holds the request (its KV waits for P's engine) and the link works."""
        self.keepalives += 1

    def _finish(self) -> None:
        self._move(TransferState.DONE)
        self.done_at = time.monotonic()
        self._ended.set()

    def fail(self, error: PddError) -> None:
        if not self.ended:
            self.error = error
            self._move(TransferState.FAILED)
            self._ended.set()

    def abort(self, reason: str) -> None:
        if not self.ended:
            self.error = RequestAborted(f"KV transfer aborted: {reason}")
            self._move(TransferState.ABORTED)
            self._ended.set()

    async def wait(self, timeout_s: float, stall_timeout_s: float | None = None) -> torch.Tensor:
        """The complete KV [layers, 2, kv_heads, tokens, head_dim], or the transfer's error.

        Two deadlines: the whole transfer within `timeout_s`, and once the sender has spoken (KV
        bytes or a KEEPALIVE), no silence longer than `stall_timeout_s` on the connections that
        carry the request (a cut or stuck link, or a dead sender, shows up as a stall; frames of
        other requests ahead of this one's on a busy link do not). Before the sender's first word
        the request is waiting (the sender has not opened its transfer yet), and only `timeout_s`
        bounds that.
        """
        deadline = time.monotonic() + timeout_s
        while not self.ended:
            now = time.monotonic()
            if now >= deadline:
                self.fail(DeadlineExceeded(f"KV for {self.request_id} not complete within {timeout_s:.1f}s"))
                break
            wait_s = deadline - now
            if stall_timeout_s is not None:
                progress_at = self.last_progress_at
                if progress_at is not None and now - progress_at >= stall_timeout_s:
                    self.fail(DeadlineExceeded(f"KV for {self.request_id} stalled: no frame for "
                                               f"{stall_timeout_s:.1f}s on its connection"))
                    break
                since = progress_at if progress_at is not None else now
                wait_s = min(wait_s, since + stall_timeout_s - now)
            try:
                async with asyncio.timeout(wait_s):
                    await self._ended.wait()
            except TimeoutError:
                continue
        if self.state is not TransferState.DONE:
            assert self.error is not None  # fail() and abort() set it as they end the transfer
            raise self.error
        return self.kv


class KVReceiver:
    """The decoder's KV port: handshakes senders and routes frames into inboxes.

    Nothing a peer sends makes it hold more than one frame of at most `max_payload` bytes per
    connection, and that only for a request it expects; `limits` bounds connections and time.
    """

    def __init__(self, layout: KVLayout, dtype: torch.dtype, secret: bytes | None = None,
                 limits: KVLimits = KVLimits()) -> None:
        self.layout = layout
        self.dtype = dtype
        self.secret = secret
        self.limits = limits
        self.max_payload = kv_wire.max_payload_bytes(layout)
        self.refused_connections = 0  # failed the handshake, or over a connection cap
        self.idle_closes = 0
        self.slow_closes = 0  # a frame trickled in slower than the read deadline allows
        self.inboxes: dict[str, KVInbox] = {}
        self.frames_dropped = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._per_peer: dict[str, int] = {}  # peer address -> connections, handshaking ones included
        self._handlers: set[asyncio.Task] = set()

    @property
    def open_connections(self) -> int:
        return len(self._writers)

    def expect(self, request_id: str, token_start: int, token_end: int) -> KVInbox:
        inbox = KVInbox(request_id, self.layout, token_start, token_end, self.dtype)
        self.inboxes[request_id] = inbox
        return inbox

    def release(self, request_id: str, reason: str = "released") -> None:
        inbox = self.inboxes.pop(request_id, None)
        if inbox is not None:
            inbox.abort(reason)

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve_connection, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._handlers:  # closed sockets end the handlers; let them finish rather than be cancelled
            await asyncio.wait(self._handlers, timeout=2.0)
        for inbox in list(self.inboxes.values()):
            inbox.abort("decoder shutting down")
        self.inboxes.clear()

    def _over_cap(self, address: str) -> str | None:
        """Why one more connection from `address` is refused, or None."""
        if len(self._writers) >= self.limits.max_connections:
            return f"{len(self._writers)} KV connections open, the most this decoder takes"
        if self._per_peer.get(address, 0) >= self.limits.max_connections_per_peer:
            return f"{self._per_peer[address]} KV connections open from {address}, the most it takes from one peer"
        return None

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) else str(peer)
        if (reason := self._over_cap(address)) is not None:
            self.refused_connections += 1
            log.warning("KV peer %s refused: %s", peer, reason)
            writer.write(kv_wire.pack_message({"ok": False, "reason": reason}))  # in place of the challenge
            writer.close()
            return
        self._writers.add(writer)
        self._per_peer[address] = self._per_peer.get(address, 0) + 1
        handler = asyncio.current_task()
        assert handler is not None  # asyncio.start_server runs each connection's callback as a task
        self._handlers.add(handler)
        try:
            await self._handshake(reader, writer)
            link = InboundLink(f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer))
            while True:
                await self._read_frame(reader, link)
        except asyncio.IncompleteReadError:
            log.debug("KV peer %s closed", peer)
        except DeadlineExceeded as exc:
            log.info("KV peer %s closed: %s", peer, exc)
        except (ProtocolError, IncompatiblePeer, TimeoutError) as exc:
            self.refused_connections += 1
            log.warning("KV peer %s refused: %s", peer, exc or "handshake timed out")
        except ConnectionError as exc:
            log.info("KV peer %s connection lost: %s", peer, exc)
        finally:
            self._writers.discard(writer)
            self._per_peer[address] -= 1
            if not self._per_peer[address]:
                del self._per_peer[address]
            self._handlers.discard(handler)
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            nonce = kv_wire.new_nonce()
            writer.write(kv_wire.pack_message(kv_wire.challenge(nonce)))
            await writer.drain()
            try:
                msg = await read_message(reader)
                kv_wire.check_hello(msg, self.layout)
                kv_wire.check_proof(self.secret, nonce, "sender", msg.get("auth"))
            except (ProtocolError, IncompatiblePeer) as exc:
                writer.write(kv_wire.pack_message({"ok": False, "reason": str(exc)}))
                await writer.drain()
                raise IncompatiblePeer(str(exc)) from exc
            writer.write(kv_wire.pack_message({
                "ok": True, "model_id": self.layout.model_id,
                "auth": kv_wire.proof(self.secret, str(msg.get("nonce")), "receiver"),
                "idle_timeout_s": self.limits.idle_timeout_s or None}))
            await writer.drain()

    async def _read_frame(self, reader: asyncio.StreamReader, link: InboundLink) -> None:
        raw = bytearray(await self._frame_start(reader, link))
        raw += await self._read_steadily(reader, kv_wire.FRAME_HEADER.size - len(raw), link, keep=True)
        header = kv_wire.unpack_header(bytes(raw), max_payload=self.max_payload)
        if header.kind is kv_wire.FrameKind.DATA and (header.kv_heads, header.head_dim) != (
                self.layout.kv_heads, self.layout.head_dim):
            raise ProtocolError(f"frame of {header.kv_heads} KV heads of {header.head_dim}, this decoder has "
                                f"{self.layout.kv_heads} of {self.layout.head_dim}")
        inbox = self.inboxes.get(header.request_id)
        if inbox is not None and not inbox.ended:
            inbox.heard_on(link)
        if header.kind is not kv_wire.FrameKind.DATA or inbox is None or inbox.ended:
            await self._read_steadily(reader, header.payload_len, link, keep=False)  # never held whole
        if header.kind is kv_wire.FrameKind.KEEPALIVE:
            if inbox is not None:
                inbox.keepalive()
            return
        if inbox is None or inbox.ended:
            self.frames_dropped += 1
            return
        if header.kind is kv_wire.FrameKind.ABORT:
            inbox.abort("sender aborted")
        elif header.kind is kv_wire.FrameKind.DATA:
            started_at = time.monotonic()
            payload = await self._read_steadily(reader, header.payload_len, link, keep=True)
            inbox.payload_read(started_at, time.monotonic())
            try:
                inbox.accept(header, await asyncio.to_thread(kv_wire.payload_to_tensor, header, payload))  # crc32
            except ProtocolError as exc:
                inbox.fail(exc)
                raise

    async def _frame_start(self, reader: asyncio.StreamReader, link: InboundLink) -> bytes:
        """The first bytes of the next frame. A connection may wait `idle_timeout_s` for one, unless a
        transfer it carries is open: that transfer's own stall deadline judges its silence."""
        idle_s = self.limits.idle_timeout_s or None
        part: bytes | None
        while True:
            try:
                async with asyncio.timeout(idle_s):
                    part = await reader.read(kv_wire.FRAME_HEADER.size)
                break
            except TimeoutError:
                if (part := await _buffered(reader, kv_wire.FRAME_HEADER.size)) is not None:
                    break  # it arrived together with the deadline
                if not link.carries_open_transfer:
                    self.idle_closes += 1
                    raise DeadlineExceeded(f"no frame for {idle_s:g}s") from None
        if not part:
            raise asyncio.IncompleteReadError(b"", kv_wire.FRAME_HEADER.size)
        link.saw_bytes(len(part))
        return part

    async def _read_steadily(self, reader: asyncio.StreamReader, length: int, link: InboundLink, *,
                             keep: bool) -> bytearray:
        """`length` bytes taken as they arrive, in pieces of at most PROGRESS_READ_BYTES (each tells the
        link, and every request it carries, that it moves); with `keep` False they are dropped as they
        come. Each `read_window_s` must bring `read_min_bytes` or the rest: a trickle is closed."""
        kept = bytearray(length if keep else 0)
        window_s, loop = self.limits.read_window_s, asyncio.get_running_loop()
        got = window_got = 0
        window_end, window_due = loop.time() + window_s, min(self.limits.read_min_bytes, length)
        part: bytes | None
        with memoryview(kept) as view:
            while got < length:
                if window_s > 0 and loop.time() >= window_end:
                    if window_got < window_due:
                        self.slow_closes += 1
                        raise DeadlineExceeded(f"{window_got} bytes of a frame in {window_s:g}s, under the "
                                               f"{window_due} the read deadline asks")
                    window_got, window_due = 0, min(self.limits.read_min_bytes, length - got)
                    window_end = loop.time() + window_s
                want = min(length - got, PROGRESS_READ_BYTES)
                try:
                    async with asyncio.timeout_at(window_end if window_s > 0 else None):
                        part = await reader.read(want)
                except TimeoutError:
                    if (part := await _buffered(reader, want)) is None:
                        continue
                if not part:
                    raise asyncio.IncompleteReadError(bytes(view[:got]), length)
                if keep:
                    view[got:got + len(part)] = part
                got += len(part)
                window_got += len(part)
                link.saw_bytes(len(part))
        return kept


async def _buffered(reader: asyncio.StreamReader, limit: int) -> bytes | None:
    """Up to `limit` bytes the reader already holds (b"" at EOF), or None: a deadline and data can
    land in the same turn of the loop, and the data counts. A zero timeout fires only if read waits."""
    try:
        async with asyncio.timeout(0):
            return await reader.read(limit)
    except TimeoutError:
        return None


# --- sending side (P) -----------------------------------------------------------------------

class KVConnection:
    """One handshaken TCP connection from P to a decoder's KV port; frames are written whole."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 idle_timeout_s: float | None = None) -> None:
        self.reader = reader
        self.writer = writer
        self.lock = asyncio.Lock()
        self.idle_timeout_s = idle_timeout_s  # the decoder closes it after this long without a frame
        self.last_write_at = time.monotonic()
        self.transfers = 0  # open transfers that hold it (each speaks at least every keepalive_s)

    @property
    def closed(self) -> bool:
        return self.writer.is_closing() or self.reader.at_eof()

    @property
    def reusable(self) -> bool:
        """Open, and not idle long enough for the decoder to be closing it: P retires a connection at
        half the decoder's idle deadline, so a new transfer never races the decoder's close."""
        if self.closed:
            return False
        if self.idle_timeout_s is None or self.transfers or self.lock.locked():
            return True
        return time.monotonic() - self.last_write_at < self.idle_timeout_s / 2

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """While an open transfer uses it (so no other transfer retires it as idle)."""
        self.transfers += 1
        try:
            yield
        finally:
            self.transfers -= 1

    async def write(self, *parts: bytes | memoryview, stall_timeout_s: float | None = None) -> None:
        """Write one frame whole. `stall_timeout_s` bounds the link's silence while it takes the
        frame (TimeoutError when no byte left for that long), not the frame's whole time on a slow
        link, nor its wait for the connection: frames of other requests ahead of it are a queue."""
        async with self.lock:
            if self.closed:
                raise PeerGone("KV connection closed")
            for part in parts:
                self.writer.write(part)
            try:
                await self._drain(stall_timeout_s)
            finally:
                self.last_write_at = time.monotonic()

    def bytes_owed(self) -> int:
        """Bytes written but not yet taken by the peer: asyncio's buffer, plus the kernel's send
        queue where the OS tells it (Linux: unsent and unacknowledged), so progress shows as the
        peer acknowledges, not only when the kernel's (possibly megabytes of) buffer frees up."""
        owed = self.writer.transport.get_write_buffer_size()
        sock = self.writer.get_extra_info("socket")
        if _TIOCOUTQ is not None and sock is not None:
            try:
                owed += struct.unpack("i", fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[0]
            except OSError:
                pass
        return owed

    async def _drain(self, stall_timeout_s: float | None) -> None:
        """`drain`, failing only when no byte has left for `stall_timeout_s`: a slow link that
        takes seconds for a frame is moving; a cut one is not."""
        if stall_timeout_s is None:
            await self.writer.drain()
            return
        drained = asyncio.ensure_future(self.writer.drain())
        try:
            owed = self.bytes_owed()
            moved_at = time.monotonic()
            while True:
                now = time.monotonic()
                if now - moved_at >= stall_timeout_s:
                    raise TimeoutError(f"no KV byte left in {stall_timeout_s:.1f}s")
                poll_s = min(stall_timeout_s / 4, moved_at + stall_timeout_s - now)
                done, _ = await asyncio.wait({drained}, timeout=poll_s)
                if done:
                    drained.result()
                    return
                if (now_owed := self.bytes_owed()) < owed:
                    moved_at = time.monotonic()
                owed = now_owed
        finally:
            if not drained.done():
                drained.cancel()
            elif not drained.cancelled():
                drained.exception()  # retrieved: raised above, or superseded by the stall

    def close(self) -> None:
        self.writer.close()


class KVSender:
    """P's pool of connections to decoders: `connections_per_peer` per address, opened on first use.

    A transfer spreads each chunk's frames over all of a peer's connections, so one slow or
    lossy TCP stream does not hold the transfer back; the receiver places frames by position.
    """

    def __init__(self, layout: KVLayout, wire_dtype: torch.dtype, connect_timeout_s: float,
                 connections_per_peer: int = 1, stall_timeout_s: float = 10.0, secret: bytes | None = None) -> None:
        self.layout = layout
        self.secret = secret
        self.stall_timeout_s = stall_timeout_s
        self.wire_dtype = wire_dtype
        self.connect_timeout_s = connect_timeout_s
        self.connections_per_peer = max(1, connections_per_peer)
        self.throughput = LinkThroughput()
        self._pools: dict[tuple[str, int], list[KVConnection]] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}
        self._abort_frames: set[asyncio.Task] = set()  # each bounded by ABORT_FRAME_TIMEOUT_S; awaited by close()
        self._foreground: dict[tuple[str, int], set[OutgoingTransfer]] = {}  # open transfers, not background
        self._quiet: dict[tuple[str, int], asyncio.Event] = {}  # set while a peer has no foreground transfer

    @property
    def keepalive_s(self) -> float:
        """How long an idle transfer stays silent: well inside the receiver's stall deadline (P and
        the decoders take the same --kv-stall-timeout-s), and at most KEEPALIVE_MAX_S."""
        return min(KEEPALIVE_MAX_S, self.stall_timeout_s / 4)

    async def connections(self, host: str, port: int) -> list[KVConnection]:
        key = (host, port)
        lock = self._connecting.setdefault(key, asyncio.Lock())
        async with lock:
            pool = []
            for conn in self._pools.get(key, []):
                if conn.reusable:
                    pool.append(conn)
                else:  # closed by the decoder, or idle long enough that it soon would be
                    conn.close()
            missing = self.connections_per_peer - len(pool)
            if missing > 0:
                pool += await asyncio.gather(*(self._open(host, port) for _ in range(missing)))
            self._pools[key] = pool
            return pool

    async def connection(self, host: str, port: int) -> KVConnection:
        return (await self.connections(host, port))[0]

    def enter_foreground(self, transfer: OutgoingTransfer) -> None:
        key = (transfer.target.host, transfer.target.port)
        self._foreground.setdefault(key, set()).add(transfer)
        self._quiet.setdefault(key, asyncio.Event()).clear()

    def leave_foreground(self, transfer: OutgoingTransfer) -> None:
        """Idempotent."""
        key = (transfer.target.host, transfer.target.port)
        open_ = self._foreground.get(key)
        if open_ is None or transfer not in open_:
            return
        open_.discard(transfer)
        if not open_:
            del self._foreground[key]
            self._quiet.setdefault(key, asyncio.Event()).set()

    async def wait_quiet(self, host: str, port: int, timeout_s: float) -> bool:
        """Whether the peer has no foreground transfer open, waiting up to timeout_s for it."""
        quiet = self._quiet.setdefault((host, port), asyncio.Event())
        if (host, port) not in self._foreground:
            quiet.set()
        try:
            async with asyncio.timeout(timeout_s):
                await quiet.wait()
        except TimeoutError:
            return False
        return True

    async def _open(self, host: str, port: int) -> KVConnection:
        writer = None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(host, port)
                challenge = await read_message(reader)
                if challenge.get("ok") is False:  # over the decoder's connection caps
                    raise PeerGone(f"decoder {host}:{port} refused: {challenge.get('reason')}")
                if challenge.get("magic") != kv_wire.MAGIC.decode() or not isinstance(challenge.get("nonce"), str):
                    raise IncompatiblePeer(
                        f"{host}:{port} is not a pdd KV receiver of protocol {kv_wire.PROTOCOL_VERSION}")
                nonce = kv_wire.new_nonce()
                writer.write(kv_wire.pack_message(kv_wire.hello(self.layout, self.wire_dtype, {
                    "nonce": nonce, "auth": kv_wire.proof(self.secret, challenge["nonce"], "sender")})))
                await writer.drain()
                reply = await read_message(reader)
                if not reply.get("ok"):
                    raise IncompatiblePeer(f"decoder {host}:{port} refused: {reply.get('reason')}")
                kv_wire.check_proof(self.secret, nonce, "receiver", reply.get("auth"))
        except TimeoutError as exc:
            raise DeadlineExceeded(f"KV connect to {host}:{port} took over {self.connect_timeout_s}s") from exc
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise PeerGone(f"KV connect to {host}:{port} failed: {exc}") from exc
        except PddError:
            if writer is not None:
                writer.close()
            raise
        idle_s = reply.get("idle_timeout_s")
        return KVConnection(reader, writer, float(idle_s) if isinstance(idle_s, (int, float)) and idle_s > 0 else None)

    def drop(self, host: str, port: int) -> None:
        for conn in self._pools.pop((host, port), []):
            conn.close()

    @property
    def open_connections(self) -> int:
        return sum(1 for pool in self._pools.values() for conn in pool if not conn.closed)

    def send_abort_frame(self, request_id: str, host: str, port: int) -> None:
        """Tell a decoder, if its link is healthy, that P gave up on a request; close() awaits it."""
        task = asyncio.create_task(self._send_abort_frame(request_id, host, port),
                                   name=f"kv-abort-{request_id}")
        self._abort_frames.add(task)
        task.add_done_callback(self._abort_frames.discard)

    async def _send_abort_frame(self, request_id: str, host: str, port: int) -> None:
        try:
            async with asyncio.timeout(ABORT_FRAME_TIMEOUT_S):
                conn = await self.connection(host, port)
                await conn.write(kv_wire.pack_control_frame(kv_wire.FrameKind.ABORT, request_id, self.layout,
                                                            self.wire_dtype))
        except asyncio.CancelledError:
            raise
        except (PddError, OSError, TimeoutError) as exc:
            log.debug("abort frame for %s not sent: %s", request_id, exc)

    async def close(self) -> None:
        """Let pending ABORT frames out (each within its own timeout), then close every connection."""
        if self._abort_frames:
            await asyncio.gather(*self._abort_frames, return_exceptions=True)
        for pool in self._pools.values():
            for conn in pool:
                conn.close()
        self._pools.clear()


class LinkThroughput:
    """Moving average of achieved KV throughput per decoder address, from finished transfers."""

    MIN_SAMPLE_BYTES = 256 * 1024  # smaller transfers mostly measure socket buffers, not the link

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.bytes_per_s: dict[str, float] = {}

    def observe(self, peer: str, kv_bytes: int, seconds: float) -> None:
        if kv_bytes < self.MIN_SAMPLE_BYTES or seconds <= 0:
            return
        sample = kv_bytes / seconds
        old = self.bytes_per_s.get(peer)
        self.bytes_per_s[peer] = sample if old is None else old + self.alpha * (sample - old)


@dataclass(frozen=True)
class TransferResult:
    target: KVTarget
    state: TransferState
    kv_bytes: int
    send_s: float
    error: str | None


_END = object()


class OutgoingTransfer(_StateMachine):
    """Streams one request's KV chunks to one decoder; `put` waits while the queue is full."""

    def __init__(self, sender: KVSender, target: KVTarget, request_id: str, queue_chunks: int,
                 deadline_s: float) -> None:
        self.sender = sender
        self.target = target
        self.request_id = request_id
        self.deadline_s = deadline_s
        self.kv_bytes = 0
        self.error: str | None = None
        # 0: unbounded. P holds every chunk of the prompt anyway (for its prefix cache), so the
        # queue adds no memory; a bound would make the slowest path (the WAN) stall P's compute
        # and with it the fast path to RLD.
        # a held path is unbounded too: its queue fills while it waits, and P must not wait with it
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=0 if target.held else max(0, queue_chunks))
        self._released = asyncio.Event()  # a held path sends nothing before it is released
        if not target.held:
            self._released.set()
        self.background_bytes_per_s = 0.0  # > 0: in the background, paced at this rate (`background`)
        self.background_from_bytes = 0  # kv_bytes when it moved there
        sender.enter_foreground(self)
        self._started = time.monotonic()
        self._keepalive_frame = kv_wire.pack_control_frame(kv_wire.FrameKind.KEEPALIVE, request_id, sender.layout,
                                                           sender.wire_dtype)
        self._task = asyncio.create_task(self._pump(), name=f"kv-send-{request_id}-{target.role}")

    async def put(self, token_start: int, kv: torch.Tensor) -> None:
        """kv: [layers, 2, kv_heads, tokens, head_dim] for absolute tokens starting at token_start."""
        if not self.ended:
            await self._queue.put((token_start, kv, time.monotonic()))

    @property
    def held(self) -> bool:
        return not self._released.is_set()

    def release(self) -> None:
        """Let a held path send what it queued, and the rest as it comes. Idempotent."""
        self._released.set()

    def background(self, bytes_per_s: float) -> None:
        """Send the rest as background traffic: frames of BACKGROUND_FRAME_BYTES at most bytes_per_s,
        each only while no other transfer to this decoder is open; held, it is released so."""
        if self.ended or bytes_per_s <= 0:
            return
        self.background_bytes_per_s = bytes_per_s
        self.background_from_bytes = self.kv_bytes
        self.sender.leave_foreground(self)
        self._released.set()

    @property
    def background_bytes(self) -> int:
        """What it sent since it moved to the background."""
        return self.kv_bytes - self.background_from_bytes if self.background_bytes_per_s else 0

    async def finish(self) -> TransferResult:
        """Every chunk is queued: wait until the last one is written (or the transfer ended)."""
        if not self.ended:
            await self._queue.put((_END, None, time.monotonic()))
        await self.wait_closed()
        return TransferResult(self.target, self.state, self.kv_bytes, time.monotonic() - self._started, self.error)

    def abort(self, reason: str) -> None:
        """Stop sending; tell the decoder if the connection is healthy. Idempotent."""
        if self.ended:
            return
        self._move(TransferState.ABORTED)
        self.error = reason
        self.sender.leave_foreground(self)
        self._task.cancel()
        self.sender.send_abort_frame(self.request_id, self.target.host, self.target.port)

    async def wait_closed(self) -> None:
        """Until the pump has stopped (it ended, or an abort cancelled it)."""
        try:
            await self._task
        except asyncio.CancelledError:
            if not self._task.cancelled():
                raise

    async def _pump(self) -> None:
        host, port = self.target.host, self.target.port
        try:
            async with asyncio.timeout(self.deadline_s):
                conns = await self.sender.connections(host, port)
                with contextlib.ExitStack() as holding:
                    for conn in conns:
                        holding.enter_context(conn.held())
                    first_byte_at = await self._stream(conns)
            self._move(TransferState.DONE)
            if first_byte_at is not None and not self.background_bytes_per_s:  # a paced one is not the link's rate
                self.sender.throughput.observe(f"{host}:{port}", self.kv_bytes, time.monotonic() - first_byte_at)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            self.sender.drop(host, port)  # a stuck link: the next transfer redials
            self._fail(f"KV send to {self.target.role} not done within {self.deadline_s:.1f}s")
        except (PddError, OSError) as exc:
            self.sender.drop(host, port)
            self._fail(f"KV send to {self.target.role} failed: {exc}")
        finally:
            self.sender.leave_foreground(self)

    async def _stream(self, conns: list[KVConnection]) -> float | None:
        """Every queued chunk, as frames spread over `conns`, until the end mark; returns when the
        first KV byte left (None: there was none). While the queue is empty, a KEEPALIVE goes down
        every connection: the decoder then counts none of them idle while this transfer is open."""
        first_byte_at: float | None = None
        while True:
            try:
                async with asyncio.timeout(self.sender.keepalive_s):
                    token_start, item, queued_at = await self._queue.get()
            except TimeoutError:  # P's engine has not made the next chunk yet: say so
                await asyncio.gather(*(self._write(conn, self._keepalive_frame) for conn in conns))
                continue
            if self.target.delay_s > 0:  # each chunk leaves delay_s after P made it, like a long link
                await asyncio.sleep(max(0.0, queued_at + self.target.delay_s - time.monotonic()))
            if token_start is _END:
                return first_byte_at
            await self._wait_for_release(conns)
            if self.state is TransferState.WAITING:
                self._move(TransferState.TRANSFERRING)
                first_byte_at = time.monotonic()
            if self.background_bytes_per_s:
                await self._send_in_background(conns, token_start, item)
                continue
            frames = await asyncio.to_thread(self._frames, token_start, item)  # conversion and crc32 off the loop
            self.kv_bytes += sum(len(header) + len(payload) for header, payload in frames)
            await asyncio.gather(*(self._write_frames(conn, frames[i::len(conns)]) for i, conn in enumerate(conns)))

    async def _send_in_background(self, conns: list[KVConnection], token_start: int, kv: torch.Tensor) -> None:
        """A chunk as small frames, one at a time, each once no foreground transfer to the decoder is
        open, then a pause that keeps the average at background_bytes_per_s: a new transfer finds at
        most one small frame ahead of it (the link's buffers may hold more than P can see)."""
        host, port = self.target.host, self.target.port
        frames = await asyncio.to_thread(self._frames, token_start, kv, BACKGROUND_FRAME_BYTES)
        for i, frame in enumerate(frames):
            while not await self.sender.wait_quiet(host, port, self.sender.keepalive_s):
                await asyncio.gather(*(self._write(conn, self._keepalive_frame) for conn in conns))
            size = len(frame[0]) + len(frame[1])
            self.kv_bytes += size
            await self._write(conns[i % len(conns)], *frame)
            await asyncio.sleep(size / self.background_bytes_per_s)

    async def _wait_for_release(self, conns: list[KVConnection]) -> None:
        """While held, a KEEPALIVE every keepalive_s, as while waiting for P's next chunk."""
        while not self._released.is_set():
            try:
                async with asyncio.timeout(self.sender.keepalive_s):
                    await self._released.wait()
            except TimeoutError:
                await asyncio.gather(*(self._write(conn, self._keepalive_frame) for conn in conns))

    def _frames(self, token_start: int, kv: torch.Tensor,
                frame_bytes: int = MAX_FRAME_BYTES) -> list[tuple[bytes, memoryview]]:
        """Cut a chunk into frames of at most frame_bytes (or one token's KV), so they spread over
        connections and a stalled link is noticed within one small frame's time."""
        tokens = kv.shape[3]
        token_bytes = max(1, kv[:, :, :, :1].numel() * self.sender.wire_dtype.itemsize)
        step = max(1, min(tokens, frame_bytes // token_bytes))
        return [kv_wire.pack_data_frame(self.request_id, 0, token_start + offset,
                                        kv[:, :, :, offset:offset + step], self.sender.wire_dtype)
                for offset in range(0, tokens, step)]

    async def _write_frames(self, conn: KVConnection, frames: list[tuple[bytes, memoryview]]) -> None:
        for frame in frames:
            await self._write(conn, *frame)

    async def _write(self, conn: KVConnection, *parts: bytes | memoryview) -> None:
        try:
            await conn.write(*parts, stall_timeout_s=self.sender.stall_timeout_s)
        except TimeoutError as exc:
            raise PeerGone(f"KV link stalled: no byte left for {self.sender.stall_timeout_s:.1f}s") from exc

    def _fail(self, reason: str) -> None:
        if not self.ended:
            self.error = reason
            self._move(TransferState.FAILED)
        while not self._queue.empty():  # unblock a producer waiting in put()
            self._queue.get_nowait()
