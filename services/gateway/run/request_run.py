"""One request in flight at the gateway: its attempts, the merge of their tokens, and recovery.

A RequestRun is the one object that holds a request at the gateway: its attempts (each with what
the gateway watches of it, services/gateway/run/attempt.py), the merge of their tokens, recovery,
and what the response reports of it. The gateway creates it (`Dispatcher.start`), delivers it
each event once decoded, and drops it when its last attempt is stopped. The run reaches the rest of
the gateway only through its `RunHost`, as a decoder's role reaches its shell through `DecoderIO`.

RLD's and MD's TokenChunks are merged by index, each exactly once, into what the client has. When
a tier is lost, services/gateway/run/recovery.py says what to do; a migration stops the attempt and
dispatches a new one (through the host) with the streamed tokens appended to the prompt, so the
client's stream simply goes on. Every attempt ends with an Abort broadcast, so no tier keeps
state for an attempt the gateway has let go.

A tier is lost in one of two ways: its instance is gone (the watchdog: no heartbeat and no
answered ping, or a ping nobody is there to answer; or its own RequestFailed says it is stopping,
InstanceStopping, and the registry drops it at once), or it failed the request (RequestFailed)
while alive. The migration that follows never goes back to the instance that just failed (with no
other of its role, MD's place goes to RLD alone, and a request that needs the role fails); later
attempts still prefer others to every instance an attempt failed on, and take one that answers
pings when no other is left. P's report that it could not reach a decoder's KV port (KVUnreachable)
blames the path, not the decoder: the decoder is neither marked gone nor remembered as failed,
and a decoder already streaming the attempt holds its KV, so the report changes nothing for it.

The run decides the cut (MD took over from RLD) once: `cut_index`, the output index of MD's first
token, which the HTTP layer and the request telemetry read. The run's own lifecycle (RunPhase):

1. RUNNING: tokens are merged as they come; a lost tier is recovered from.
2. FINISHED: a finish reason was merged (P's PrefillDone, for P alone), and every prompt logprob
   when the request asks for them; or FAILED: a loss it cannot recover from, or a deadline.
3. CLOSED: its attempt is let go. A client that goes away closes a RUNNING run.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from services.gateway.run.attempt import Attempt, AttemptPhase, GenerationRequest
from services.gateway.run.outcome import CloseReason, LossKind, Migration, response_summary
from services.gateway.run.recovery import Action, RunState, on_tier_lost
from shared import subjects, tracing
from shared.config import GatewayConfig
from shared.errors import (
    DeadlineExceeded,
    InstanceStopping,
    KVPreempted,
    KVUnreachable,
    PddError,
    PeerGone,
    ProtocolError,
    RequestAborted,
)
from shared.lifecycle import checked_move
from shared.messages import (
    Handoff,
    HandoffStats,
    KVReceived,
    MainLost,
    Message,
    PrefillDone,
    PromptLogprobs,
    RequestFailed,
    TokenChunk,
)
from shared.names import FailurePolicy, HandoffMode, Pipeline, Role
from shared.request_ids import new_request_id
from shared.sampling_params import TokenLogprob

if TYPE_CHECKING:
    from services.gateway.routing.policy import PipelineDecision

__all__ = ["Attempt", "GenerationRequest", "RequestRun", "RunHost", "RunPhase", "TokenEvent"]

log = logging.getLogger(__name__)

WATCHDOG_S = 0.25  # how often a request checks that its instances are still alive


@dataclass(frozen=True)
class TokenEvent:
    index: int
    token_id: int
    tier: str
    finish_reason: str | None
    logprob: TokenLogprob | None = None  # when the request asks for logprobs: from the tier that made it


class RunPhase(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CLOSED = "closed"


_RUN_MOVES = {
    RunPhase.RUNNING: {RunPhase.FINISHED, RunPhase.FAILED, RunPhase.CLOSED},
    RunPhase.FINISHED: {RunPhase.CLOSED},
    RunPhase.FAILED: {RunPhase.CLOSED},
    RunPhase.CLOSED: set(),
}


class RunHost(Protocol):
    """What a run asks of the gateway around it (services/gateway/routing/dispatcher.py)."""

    async def dispatch(self, run: RequestRun, req: GenerationRequest, output_offset: int,
                       avoid: set[str], exclude: frozenset[str] = frozenset()) -> Attempt:
        """Start an attempt, preferring instances not in `avoid` and never on one in `exclude`; its
        events go to `run.deliver`."""

    async def stop(self, attempt: Attempt, reason: CloseReason) -> None:
        """Idempotent per attempt: its events stop, its instances are freed, every tier drops it."""

    def is_alive(self, instance_id: str) -> bool: ...

    def instance_gone(self, instance_id: str) -> None:
        """It said it is stopping: the registry drops it, so no migration picks it again."""

    async def publish(self, subject: str, message: Message) -> None: ...

    async def answer_grew(self, attempt: Attempt, token_ids: list[int]) -> None:
        """The client has `token_ids` (the run's, from output index 0), more than before."""

    def count_loss(self, tier: Role, how: LossKind) -> None: ...

    def count_recovery(self, action: Action) -> None: ...

KV_UNREACHABLE = KVUnreachable.code  # P never got a KV connection to the decoder: the path failed
_FAILED_BY_CODE = {cls.code: cls for cls in (DeadlineExceeded, ProtocolError, PeerGone, InstanceStopping)}


class RequestRun:
    """One request in flight: its current attempt, merge state and outcome."""

    def __init__(self, req: GenerationRequest, config: GatewayConfig, host: RunHost) -> None:
        self.request = req
        self.request_id = req.request_id
        self.config = config
        self.failure_policy = req.failure_policy or FailurePolicy(config.failure_policy)
        self.host = host
        self.phase = RunPhase.RUNNING
        self.first: Attempt | None = None
        self.attempt: Attempt | None = None
        self.attempts: list[Attempt] = []  # every attempt, in order (the current one last)
        self.migrations: list[Migration] = []
        self.failed_on: set[str] = set()  # instances an attempt failed on: later ones prefer others
        self.token_ids: list[int] = []  # what the client has, in order
        self.finish_reason: str | None = None  # the merged one (the HTTP layer may stop earlier, at a stop string)
        self.cut_index: int | None = None  # output index of MD's first token after it took over from RLD
        self.recovery: Action | None = None  # the last recovery taken
        self.handoff: HandoffStats | None = None
        self.prefill: PrefillDone | None = None
        self.kv_received: dict[str, KVReceived] = {}
        self.first_token_at: float | None = None
        self.started_at = time.monotonic()
        self.deadline_at = req.deadline_at or self.started_at + config.request_timeout_s
        self.trace_id = tracing.current_trace_id()  # the response names it, to find the trace on /dashboard
        self._events: asyncio.Queue[Message] = asyncio.Queue()  # decoded once, by the host
        self._pending: dict[int, TokenEvent] = {}  # arrived ahead of a gap, by absolute index
        # the prompt's logprobs by position (the first has none), when asked: P's PromptLogprobs fill them
        self._prompt_logprobs: list[TokenLogprob | None] = [None] * len(req.prompt_ids)
        self._prompt_missing = len(req.prompt_ids) - 1 if req.prompt_logprobs is not None else 0

    # --- what the rest of the gateway reads ---------------------------------------------------

    @property
    def finished(self) -> bool:
        """A finish reason was merged (and stays true once the run is closed)."""
        return self.finish_reason is not None

    @property
    def pipeline(self) -> str:
        """The pipeline that serves the request now, and once it ended the one that served its end:
        the current attempt's, P-RLD once RLD finishes alone. A pipeline the request named binds its
        first dispatch only (docs/api.md, "The pipeline a response reports")."""
        return self.attempt.served_pipeline if self.attempt else ""

    @property
    def decision(self) -> PipelineDecision | None:
        return self.first.decision if self.first else None

    @property
    def instances(self) -> dict[str, str]:
        """The instances serving the request now."""
        return {str(role): iid for role, iid in self.attempt.instances.items()} if self.attempt else {}

    @property
    def cached_tokens(self) -> int:
        return self.first.cached_tokens if self.first else 0

    @property
    def main_cached_tokens(self) -> int:
        return self.first.main_cached_tokens if self.first else 0

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """One entry per prompt token (None for the first), once P has sent them all; None before, or
        when the request did not ask."""
        if self.request.prompt_logprobs is None or self._prompt_missing:
            return None
        return list(self._prompt_logprobs)

    # --- lifecycle ------------------------------------------------------------------------------

    def _move(self, phase: RunPhase) -> None:
        self.phase = checked_move(_RUN_MOVES, self.phase, phase, f"request {self.request_id}")

    def _failed(self, exc: PddError) -> PddError:
        """The run ends with `exc` (the caller raises it)."""
        if self.phase is RunPhase.RUNNING:
            self._move(RunPhase.FAILED)
        return exc

    async def start(self) -> None:
        self.attempt = self.first = await self.host.dispatch(self, self.request, 0, set())
        self.attempts.append(self.attempt)

    def deliver(self, event: Message) -> None:
        """One of its attempts' events, decoded: tokens() applies it in arrival order."""
        self._events.put_nowait(event)

    @property
    def current_attempt(self) -> Attempt:
        """The attempt in flight: a run has one from start() on."""
        assert self.attempt is not None, f"{self.request_id} has not started"
        return self.attempt

    @property
    def waiting_for_prefill(self) -> bool:
        """The current attempt has no token and P has not finished sending its KV: the request waits
        in P's queue or is being computed. The next-token deadline does not run then; P's liveness
        pings (a dead P is a lost tier) and the request deadline bound the wait."""
        attempt = self.current_attempt
        return attempt.prefill is None and len(self.token_ids) <= attempt.output_offset

    async def tokens(self) -> AsyncIterator[TokenEvent]:
        """Tokens in index order, each once; raises the failure of any tier it cannot recover from.
        When the request asks for its prompt's logprobs, the first token waits for all of them."""
        deadline = self.deadline_at
        last_event_at = next_check = time.monotonic()
        held: list[TokenEvent] = []
        while self.phase is RunPhase.RUNNING:
            now = time.monotonic()
            if now >= deadline:
                raise self._failed(DeadlineExceeded(f"{self.request_id}: the request deadline "
                                                    f"({self.config.request_timeout_s:g}s) passed"))
            if self.waiting_for_prefill:
                last_event_at = now  # queued or computing at P: waiting, not stalled (P's pings watch it)
            elif now - last_event_at >= self.config.token_timeout_s:
                raise self._failed(DeadlineExceeded(f"{self.request_id}: no token came within "
                                                    f"{self.config.token_timeout_s:g}s"))
            if now >= next_check:  # also while tokens flow: RLD streaming says nothing of MD or P
                next_check = now + WATCHDOG_S
                await self._check_instances()
            try:
                async with asyncio.timeout(min(next_check, deadline) - now):
                    event = await self._events.get()
            except TimeoutError:
                continue
            if not self._is_current(event):
                continue
            last_event_at = time.monotonic()
            held += await self.handle(event)
            if not self._prompt_missing:
                for token_event in held:
                    yield token_event
                held.clear()

    def _is_current(self, event: object) -> bool:
        """From the attempt in flight (not one already let go), while the run is running."""
        attempt = self.attempt
        return (self.phase is RunPhase.RUNNING and attempt is not None and attempt.phase is not AttemptPhase.STOPPED
                and getattr(event, "request_id", None) == attempt.request_id)

    async def handle(self, event: object) -> list[TokenEvent]:
        """Apply one decoded event; returns the tokens it makes ready for the client, in order.

        Events of an attempt already let go are dropped. Raises the failure of a tier the run
        cannot recover from."""
        if not self._is_current(event):
            return []
        attempt = self.current_attempt
        if isinstance(event, TokenChunk):
            ready = self._merge(event)
            if ready and self.finish_reason is None:
                await self.host.answer_grew(attempt, self.token_ids)
            return ready
        if isinstance(event, KVReceived):
            self.kv_received[str(event.tier)] = event  # a plain key: the summary goes out through orjson
        elif isinstance(event, HandoffStats):
            self.handoff = self.handoff or event
            self._cut(attempt, attempt.output_offset + event.eager_tokens)
        elif isinstance(event, PromptLogprobs):
            self._take_prompt_logprobs(event)
        elif isinstance(event, PrefillDone):
            attempt.prefill = self.prefill = event
            if attempt.request.prefill_only:  # P's report follows its last PromptLogprobs (one publisher)
                if self._prompt_missing:
                    raise self._failed(ProtocolError(f"{self.request_id}: P finished without "
                                                     f"{self._prompt_missing} of the prompt's logprobs"))
                self._finish("length")
        elif isinstance(event, RequestFailed):
            await self._on_failed(attempt, event)
        return []

    async def _on_failed(self, attempt: Attempt, event: RequestFailed) -> None:
        """A tier's report that it failed the request; P's names the path it failed on, if any."""
        tier = event.path or event.tier
        stopping = event.code == InstanceStopping.code and tier == event.tier
        try:
            instance = attempt.instances.get(Role(tier))
        except ValueError:  # not a role's tier: _on_tier_lost fails the run
            instance = None
        if stopping and instance is not None:
            self.host.instance_gone(instance)  # before the migration picks: it must not be picked again
        if event.code == KV_UNREACHABLE and tier in attempt.streaming:
            log.warning("%s: %s: %s streams, so its KV is in: nothing to recover", self.request_id,
                        event.message, tier)
            return
        await self._on_tier_lost(tier, f"{event.tier}: {event.message}", event.code, gone=stopping)

    def _take_prompt_logprobs(self, event: PromptLogprobs) -> None:
        """Positions past the request's own prompt (a migrated attempt's streamed tokens) are not prompt."""
        for position, logprob in enumerate(event.logprobs, start=event.start):
            if 0 < position < len(self._prompt_logprobs) and self._prompt_logprobs[position] is None:
                self._prompt_logprobs[position] = logprob
                self._prompt_missing -= 1
        if not self._prompt_missing and self.finish_reason is not None and self.phase is RunPhase.RUNNING:
            self._move(RunPhase.FINISHED)

    def _finish(self, reason: str) -> None:
        """The answer ended; the run too, unless the prompt's logprobs are still to come."""
        self.finish_reason = reason
        if not self._prompt_missing:
            self._move(RunPhase.FINISHED)

    def _cut(self, attempt: Attempt, index: int) -> None:
        """MD took over from RLD at output `index`: the one place the cut is decided."""
        if attempt.pipeline != Pipeline.P_RLD_MD or attempt.phase is AttemptPhase.CUT:
            return
        attempt.move(AttemptPhase.CUT)
        if self.cut_index is None:
            self.cut_index = index

    def _merge(self, chunk: TokenChunk) -> list[TokenEvent]:
        """The chunk's tokens that extend what the client has, in order; later ones wait for the gap."""
        attempt = self.current_attempt
        start = attempt.output_offset + chunk.start
        attempt.streaming.add(chunk.tier)
        if chunk.tier == Role.MAIN:
            self._cut(attempt, start)
        logprobs = chunk.logprobs if chunk.logprobs and len(chunk.logprobs) == len(chunk.token_ids) else None
        for offset, token in enumerate(chunk.token_ids):
            index = start + offset
            last = offset == len(chunk.token_ids) - 1
            if index >= len(self.token_ids) and index not in self._pending:
                self._pending[index] = TokenEvent(index, token, chunk.tier, chunk.finish_reason if last else None,
                                                  None if logprobs is None else logprobs[offset])
        ready = []
        while self.finish_reason is None and len(self.token_ids) in self._pending:
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            token_event = self._pending.pop(len(self.token_ids))
            self.token_ids.append(token_event.token_id)
            ready.append(token_event)
            if token_event.finish_reason is not None:
                self._finish(token_event.finish_reason)
        return ready

    async def _check_instances(self) -> None:
        """Notice a lost instance before any deadline would: its heartbeats and ping answers stopped,
        or its ping found nobody (the gateway pings every instance in use, routing/liveness.py)."""
        attempt = self.current_attempt
        for role, instance_id in list(attempt.instances.items()):
            if role not in attempt.lost and not self.host.is_alive(instance_id):
                await self._on_tier_lost(role, f"{role} instance {instance_id} stopped answering", PeerGone.code,
                                         gone=True)
                return  # a migration may have replaced the attempt: check the new one next time

    async def _on_tier_lost(self, tier: str, message: str, code: str, gone: bool) -> None:
        """`gone`: the instance is (the watchdog); otherwise it failed this request and may be alive."""
        attempt = self.current_attempt
        try:
            role = Role(tier)
        except ValueError:
            raise self._failed(_FAILED_BY_CODE.get(code, PddError)(message)) from None
        if role in attempt.lost:
            return
        attempt.lost.add(role)
        preempted = code == KVPreempted.code and not gone
        how = (LossKind.GONE if gone else LossKind.PREEMPTED if preempted
               else LossKind.UNREACHABLE if code == KV_UNREACHABLE else LossKind.FAILED)
        self.host.count_loss(role, how)
        failure_migrations = sum(1 for m in self.migrations if not m.preempted)
        state = RunState(attempt.pipeline, attempt.phase, frozenset(attempt.lost - {role}),
                         len(self.token_ids) - attempt.output_offset, attempt.prefill is not None,
                         self.config.max_migrations - failure_migrations, self.failure_policy)
        action = on_tier_lost(state, role, preempted)
        log.warning("%s: %s %s (%s): %s", self.request_id, role, how, message, action.value)
        if action is Action.IGNORE:
            return
        if action is Action.FAIL:
            raise self._failed(_FAILED_BY_CODE.get(code, PddError)(message))
        self.recovery = action
        self.host.count_recovery(action)
        if action is Action.FINISH_ON_RELAY:
            await self.host.publish(subjects.main_lost(attempt.instances[Role.RELAY]),
                                    MainLost(attempt.request_id, message))
            attempt.move(AttemptPhase.RELAY_ALONE)
        elif action is Action.MAIN_TAKES_OVER:
            # the gateway hands off in RLD's place: every token the client has of this attempt, at once
            await self.host.publish(subjects.handoff(attempt.instances[Role.MAIN]), Handoff(
                attempt.request_id, self.token_ids[attempt.output_offset:], finished=False, start=0, final=True,
                mode=HandoffMode.ONE_SHOT))
            self._cut(attempt, len(self.token_ids))
        else:
            await self._migrate(role, message, preempted, self._blame(attempt.instances[role], code, how))

    def _blame(self, instance: str, code: str, how: LossKind) -> frozenset[str]:
        """The instances the migration must not go to: the one that just failed, unless it let the
        request go (aborted, preempted); later attempts prefer others, unless only the path failed."""
        if code in (RequestAborted.code, KVPreempted.code):
            return frozenset()
        if how is not LossKind.UNREACHABLE:
            self.failed_on.add(instance)
        return frozenset({instance})

    async def _migrate(self, tier: Role, reason: str, preempted: bool = False,
                       exclude: frozenset[str] = frozenset()) -> None:
        """Let the attempt go and dispatch the request again, continuing after the tokens streamed."""
        streamed = list(self.token_ids)
        await self._let_go(self.current_attempt, CloseReason.MIGRATED)
        self._pending.clear()
        req = self.request
        moved = dataclasses.replace(
            req, request_id=new_request_id(), prompt_ids=[*req.prompt_ids, *streamed],
            sampling=dataclasses.replace(req.sampling, max_tokens=req.sampling.max_tokens - len(streamed)),
            pipeline=None, handoff_at=None, md_kv_delay_s=0.0, handoff_mode=None,
            prompt_logprobs=req.prompt_logprobs if self._prompt_missing else None)
        try:
            self.attempt = await self.host.dispatch(self, moved, len(streamed), set(self.failed_on), exclude)
        except PddError as exc:
            raise self._failed(PeerGone(f"{reason}; could not move the request to another instance: {exc}")) from exc
        self.attempts.append(self.attempt)
        self.migrations.append(Migration(len(streamed), tier, preempted, self.attempt.pipeline, self.instances,
                                         moved.request_id))
        log.warning("%s: migrated after %d tokens to %s", self.request_id, len(streamed), self.instances)

    async def _let_go(self, attempt: Attempt, reason: CloseReason) -> None:
        if attempt.phase is AttemptPhase.STOPPED:
            return
        attempt.move(AttemptPhase.STOPPED)
        await self.host.stop(attempt, reason)

    async def close(self, reason: CloseReason | str) -> None:
        """Idempotent: end the current attempt (`reason`: the HTTP layer's, one of CloseReason's values)."""
        if self.phase is RunPhase.CLOSED:
            return
        self._move(RunPhase.CLOSED)
        if self.attempt is not None:
            await self._let_go(self.attempt, CloseReason.FINISHED if self.finished else CloseReason(reason))

    def summary(self) -> dict:
        """What the client may want to know of how the request was served (the response's `pdd` field)."""
        return response_summary(self)
