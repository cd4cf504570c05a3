"""The decoder's KV port (`KVReceiver`): it handshakes senders and routes their frames into the
`KVInbox` of each request it expects; frames for a request it does not expect (late, duplicate,
aborted) are read and dropped as they stream in.

The port faces strangers (`KVLimits`): it caps connections per peer address and in total, holds
frames to a sane size, and closes a connection that idles without an open transfer or trickles a
frame. A connection counts against those caps only once it has authenticated: until then it lives
in a budget of its own (`max_handshakes`, the oldest dropped for a newer one) with a short deadline,
so strangers flooding the port from P's own address never take a slot P needs.
"""
from __future__ import annotations

import asyncio
import logging
import time

import torch

from shared import kv_handshake, kv_wire
from shared.config import KVLimits
from shared.errors import DeadlineExceeded, IncompatiblePeer, ProtocolError
from shared.kv_inbox import InboundLink, KVInbox
from shared.models import KVLayout

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 3.0  # a sender answers within a round trip (its hello may queue behind KV on a slow WAN)
MAX_HANDSHAKES = 1024  # unauthenticated connections at once, from anyone (each costs a socket, no buffer)
PROGRESS_READ_BYTES = 256 * 1024  # the most a receiver reads at once inside one frame


class KVReceiver:
    """The decoder's KV port: handshakes senders and routes frames into inboxes.

    Nothing a peer sends makes it hold more than one frame of at most `max_payload` bytes per
    connection, and that only for a request it expects; `limits` bounds connections and time.
    """

    def __init__(self, layout: KVLayout, dtype: torch.dtype, secret: bytes | None = None,
                 limits: KVLimits = KVLimits(), *, max_handshakes: int = MAX_HANDSHAKES,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.layout = layout
        self.dtype = dtype
        self.secret = secret
        self.limits = limits
        self.max_payload = kv_wire.max_payload_bytes(layout)
        self.max_handshakes = max(1, max_handshakes)
        self.handshake_timeout_s = handshake_timeout_s
        self.refused_connections = 0  # failed or never finished the handshake, or over a connection cap
        self.handshake_evictions = 0  # of those, closed unauthenticated to make room for a newer connection
        self.idle_closes = 0
        self.slow_closes = 0  # a frame trickled in slower than the read deadline allows
        self.inboxes: dict[str, KVInbox] = {}
        self.frames_dropped = 0
        self._server: asyncio.Server | None = None
        self._handshaking: dict[asyncio.StreamWriter, None] = {}  # not authenticated yet, oldest first
        self._writers: set[asyncio.StreamWriter] = set()  # authenticated: what the caps count
        self._per_peer: dict[str, int] = {}  # peer address -> authenticated connections
        self._handlers: set[asyncio.Task] = set()

    @property
    def open_connections(self) -> int:
        """Authenticated connections (those still handshaking are `handshaking_connections`)."""
        return len(self._writers)

    @property
    def handshaking_connections(self) -> int:
        return len(self._handshaking)

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
        for writer in [*self._handshaking, *self._writers]:
            writer.close()
        if self._handlers:  # closed sockets end the handlers; let them finish rather than be cancelled
            await asyncio.wait(self._handlers, timeout=2.0)
        for inbox in list(self.inboxes.values()):
            inbox.abort("decoder shutting down")
        self.inboxes.clear()

    def _over_cap(self, address: str) -> str | None:
        """Why one more authenticated connection from `address` is refused, or None."""
        if len(self._writers) >= self.limits.max_connections:
            return f"{len(self._writers)} KV connections open, the most this decoder takes"
        if self._per_peer.get(address, 0) >= self.limits.max_connections_per_peer:
            return f"{self._per_peer[address]} KV connections open from {address}, the most it takes from one peer"
        return None

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) else str(peer)
        handler = asyncio.current_task()
        assert handler is not None  # asyncio.start_server runs each connection's callback as a task
        self._handlers.add(handler)
        self._make_room_to_handshake()
        self._handshaking[writer] = None
        try:
            if await self._admit(reader, writer, address):
                link = InboundLink(f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer))
                while True:
                    await self._read_frame(reader, link)
        except asyncio.IncompleteReadError:
            log.debug("KV peer %s closed", peer)
        except DeadlineExceeded as exc:
            log.info("KV peer %s closed: %s", peer, exc)
        except TimeoutError:  # strangers flooding the port end here: not worth a line each
            self.refused_connections += 1
            log.debug("KV peer %s closed: no handshake within %.1fs", peer, self.handshake_timeout_s)
        except (ProtocolError, IncompatiblePeer) as exc:
            self.refused_connections += 1
            log.warning("KV peer %s refused: %s", peer, exc)
        except ConnectionError as exc:
            log.info("KV peer %s connection lost: %s", peer, exc)
        finally:
            self._handshaking.pop(writer, None)
            if writer in self._writers:
                self._writers.discard(writer)
                self._per_peer[address] -= 1
                if not self._per_peer[address]:
                    del self._per_peer[address]
            self._handlers.discard(handler)
            writer.close()

    def _make_room_to_handshake(self) -> None:
        """While the unauthenticated budget is full, close its oldest connection: a flood of strangers
        churns through its own budget, and a sender that answers the challenge at once gets through."""
        while len(self._handshaking) >= self.max_handshakes:
            oldest = next(iter(self._handshaking))
            del self._handshaking[oldest]
            oldest.close()
            self.handshake_evictions += 1
            self.refused_connections += 1

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str) -> bool:
        """Authenticate the peer, then count it against the caps: False when it was refused for them
        (told so, `busy`) or dropped from the handshake budget meanwhile."""
        async with asyncio.timeout(self.handshake_timeout_s):
            sender_nonce = await kv_handshake.check_sender(reader, writer, self.layout, self.secret)
            if writer not in self._handshaking:  # evicted while its hello was already in the buffer
                return False
            del self._handshaking[writer]
            if (reason := self._over_cap(address)) is not None:
                self.refused_connections += 1
                log.warning("KV peer %s refused: %s", address, reason)
                kv_handshake.refuse(writer, reason, busy=True)
                await writer.drain()
                return False
            self._writers.add(writer)
            self._per_peer[address] = self._per_peer.get(address, 0) + 1
            await kv_handshake.welcome(writer, self.layout, self.secret, sender_nonce, self.limits.idle_timeout_s)
        return True

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
