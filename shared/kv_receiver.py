"""The decoder's KV port (`KVReceiver`): it handshakes senders, then hands each connection to a
`FrameReader` (`shared.kv_reader`) that reads its frames straight into the `KVInbox` of each
request it expects; frames for a request it does not expect (late, duplicate, aborted) are read
and dropped as they stream in.

The port faces strangers (`KVLimits`): it caps connections per peer address and in total, holds
frames to a sane size, and closes a connection that idles without an open transfer or trickles a
frame. A connection counts against those caps only once it has authenticated: until then it lives
in a budget of its own (`max_handshakes`, the oldest dropped for a newer one) with a short deadline,
so strangers flooding the port from P's own address never take a slot P needs.
"""
from __future__ import annotations

import asyncio
import logging

import torch

from shared import kv_handshake, kv_wire
from shared.config import KVLimits
from shared.errors import DeadlineExceeded, IncompatiblePeer, ProtocolError
from shared.kv_inbox import BUFFER_POOL_BYTES, InboundLink, KVBuffers, KVInbox
from shared.kv_reader import FrameReader
from shared.models import KVLayout

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 3.0  # a sender answers within a round trip (its hello may queue behind KV on a slow WAN)
MAX_HANDSHAKES = 1024  # unauthenticated connections at once, from anyone (each costs a socket, no buffer)


class KVReceiver:
    """The decoder's KV port: handshakes senders and routes frames into inboxes.

    Nothing a peer sends makes it hold more than one frame of at most `max_payload` bytes per
    connection, and that only for a request it expects; `limits` bounds connections and time.
    """

    def __init__(self, layout: KVLayout, dtype: torch.dtype, secret: bytes | None = None,
                 limits: KVLimits = KVLimits(), *, max_handshakes: int = MAX_HANDSHAKES,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, buffer_pool_bytes: int = BUFFER_POOL_BYTES) -> None:
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
        self.buffers = KVBuffers(buffer_pool_bytes)  # inboxes' memory, reused once released
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
        layout = self.layout
        nbytes = layout.num_layers * 2 * layout.kv_heads * (token_end - token_start) * layout.head_dim
        buffer = self.buffers.take(nbytes * self.dtype.itemsize)
        inbox = KVInbox(request_id, self.layout, token_start, token_end, self.dtype, buffer)
        self.inboxes[request_id] = inbox
        return inbox

    def release(self, request_id: str, reason: str = "released") -> None:
        """Drop a request's inbox; its memory goes back to the pool, so the caller must hold no view
        of its KV any more (the decoder has copied it into its engine, or gave up on it)."""
        inbox = self.inboxes.pop(request_id, None)
        if inbox is not None:
            inbox.abort(reason)
            self.buffers.give(inbox.buffer)

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
            if (frames := await self._admit(reader, writer, address, peer)) is not None:
                await frames.closed
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

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str,
                     peer: object) -> FrameReader | None:
        """Authenticate the peer, then count it against the caps: None when it was refused for them
        (told so, `busy`) or dropped from the handshake budget meanwhile. Admitted, its frames are
        read by a FrameReader from before the WELCOME leaves (P sends none before it has the WELCOME)."""
        async with asyncio.timeout(self.handshake_timeout_s):
            sender_nonce = await kv_handshake.check_sender(reader, writer, self.layout, self.secret)
            if writer not in self._handshaking:  # evicted while its hello was already in the buffer
                return None
            del self._handshaking[writer]
            if (reason := self._over_cap(address)) is not None:
                self.refused_connections += 1
                log.warning("KV peer %s refused: %s", address, reason)
                kv_handshake.refuse(writer, reason, busy=True)
                await writer.drain()
                return None
            self._writers.add(writer)
            self._per_peer[address] = self._per_peer.get(address, 0) + 1
            link = InboundLink(f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer))
            frames = FrameReader(self, link, writer.transport)
            writer.transport.set_protocol(frames)
            if isinstance(writer.transport, asyncio.ReadTransport):
                writer.transport.resume_reading()  # in case the stream had paused it
            await kv_handshake.welcome(writer, self.layout, self.secret, sender_nonce, self.limits.idle_timeout_s)
        return frames
