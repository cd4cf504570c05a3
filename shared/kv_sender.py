"""P's sending side of the KV transfer: `KVSender`, the pool of handshaken connections to each
decoder, and `OutgoingTransfer`, which streams one request's chunks to one decoder through a queue.

While a transfer has nothing to send (its chunks still wait for P's engine) it writes a KEEPALIVE
every `keepalive_s`, so the receiver's stall deadline measures the link and P's liveness, never P's
queue; a held path (`KVTarget.held`) writes only KEEPALIVEs, its chunks queued, until P releases it.
A transfer moved to the background (`OutgoingTransfer.background`: RLD finished the request, MD only
keeps its KV for the session's next turn) writes small frames at a set pace, and only while no other
transfer to that decoder is open. P retires a connection before the decoder's idle deadline could
close it (`KVConnection.reusable`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import torch

from shared import kv_handshake, kv_wire
from shared.errors import KVUnreachable, PddError, PeerGone
from shared.kv_connection import KVConnection, SocketStream, open_socket
from shared.kv_transfer_state import TransferMachine, TransferState
from shared.messages import KVTarget
from shared.models import KVLayout

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = kv_wire.FRAME_PAYLOAD_BYTES
BACKGROUND_FRAME_BYTES = 128 * 1024  # a background frame: what a new transfer may find ahead of it on the link
KEEPALIVE_MAX_S = 1.0  # an idle transfer speaks at least this often, whatever the stall timeout
ABORT_FRAME_TIMEOUT_S = 1.0
TRANSFER_FAILED = "kv_transfer_failed"  # a path that broke once connected (KVUnreachable.code: never connected)


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
        sock = None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                sock = await open_socket(host, port)
                stream = SocketStream(sock)
                idle_s = await kv_handshake.greet_receiver(stream, stream, self.layout, self.wire_dtype, self.secret,
                                                           f"{host}:{port}")
        except BaseException as exc:
            if sock is not None:
                sock.close()
            if isinstance(exc, TimeoutError):
                raise KVUnreachable(f"KV connect to {host}:{port} took over {self.connect_timeout_s}s") from exc
            if isinstance(exc, (OSError, asyncio.IncompleteReadError)):
                raise KVUnreachable(f"KV connect to {host}:{port} failed: {exc}") from exc
            raise
        return KVConnection(sock, idle_s)

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
    code: str = ""  # not done: RequestFailed's code, KVUnreachable.code when P never got a connection


_END = object()
Frame = tuple[bytes, list[memoryview]]  # a DATA frame's header and its payload's rows


def _payload_bytes(rows: list[memoryview]) -> int:
    return sum(len(row) for row in rows)


class OutgoingTransfer(TransferMachine):
    """Streams one request's KV chunks to one decoder; `put` waits while the queue is full."""

    def __init__(self, sender: KVSender, target: KVTarget, request_id: str, queue_chunks: int,
                 deadline_s: float) -> None:
        self.sender = sender
        self.target = target
        self.request_id = request_id
        self.deadline_s = deadline_s
        self.kv_bytes = 0
        self.error: str | None = None
        self.error_code = ""  # why it failed, as RequestFailed's code
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
        code = "" if self.state is TransferState.DONE else self.error_code or TRANSFER_FAILED  # aborted: as failed
        send_s = time.monotonic() - self._started
        return TransferResult(self.target, self.state, self.kv_bytes, send_s, self.error, code)

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
            self._fail(f"KV send to {self.target.role} not done within {self.deadline_s:.1f}s", TRANSFER_FAILED)
        except (PddError, OSError) as exc:
            self.sender.drop(host, port)
            self._fail(f"KV send to {self.target.role} failed: {exc}",
                       exc.code if isinstance(exc, KVUnreachable) else TRANSFER_FAILED)
        finally:
            self.sender.leave_foreground(self)

    async def _stream(self, conns: list[KVConnection]) -> float | None:
        """Every queued chunk, as frames spread over `conns`, until the end mark; returns when the
        first KV byte left (None: there was none). A chunk's frames start while the previous chunk's
        last ones are still being written (two chunks in flight at most), so no connection idles at
        a chunk's boundary. While the queue is empty and nothing is in flight, a KEEPALIVE goes down
        every connection: the decoder then counts none of them idle while this transfer is open."""
        first_byte_at: float | None = None
        in_flight: asyncio.Task | None = None  # the previous chunk's frames, still being written
        try:
            while True:
                if in_flight is not None and in_flight.done():
                    done, in_flight = in_flight, None
                    done.result()  # its failure is the transfer's
                try:
                    async with asyncio.timeout(self.sender.keepalive_s):
                        token_start, item, queued_at = await self._queue.get()
                except TimeoutError:  # P's engine has not made the next chunk yet: say so
                    if in_flight is None:
                        await asyncio.gather(*(self._write(conn, self._keepalive_frame) for conn in conns))
                    continue
                if self.target.delay_s > 0:  # each chunk leaves delay_s after P made it, like a long link
                    await asyncio.sleep(max(0.0, queued_at + self.target.delay_s - time.monotonic()))
                if token_start is _END or self.background_bytes_per_s:
                    if in_flight is not None:
                        done, in_flight = in_flight, None
                        await done
                if token_start is _END:
                    return first_byte_at
                await self._wait_for_release(conns)
                if self.state is TransferState.WAITING:
                    self._move(TransferState.TRANSFERRING)
                    first_byte_at = time.monotonic()
                if self.background_bytes_per_s:
                    await self._send_in_background(conns, token_start, item)
                    continue
                chunk = asyncio.create_task(self._stripe(conns, token_start, item))
                if in_flight is not None:
                    done, in_flight = in_flight, None
                    try:
                        await done
                    except BaseException:
                        chunk.cancel()
                        raise
                in_flight = chunk
        finally:
            if in_flight is not None and not in_flight.done():
                in_flight.cancel()
            elif in_flight is not None and not in_flight.cancelled():
                in_flight.exception()  # retrieved: the transfer already ends for another reason

    async def _stripe(self, conns: list[KVConnection], token_start: int, kv: torch.Tensor) -> None:
        """Write a chunk's frames over all connections: each takes the next frame as soon as it has
        written its last, so a slower connection carries fewer (the receiver places frames by their
        layer and token range, whatever the order). A frame is packed (its rows' CRC32C) on the loop
        just before its write, so the kernel copies rows the checksum has just brought into cache;
        handing the checksums to worker threads cost P more CPU per byte than the checksums
        themselves (0.40-0.44 against 0.31 s/GB on 2 cores, docs/wan.md)."""
        if not self._in_place(kv):
            kv = await asyncio.to_thread(self._wire_copy, kv)
        cuts = iter(self._cuts(token_start, kv, MAX_FRAME_BYTES))

        async def carry(conn: KVConnection) -> None:
            for layer, start, part in cuts:
                header, rows = kv_wire.pack_data_frame(self.request_id, layer, start, part, self.sender.wire_dtype)
                self.kv_bytes += len(header) + _payload_bytes(rows)
                await self._write(conn, header, *rows)

        await asyncio.gather(*(carry(conn) for conn in conns))

    async def _send_in_background(self, conns: list[KVConnection], token_start: int, kv: torch.Tensor) -> None:
        """A chunk as small frames, one at a time, each once no foreground transfer to the decoder is
        open, then a pause that keeps the average at background_bytes_per_s: a new transfer finds at
        most one small frame ahead of it (the link's buffers may hold more than P can see)."""
        host, port = self.target.host, self.target.port
        frames = await asyncio.to_thread(self._frames, token_start, kv, BACKGROUND_FRAME_BYTES)
        for i, (header, rows) in enumerate(frames):
            while not await self.sender.wait_quiet(host, port, self.sender.keepalive_s):
                await asyncio.gather(*(self._write(conn, self._keepalive_frame) for conn in conns))
            size = len(header) + _payload_bytes(rows)
            self.kv_bytes += size
            await self._write(conns[i % len(conns)], header, *rows)
            await asyncio.sleep(size / self.background_bytes_per_s)

    async def _wait_for_release(self, conns: list[KVConnection]) -> None:
        """While held, a KEEPALIVE every keepalive_s, as while waiting for P's next chunk."""
        while not self._released.is_set():
            try:
                async with asyncio.timeout(self.sender.keepalive_s):
                    await self._released.wait()
            except TimeoutError:
                await asyncio.gather(*(self._write(conn, self._keepalive_frame) for conn in conns))

    def _in_place(self, kv: torch.Tensor) -> bool:
        """Whether kv's own memory can go on the wire: on the CPU, in the wire dtype, rows contiguous."""
        return kv.dtype == self.sender.wire_dtype and kv_wire.rows_in_place(kv)

    def _wire_copy(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.to(device="cpu", dtype=self.sender.wire_dtype).contiguous()

    @staticmethod
    def _cuts(token_start: int, kv: torch.Tensor, frame_bytes: int) -> list[tuple[int, int, torch.Tensor]]:
        """Where a chunk's frames fall, as (layer start, token start, view): at most frame_bytes each,
        so they spread over connections and a stalled link is noticed within one small frame's time.
        Whole layers of the chunk's tokens where one layer fits (each row then runs the chunk's
        length), else one layer cut between tokens."""
        layers, _, kv_heads, tokens, head_dim = kv.shape
        token_bytes = max(1, 2 * kv_heads * head_dim * kv.dtype.itemsize)  # one token of one layer
        if tokens * token_bytes <= frame_bytes:
            step = max(1, frame_bytes // (tokens * token_bytes))
            return [(layer, token_start, kv[layer:layer + step]) for layer in range(0, layers, step)]
        step = max(1, frame_bytes // token_bytes)
        return [(layer, token_start + offset, kv[layer:layer + 1, :, :, offset:offset + step])
                for layer in range(layers) for offset in range(0, tokens, step)]

    def _frames(self, token_start: int, kv: torch.Tensor, frame_bytes: int) -> list[Frame]:
        """A chunk's frames, packed here and now (the background path's, on a worker thread)."""
        if not self._in_place(kv):
            kv = self._wire_copy(kv)
        return [kv_wire.pack_data_frame(self.request_id, layer, start, part, self.sender.wire_dtype)
                for layer, start, part in self._cuts(token_start, kv, frame_bytes)]

    async def _write(self, conn: KVConnection, *parts: bytes | memoryview) -> None:
        try:
            await conn.write(*parts, stall_timeout_s=self.sender.stall_timeout_s)
        except TimeoutError as exc:
            raise PeerGone(f"KV link stalled: no byte left for {self.sender.stall_timeout_s:.1f}s") from exc

    def _fail(self, reason: str, code: str) -> None:
        if not self.ended:
            self.error = reason
            self.error_code = code
            self._move(TransferState.FAILED)
        while not self._queue.empty():  # unblock a producer waiting in put()
            self._queue.get_nowait()
