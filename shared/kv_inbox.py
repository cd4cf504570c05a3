"""One request's KV arriving at a decoder (`KVInbox`), and the connections it arrives on (`InboundLink`).

Progress is counted per connection: bytes arriving on a connection move every request it carries,
so a request whose frames queue behind other requests' frames on a busy link waits, it does not
stall. Knows nothing of sockets: `shared.kv_reader` reads each frame's payload and hands it in.
`KVBuffers` keeps freed destinations for the next inbox, whose pages are then already mapped.
"""
from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import torch

from shared import kv_wire
from shared.errors import DeadlineExceeded, PddError, ProtocolError, RequestAborted
from shared.kv_transfer_state import TransferMachine, TransferState
from shared.models import KVLayout

LINK_SAMPLE_MIN_BYTES = 1024 * 1024  # a smaller transfer can arrive from buffers faster than the link
BUFFER_POOL_BYTES = 4 * 1024 ** 3  # the most free destination memory a receiver keeps for the next inboxes
SERIAL_COPY_ELEMENTS = 32 * 1024 - 1  # under torch's grain size: a copy this small runs on the calling thread


class KVBuffers:
    """Destination memory for inboxes, reused. A fresh allocation's pages are zeroed by the kernel as
    the KV first lands in them (a fifth of a receiver's CPU per byte); a reused buffer's are mapped
    already. Keeps free buffers, the newest, up to what its inboxes have held at once (a decoder
    that only ever receives one prompt at a time keeps about one prompt's worth, whatever sizes came
    before), and never more than `capacity_bytes`."""

    def __init__(self, capacity_bytes: int = BUFFER_POOL_BYTES) -> None:
        self.capacity_bytes = capacity_bytes
        self.in_use_bytes = 0  # taken and not given back
        self.peak_in_use_bytes = 0
        self._free: list[torch.Tensor] = []  # flat uint8, oldest first

    @property
    def free_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._free)

    @property
    def keep_bytes(self) -> int:
        """The most free memory it keeps now."""
        return min(self.capacity_bytes, self.peak_in_use_bytes)

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of at least nbytes, and at most twice that (a big one is kept for a big request)."""
        fits = [i for i, buffer in enumerate(self._free) if nbytes <= buffer.numel() <= 2 * nbytes]
        if fits:
            buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))  # by index: == compares tensors
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.in_use_bytes += buffer.numel()
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """Keep a buffer `take` gave out and nothing uses any more."""
        self.in_use_bytes = max(0, self.in_use_bytes - buffer.numel())
        if not buffer.numel() or buffer.numel() > self.keep_bytes:
            return
        self._free.append(buffer)
        while self.free_bytes > self.keep_bytes:
            del self._free[0]


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


class KVInbox(TransferMachine):
    """One request's KV arriving at a decoder: tokens [token_start, token_end) of every layer."""

    def __init__(self, request_id: str, layout: KVLayout, token_start: int, token_end: int,
                 dtype: torch.dtype, buffer: torch.Tensor | None = None) -> None:
        self.request_id = request_id
        self.token_start = token_start
        self.token_end = token_end
        self.layout = layout
        tokens = token_end - token_start
        shape = (layout.num_layers, 2, layout.kv_heads, tokens, layout.head_dim)
        nbytes = math.prod(shape) * dtype.itemsize
        # buffer: flat uint8 memory of at least nbytes to write into (KVBuffers'), else a fresh one
        self.buffer = buffer if buffer is not None else torch.empty(nbytes, dtype=torch.uint8)
        self.kv = self.buffer[:nbytes].view(dtype).view(shape)
        self._row_bytes = self.buffer[:nbytes].numpy().reshape(*shape[:4], layout.head_dim * dtype.itemsize)
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

    def claim(self, header: kv_wire.FrameHeader) -> bool:
        """Whether a DATA frame's payload is wanted, decided from its header before the payload is
        read: not once the transfer ended, nor for a duplicate (same layer and token range: a second
        copy changes nothing); a frame outside the expected range fails the transfer."""
        if self.ended:
            return False
        key = (header.layer_start, header.layer_end, header.token_start, header.token_end)
        if key in self._seen:
            return False
        if (header.layer_end > self.layout.num_layers or header.token_start < self.token_start
                or header.token_end > self.token_end):
            self.fail(ProtocolError(f"frame {key} outside the expected range"))
            return False
        if self.state is TransferState.WAITING:
            self._move(TransferState.TRANSFERRING)
            self.first_frame_at = time.monotonic()
        self._seen.add(key)
        return True

    def write(self, header: kv_wire.FrameHeader, payload: memoryview) -> None:
        """A claimed frame's payload, read whole in the KV's own dtype and its checksum matched:
        its rows copied into place (numpy, on this thread: never a thread pool woken for a copy)."""
        if self.ended:
            return
        t0, t1 = header.token_start - self.token_start, header.token_end - self.token_start
        window = self._row_bytes[header.layer_start:header.layer_end, :, :, t0:t1]
        np.copyto(window, np.frombuffer(payload, dtype=np.uint8).reshape(window.shape))
        self.filled(header)

    def place(self, header: kv_wire.FrameHeader, kv: torch.Tensor) -> None:
        """A claimed frame read whole ([layers, 2, kv_heads, tokens, head_dim] in its wire dtype),
        converted into the KV on this thread: never a torch thread pool woken for a copy."""
        t0, t1 = header.token_start - self.token_start, header.token_end - self.token_start
        into = self.kv[header.layer_start:header.layer_end, :, :, t0:t1].flatten(0, 2)  # [rows, tokens, head_dim]
        rows = kv.reshape(into.shape)
        step = max(1, SERIAL_COPY_ELEMENTS // max(1, into.shape[2]))
        for row in range(into.shape[0]):
            for start in range(0, into.shape[1], step):
                into[row, start:start + step].copy_(rows[row, start:start + step])
        self.filled(header)

    def filled(self, header: kv_wire.FrameHeader) -> None:
        """A claimed frame's payload is in place, its checksum matched."""
        if self.ended:
            return
        self._cells_filled += (header.layer_end - header.layer_start) * (header.token_end - header.token_start)
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
