"""The contract between the decoder shell and a role (RLD or MD).

The shell (services/decoder/service.py) owns NATS, the KV socket, the engine and the request
registry, and hands a role the `DecoderIO` below; the role decides what to do once a request's
KV is in, and owns whatever only it keeps (MD's DRC, RLD's handoff counters).
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

import torch
from nats.aio.msg import Msg
from opentelemetry import trace

from services.decoder.request import DecodeRequest, Phase
from shared.messages import Abort, DecodeAssign, Message
from shared.metrics import DecoderMetrics
from shared.names import Role


class DecoderIO(Protocol):
    """What the shell offers a role."""

    instance_id: str
    tracer: trace.Tracer
    metrics: DecoderMetrics

    @property
    def running(self) -> int:
        """Requests this decoder holds, in any phase."""

    def find(self, request_id: str) -> DecodeRequest | None: ...

    def keep_early(self, request_id: str, replay: Callable[[], Awaitable[None]]) -> None:
        """A peer's message about a request not registered here yet (its assignment not handled, or
        its cached prefix still being looked up): `replay` handles it again once the request is
        registered, before any newer message (services/decoder/early_messages.py)."""

    async def subscribe(self, subject: str, handler: Callable[[Msg], Awaitable[None]]) -> None: ...

    async def publish(self, subject: str, message: Message) -> None: ...

    async def forward(self, request: DecodeRequest, feed_ids: list[int]) -> str | None:
        """Feed tokens and sample the next one into request.seq.output_ids; the finish reason, if it ends."""

    async def forward_timed(self, request: DecodeRequest, feed_ids: list[int],
                            unfeed: int = 0) -> tuple[str | None, float]:
        """`forward` (first dropping the KV of the newest `unfeed` positions, in the same step), and how
        long the work waited for the engine to start its step (seconds)."""

    async def step(self, request: DecodeRequest, feed_ids: list[int]) -> str | None:
        """`forward`, then `publish_token`."""

    def extend(self, request: DecodeRequest, feed_ids: list[int]) -> asyncio.Future:
        """Queue tokens to feed without sampling (MD adopting a Catch-Up chunk), in order with the
        request's later work; the future settles (None) once they are in the KV."""

    async def export(self, request: DecodeRequest, start: int, end: int) -> torch.Tensor:
        """A copy of positions [start, end) of the request's KV."""

    def expect(self, request: DecodeRequest, in_s: float) -> None:
        """The request's next forward comes in about `in_s`: the engine may hold its next step for it."""

    def mark(self, request: DecodeRequest, what: str, **fields: object) -> None:
        """Note a moment of the request's in the engine's timeline (`--engine-timeline`), if it keeps one."""

    async def publish_token(self, request: DecodeRequest, finish_reason: str | None) -> None:
        """Send the request's newest output token to the gateway."""


class DecoderRole(Protocol):
    """What a role does; each method gets the shell's io where it needs one."""

    role: Role

    async def subscribe(self, io: DecoderIO) -> None:
        """Subscriptions only this role has."""

    def stats(self) -> dict[str, float]:
        """Gauges only this role has, for its heartbeat."""

    async def hold_prefix(self, assign: DecodeAssign) -> int:
        """Lock the prompt prefix whose KV this decoder already holds; its length in tokens (P sends the rest)."""

    async def prefix_kv(self, request: DecodeRequest) -> tuple[torch.Tensor, ...]:
        """The KV of the held prefix, in order, for the engine to copy before P's rest arrives (views
        that stay valid; held until `unlock_prefix`)."""

    def unlock_prefix(self, request: DecodeRequest) -> None:
        """The engine copied the held prefix (or never will): let it go; idempotent."""

    async def decode(self, request: DecodeRequest, io: DecoderIO) -> Phase:
        """Decode an admitted request (request.seq); the phase it ended in (FINISHED, HANDED_OFF, ...)."""

    async def settle(self, request: DecodeRequest, io: DecoderIO) -> None:
        """Work after the decode that an Abort must not cut short."""

    def release(self, request: DecodeRequest) -> None:
        """Drop whatever the role holds for the request; called once on every path."""

    def can_backfill(self) -> bool:
        """Whether it keeps the KV of a request RLD finished first, if P sends it anyway (MD's DRC)."""

    def keeps_after_abort(self, request: DecodeRequest, abort: Abort) -> bool:
        """Whether the request carries on after this Abort (MD: waits for its KV, for the DRC)."""
