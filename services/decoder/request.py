"""One request on a decoder (RLD or MD) and the phases it moves through.

1. ADMITTING    assigned: its KV inbox is open; it waits for the batch engine's KV budget, then the
                engine copies the prefix the decoder already holds (MD's DRC) while P sends the rest
2. KV_WAIT      admitted: the rest of the prompt's KV is on its way, then copied after the prefix
3. DECODING     the role decodes: steps, extends, handoff messages
4. FINISHED     the last token is out, or
   HANDED_OFF   RLD cut over: MD makes the rest, or
   RELAY_FINISHED  MD: RLD made the last token first; MD only keeps the KV
   FAILED       an error, reported on the request's events (from 1-4)
   ABORTED      cancelled: the gateway's Abort, RLD finishing first, shutdown (from 1-4)
5. RELEASED     its inbox, engine KV and registry entry are freed

An Abort cancels only phases 1-3; after them a request finishes its own work (MD's DRC keep).
`move` is the one way between phases; any other move raises.
"""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace

from shared import subjects
from shared.errors import DeadlineExceeded
from shared.kv_inbox import KVInbox
from shared.lifecycle import checked_move
from shared.messages import DecodeAssign, Handoff, KVReady, MainLost
from shared.model_runner import DecodeSequence


class Phase(enum.Enum):
    ADMITTING = "admitting"
    KV_WAIT = "kv_wait"
    DECODING = "decoding"
    FINISHED = "finished"
    HANDED_OFF = "handed_off"
    RELAY_FINISHED = "relay_finished"
    FAILED = "failed"
    ABORTED = "aborted"
    RELEASED = "released"

    @property
    def cancellable(self) -> bool:
        """Whether an Abort still cancels the request."""
        return self in (Phase.ADMITTING, Phase.KV_WAIT, Phase.DECODING)


_ENDED = {Phase.FAILED, Phase.ABORTED}
_DECODED = {Phase.FINISHED, Phase.HANDED_OFF, Phase.RELAY_FINISHED}
_ALLOWED = {
    Phase.ADMITTING: {Phase.KV_WAIT, *_ENDED},
    Phase.KV_WAIT: {Phase.DECODING, *_ENDED},
    Phase.DECODING: {*_DECODED, *_ENDED},
    **{p: {Phase.RELEASED, *_ENDED} for p in _DECODED},  # the work after the decode can still fail
    **{p: {Phase.RELEASED} for p in _ENDED},
    Phase.RELEASED: set(),
}

PeerMessage = KVReady | MainLost | Handoff  # RLD: MD's progress and the gateway's MainLost; MD: RLD's handoffs


@dataclass(eq=False)
class DecodeRequest:
    """One request on a decoder, from assignment to release."""

    assign: DecodeAssign
    inbox: KVInbox
    trace_context: otel_context.Context
    assigned_at: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.ADMITTING
    seq: DecodeSequence | None = None  # set once admitted
    peer_messages: asyncio.Queue[PeerMessage] = field(default_factory=asyncio.Queue)  # for the role's decode
    task: asyncio.Task | None = None
    span: trace.Span | None = None  # `<role>.request`, for an abort to mark
    cut_announced: bool = False  # MD: RLD said its cut is on the way (CutComing)
    cut_sent: bool = False  # RLD: its final handoff went out; MD alone makes the rest
    backfill: bool = False  # MD: RLD finished it; MD only waits for its KV to keep it (not the gateway's any more)

    @property
    def request_id(self) -> str:
        return self.assign.request_id

    @property
    def sequence(self) -> DecodeSequence:
        """The request's sequence, for the phases after admission (the only ones that decode)."""
        assert self.seq is not None, f"{self.request_id} is not admitted"
        return self.seq

    @property
    def events_subject(self) -> str:
        return subjects.request_events(self.assign.request_id)

    def move(self, phase: Phase) -> None:
        self.phase = checked_move(_ALLOWED, self.phase, phase, f"decoder request {self.request_id}")

    def time_left_s(self) -> float:
        """Until the request's deadline (never below 0)."""
        return max(0.0, self.assign.deadline_s - (time.monotonic() - self.assigned_at))

    async def next_peer_message(self, missing: str) -> PeerMessage:
        """The next message a peer sent for this request; DeadlineExceeded(missing) if none comes in time."""
        try:
            async with asyncio.timeout(self.time_left_s()):
                return await self.peer_messages.get()
        except TimeoutError as exc:
            raise DeadlineExceeded(missing) from exc
