"""One prompt's life on P, from its PrefillRequest to its last KV frame: the request, the task that
runs it, its KV paths and their spans, and its phase. Knows nothing of NATS; the service moves it.

Lifecycle (`PrefillJob.move`; any other move raises):
1. ACCEPTED   P answered PrefillAccepted and started the job's task; the task opens one KV path
              (`OutgoingTransfer`) per target, whose keepalives tell each decoder P holds the request.
2. COMPUTING  the cached prefix is queued on every path, then each chunk goes through P's engine
              (waiting there behind other prompts) and is queued on every path as it comes out.
3. SENDING    every chunk is computed; P waits while each path writes what it has queued.
4. DONE       every path delivered its KV; P publishes PrefillDone.
   FAILED     the compute failed (P publishes RequestFailed), or a path did (PrefillDone, then
              RequestFailed naming the path).
   ABORTED    an Abort arrived or P is shutting down: open paths stop and send an ABORT frame.
"""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

import torch
from opentelemetry import trace
from opentelemetry.context import Context

from services.prefill.prefiller import slice_for_target
from shared.kv_sender import OutgoingTransfer
from shared.lifecycle import checked_move
from shared.messages import PrefillRequest
from shared.radix_cache import PrefixHandle


class Phase(enum.Enum):
    ACCEPTED = "accepted"
    COMPUTING = "computing"
    SENDING = "sending"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


_NEXT: dict[Phase, set[Phase]] = {
    Phase.ACCEPTED: {Phase.COMPUTING, Phase.FAILED, Phase.ABORTED},
    Phase.COMPUTING: {Phase.SENDING, Phase.FAILED, Phase.ABORTED},
    Phase.SENDING: {Phase.DONE, Phase.FAILED, Phase.ABORTED},
    Phase.DONE: set(),
    Phase.FAILED: set(),
    Phase.ABORTED: set(),
}


@dataclass(eq=False)
class PrefillJob:
    request: PrefillRequest
    prefix: PrefixHandle | None = None  # P's cache hit, locked until the job ends
    trace_context: Context | None = None
    phase: Phase = Phase.ACCEPTED
    task: asyncio.Task | None = None
    transfers: list[OutgoingTransfer] = field(default_factory=list)
    span: trace.Span | None = None
    transfer_spans: dict[OutgoingTransfer, tuple[trace.Span, float]] = field(default_factory=dict)  # (span, started)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_kv_tokens(self) -> int:
        """P computes KV for every prompt token but the last, which each decoder feeds itself."""
        return len(self.request.prompt_ids) - 1

    @property
    def cached_tokens(self) -> int:
        return self.prefix.length if self.prefix is not None else 0

    @property
    def ended(self) -> bool:
        return not _NEXT[self.phase]

    def move(self, new: Phase) -> None:
        self.phase = checked_move(_NEXT, self.phase, new, f"prefill job {self.request_id}")

    async def queue_kv(self, chunk: tuple[int, int], kv: torch.Tensor) -> None:
        """Queue the part of a chunk each decoder lacks (past its target's token_start) on its path."""
        for transfer in self.transfers:
            part = slice_for_target(kv, chunk, transfer.target.token_start)
            if part is not None:
                await transfer.put(*part)

    def open_transfers(self) -> list[OutgoingTransfer]:
        return [transfer for transfer in self.transfers if not transfer.ended]

    def unsent_kv_bytes(self, transfer: OutgoingTransfer, kv_bytes_per_token: int) -> int:
        """What a path still owed its decoder: the KV an abort saves from crossing the link."""
        owed = (self.prompt_kv_tokens - transfer.target.token_start) * kv_bytes_per_token
        return max(0, owed - transfer.kv_bytes)
