"""One authenticated KV connection's frames, read by the event loop (`FrameReader`).

An asyncio BufferedProtocol: the loop's `recv_into` writes each header into a 48-byte buffer and
each DATA payload into one pre-allocated buffer of the connection's (a frame at most, reused), as
much as the socket holds per call; once a payload is in, its CRC32C is taken in one call and its
rows are copied into their places in the request's KV by numpy (`KVInbox.write`, one thread). No
bytes object or join stands between the socket and the tensor, and nothing is parsed per chunk of
bytes, only per frame. (Reading each 64 KiB row straight into place cost more: one turn of the
loop per row, against one copy from a buffer still in cache.) Frames nobody expects go into a
small scratch buffer and are dropped. It also keeps the connection's deadlines: an idle one is
closed, and inside a frame each read window must bring its share of bytes.
"""
from __future__ import annotations

import asyncio
import enum
import time
from typing import TYPE_CHECKING

import crc32c
import torch

from shared import kv_wire
from shared.errors import DeadlineExceeded, ProtocolError
from shared.kv_inbox import InboundLink, KVInbox

if TYPE_CHECKING:
    from shared.kv_receiver import KVReceiver

SCRATCH_BYTES = 256 * 1024  # what a dropped frame is read through, at most this much at a time


class _Phase(enum.Enum):
    HEADER = "header"
    PAYLOAD = "payload"  # a claimed frame's, into the connection's payload buffer
    DROP = "drop"  # a payload nobody wants, through the scratch buffer


class FrameReader(asyncio.BufferedProtocol):
    """Reads one connection's frames into the receiver's inboxes; `closed` ends with why it closed
    (IncompleteReadError at the peer's EOF, DeadlineExceeded, ProtocolError, ConnectionError)."""

    def __init__(self, receiver: KVReceiver, link: InboundLink, transport: asyncio.BaseTransport) -> None:
        self.receiver = receiver
        self.link = link
        self.transport = transport
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closed.add_done_callback(_retrieve)  # a connection lost before its handler awaits it
        self._loop = asyncio.get_running_loop()
        self._limits = receiver.limits
        self._header = bytearray(kv_wire.FRAME_HEADER.size)
        self._header_view = memoryview(self._header)
        self._got = 0  # of the header, in HEADER
        self._phase = _Phase.HEADER
        self._frame: kv_wire.FrameHeader | None = None
        self._inbox: KVInbox | None = None
        self._payload = memoryview(b"")  # the claimed frame's payload, in _staging
        self._payload_got = 0
        self._payload_left = 0
        self._payload_started_at = 0.0
        self._staging: bytearray | None = None  # the payload being read (max_payload bytes, made once)
        self._scratch: memoryview | None = None
        self._error: BaseException | None = None
        self._idle_from = self._loop.time()
        self._window_end = 0.0
        self._window_got = self._window_due = 0
        self._timer: asyncio.TimerHandle | None = None
        self._arm()

    # --- asyncio's calls -------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._phase is _Phase.PAYLOAD:
            assert self._inbox is not None
            if not self._inbox.ended:
                return self._payload[self._payload_got:]
            # released or failed meanwhile: the rest is dropped, and nothing is copied into its
            # memory, which may be another request's by now
            self.receiver.frames_dropped += 1
            self._phase = _Phase.DROP
        if self._phase is _Phase.DROP:
            if self._scratch is None:
                self._scratch = memoryview(bytearray(SCRATCH_BYTES))
            return self._scratch[:min(self._payload_left, SCRATCH_BYTES)]
        return self._header_view[self._got:]

    def buffer_updated(self, nbytes: int) -> None:
        self.link.saw_bytes(nbytes)
        if self._phase is _Phase.HEADER and not self._got:  # a frame begins: its read deadline starts
            self._start_window(kv_wire.FRAME_HEADER.size)
            self._arm()
        self._window_got += nbytes
        try:
            if self._phase is _Phase.HEADER:
                self._got += nbytes
                if self._got == kv_wire.FRAME_HEADER.size:
                    self._on_header()
                return
            self._payload_left -= nbytes
            self._payload_got += nbytes
            if not self._payload_left:
                if self._phase is _Phase.PAYLOAD:
                    self._on_payload()
                self._next_frame()
        except (ProtocolError, DeadlineExceeded) as exc:
            self._close(exc)

    def eof_received(self) -> bool | None:
        return None  # the transport closes; connection_lost says so

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self.closed.done():
            self.closed.set_exception(self._error or exc or asyncio.IncompleteReadError(b"", None))

    # --- frames ----------------------------------------------------------------------------------

    def _on_header(self) -> None:
        receiver = self.receiver
        header = kv_wire.unpack_header(bytes(self._header), max_payload=receiver.max_payload)
        if header.kind is kv_wire.FrameKind.DATA and (header.kv_heads, header.head_dim) != (
                receiver.layout.kv_heads, receiver.layout.head_dim):
            raise ProtocolError(f"frame of {header.kv_heads} KV heads of {header.head_dim}, this decoder has "
                                f"{receiver.layout.kv_heads} of {receiver.layout.head_dim}")
        inbox = receiver.inboxes.get(header.request_id)
        if inbox is not None and not inbox.ended:
            inbox.heard_on(self.link)
        else:
            inbox = None
        if header.kind is kv_wire.FrameKind.KEEPALIVE:
            if inbox is not None:
                inbox.keepalive()
        elif inbox is None:
            receiver.frames_dropped += 1
        elif header.kind is kv_wire.FrameKind.ABORT:
            inbox.abort("sender aborted")
        elif inbox.claim(header):
            self._frame, self._inbox = header, inbox
            if self._staging is None or len(self._staging) < header.payload_len:
                self._staging = bytearray(receiver.max_payload)
            self._payload, self._payload_got = memoryview(self._staging)[:header.payload_len], 0
            self._phase = _Phase.PAYLOAD
            self._payload_started_at = time.monotonic()
        if header.payload_len and self._phase is _Phase.HEADER:  # not wanted: read through and dropped
            self._phase = _Phase.DROP
        self._payload_left = header.payload_len
        if self._payload_left:
            self._start_window(self._payload_left)
        else:
            self._next_frame()

    def _on_payload(self) -> None:
        header, inbox = self._frame, self._inbox
        assert header is not None and inbox is not None
        inbox.payload_read(self._payload_started_at, time.monotonic())
        if crc32c.crc32c(self._payload) != header.crc32:
            error = ProtocolError(f"checksum mismatch in frame for {header.request_id}")
            inbox.fail(error)
            raise error
        assert self._staging is not None
        if header.dtype == inbox.kv.dtype:
            inbox.write(header, self._payload)
        else:
            count = header.payload_len // header.dtype.itemsize
            inbox.place(header, torch.frombuffer(self._staging, dtype=header.dtype, count=count))

    def _next_frame(self) -> None:
        self._phase, self._got = _Phase.HEADER, 0
        self._frame = self._inbox = None
        self._payload = memoryview(b"")
        self._idle_from = self._loop.time()

    # --- deadlines -------------------------------------------------------------------------------

    def _start_window(self, length: int) -> None:
        """A read window inside a frame: by its end, read_min_bytes (or the `length` left) must come."""
        self._window_end = self._loop.time() + self._limits.read_window_s
        self._window_got, self._window_due = 0, min(self._limits.read_min_bytes, length)

    def _between_frames(self) -> bool:
        return self._phase is _Phase.HEADER and not self._got

    def _deadline(self) -> float | None:
        if self._between_frames():
            return self._idle_from + self._limits.idle_timeout_s if self._limits.idle_timeout_s else None
        return self._window_end if self._limits.read_window_s > 0 else None

    def _arm(self) -> None:
        """A check at the nearest deadline (a later one is checked when that check runs)."""
        at = self._deadline()
        if at is None or (self._timer is not None and self._timer.when() <= at):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(at, self._check)

    def _check(self) -> None:
        self._timer = None
        if self.closed.done():
            return
        now, limits = self._loop.time(), self._limits
        if self._between_frames():
            if limits.idle_timeout_s and now >= self._idle_from + limits.idle_timeout_s:
                if not self.link.carries_open_transfer:
                    self.receiver.idle_closes += 1
                    self._close(DeadlineExceeded(f"no frame for {limits.idle_timeout_s:g}s"))
                    return
                self._idle_from = now  # an open transfer's own stall deadline judges its silence
        elif limits.read_window_s > 0 and now >= self._window_end:
            if self._window_got < self._window_due:
                self.receiver.slow_closes += 1
                self._close(DeadlineExceeded(f"{self._window_got} bytes of a frame in {limits.read_window_s:g}s, "
                                             f"under the {self._window_due} the read deadline asks"))
                return
            left = kv_wire.FRAME_HEADER.size - self._got if self._phase is _Phase.HEADER else self._payload_left
            self._start_window(left)
        self._arm()

    def _close(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self.transport.close()


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()
