"""One handshaken TCP connection from P to a decoder's KV port (`KVConnection`): frames written
whole, a write that fails only when the link stops moving, and when P retires it as idle.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import struct
import termios
import time
from collections.abc import Iterator

from shared.errors import PeerGone

_TIOCOUTQ = getattr(termios, "TIOCOUTQ", None)  # a socket's unsent + unacknowledged bytes (Linux)


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
