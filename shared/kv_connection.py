"""One handshaken TCP connection from P to a decoder's KV port (`KVConnection`): frames written
whole with `sendmsg` straight from their parts (the header and the KV tensor's own rows: no frame is
joined or copied in Python), a write that fails only when the link stops moving, and when P retires
it as idle. P owns the socket itself, not an asyncio transport: a transport copies what it cannot
send at once into its buffer, and Python 3.11's `writelines` joins its parts.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import struct
import termios
import time
from collections.abc import Iterator

from shared.errors import PeerGone

_TIOCOUTQ = getattr(termios, "TIOCOUTQ", None)  # a socket's unsent + unacknowledged bytes (Linux)
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)  # buffers per sendmsg

Part = bytes | bytearray | memoryview


class SocketStream:
    """The handshake's reader and writer over P's own non-blocking socket (`kv_handshake`'s
    MessageReader and MessageWriter): exact reads, so no frame-time byte is ever buffered here."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._out = bytearray()

    async def readexactly(self, n: int) -> bytes:
        data = bytearray(n)
        with memoryview(data) as view:
            got = 0
            while got < n:
                count = await self._loop.sock_recv_into(self.sock, view[got:])
                if not count:
                    raise asyncio.IncompleteReadError(bytes(view[:got]), n)
                got += count
        return bytes(data)

    def write(self, data: bytes) -> None:
        self._out += data

    async def drain(self) -> None:
        data, self._out = bytes(self._out), bytearray()
        await self._loop.sock_sendall(self.sock, data)


async def open_socket(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket (every address `host` resolves to, in order, like
    asyncio.open_connection), with Nagle off as asyncio's transports have it."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"{host}:{port} resolves to no address")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        if family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error


class KVConnection:
    """One handshaken TCP connection from P to a decoder's KV port; frames are written whole.

    A frame once begun is finished even if the transfer that wrote it is cancelled (an abort): the
    connection's other transfers share its byte stream, and half a frame would break it for them.
    """

    def __init__(self, sock: socket.socket, idle_timeout_s: float | None = None) -> None:
        self.sock = sock
        self.lock = asyncio.Lock()
        self.idle_timeout_s = idle_timeout_s  # the decoder closes it after this long without a frame
        self.last_write_at = time.monotonic()
        self.transfers = 0  # open transfers that hold it (each speaks at least every keepalive_s)
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._peer_closed = False
        self._peer_error: OSError | None = None  # how the decoder's side ended (a reset), when it did
        self._unsent = 0  # bytes of the frame being written that the kernel has not taken yet
        self._sending: asyncio.Task | None = None
        self._loop.add_reader(sock.fileno(), self._on_readable)  # a decoder only ever closes after its welcome

    @property
    def closed(self) -> bool:
        return self._closed or self._peer_closed

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

    async def write(self, *parts: Part, stall_timeout_s: float | None = None) -> None:
        """Write one frame whole. `stall_timeout_s` bounds the link's silence while it takes the
        frame (TimeoutError when no byte left for that long), not the frame's whole time on a slow
        link, nor its wait for the connection: frames of other requests ahead of it are a queue."""
        async with self.lock:
            if self._sending is not None:  # a cancelled writer's frame: it goes out first, whole
                await asyncio.shield(self._sending)
            if self._peer_error is not None:
                raise type(self._peer_error)(*self._peer_error.args)
            if self.closed:
                raise PeerGone("KV connection closed" + (" by the decoder" if self._peer_closed else ""))
            buffers = [view for part in parts if len(view := memoryview(part).cast("B"))]
            self._send_now(buffers)
            if not buffers:  # the kernel took it all at once, the common case on a fast link
                self.last_write_at = time.monotonic()
                return
            self._sending = self._loop.create_task(self._send(buffers, stall_timeout_s))
            self._sending.add_done_callback(self._sent)
            await asyncio.shield(self._sending)

    def _send_now(self, buffers: list[memoryview]) -> None:
        """What the kernel takes of `buffers` without waiting, dropped from their front."""
        while buffers:
            try:
                sent = self.sock.sendmsg(buffers[:_IOV_MAX])
            except (BlockingIOError, InterruptedError):
                return
            _consume(buffers, sent)

    def _sent(self, task: asyncio.Task) -> None:
        if self._sending is task:
            self._sending = None
        self.last_write_at = time.monotonic()
        if task.cancelled() or task.exception() is not None:  # the stream is cut inside a frame
            self.close()

    async def _send(self, buffers: list[memoryview], stall_timeout_s: float | None) -> None:
        self._unsent = sum(len(view) for view in buffers)
        owed, moved_at = self.bytes_owed(), time.monotonic()
        try:
            while buffers:
                self._send_now(buffers)
                if (unsent := sum(len(view) for view in buffers)) < self._unsent:
                    self._unsent = unsent
                    moved_at = time.monotonic()
                    continue
                if stall_timeout_s is not None:
                    if (now_owed := self.bytes_owed()) < owed:
                        moved_at = time.monotonic()
                    owed = now_owed
                    left_s = moved_at + stall_timeout_s - time.monotonic()
                    if left_s <= 0:
                        raise TimeoutError(f"no KV byte left in {stall_timeout_s:.1f}s")
                    await self._writable(min(stall_timeout_s / 4, left_s))
                else:
                    await self._writable(None)
        finally:
            self._unsent = 0

    async def _writable(self, timeout_s: float | None) -> None:
        """Until the socket takes more bytes, or timeout_s passes."""
        ready = self._loop.create_future()
        fd = self.sock.fileno()
        self._loop.add_writer(fd, _settle, ready)
        try:
            async with asyncio.timeout(timeout_s):
                await ready
        except TimeoutError:
            pass
        finally:
            self._loop.remove_writer(fd)

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # a reset: said as such to the next writer
            self._peer_error, data = exc, b""
        if not data:  # the decoder closed (its idle deadline, its shutdown) or reset it
            self._peer_closed = True
            self._loop.remove_reader(self.sock.fileno())

    def bytes_owed(self) -> int:
        """Bytes written but not yet taken by the peer: what the kernel has not taken of the frame
        being written, plus the kernel's send queue where the OS tells it (Linux: unsent and
        unacknowledged), so progress shows as the peer acknowledges, not only when the kernel's
        (possibly megabytes of) buffer frees up."""
        owed = self._unsent
        if _TIOCOUTQ is not None and not self._closed:
            try:
                owed += struct.unpack("i", fcntl.ioctl(self.sock.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[0]
            except OSError:
                pass
        return owed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sending is not None:
            self._sending.cancel()
        if not self._peer_closed:
            self._loop.remove_reader(self.sock.fileno())
        self._loop.remove_writer(self.sock.fileno())
        self.sock.close()


def _consume(buffers: list[memoryview], sent: int) -> None:
    """Drop the first `sent` bytes from the front of `buffers`, in place."""
    while sent:
        head = buffers[0]
        if sent < len(head):
            buffers[0] = head[sent:]
            return
        sent -= len(head)
        del buffers[0]


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
