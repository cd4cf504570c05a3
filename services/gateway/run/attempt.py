"""One dispatch of a request (an attempt) and its lifecycle; plain state, no NATS.

A request is served by one attempt at a time: the first, or a migration after a tier was lost.
An attempt moves through these phases (`Attempt.move` refuses any other move):

1. DISPATCHED: the decoders accepted it and P is prefilling; the first decoder streams as soon
   as its KV lands (RLD in P-RLD-MD and P-RLD, MD in P-MD). P alone (max_tokens 0): P scores the
   prompt, and its PrefillDone ends the request.
2. P-RLD-MD only, one of:
   CUT: MD took over from RLD (its HandoffStats, its first token, or the gateway's own final
   handoff after RLD was lost); RLD's loss changes nothing from here.
   RELAY_ALONE: MD was let go before the cut (lost, or P lost before MD's KV was out); RLD
   finishes alone, as P-RLD. RLD may still cut if it handed off before it heard (-> CUT).
3. STOPPED: the gateway let it go (the request ended, or it migrated); late events are dropped.

P's end is not a phase: RLD streams, and MD may take over, before P's PrefillDone arrives (and
after RLD is lost MD takes over while P still sends its KV), so the report is kept as it comes.

An attempt also holds what the gateway watches of it as its events arrive (the dispatcher reads
and writes it): when each tier's last tokens came, whether MD has started, the hold on MD's KV,
and how much of the answer P was asked to cache.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.lifecycle import checked_move
from shared.messages import PrefillDone
from shared.names import FailurePolicy, HandoffMode, Pipeline, Role
from shared.request_ids import request_id_bytes
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.gateway.routing.policy import PipelineDecision, RelayWatch


class AttemptPhase(enum.Enum):
    DISPATCHED = "dispatched"
    CUT = "cut"
    RELAY_ALONE = "relay_alone"
    STOPPED = "stopped"


_MOVES = {
    AttemptPhase.DISPATCHED: {AttemptPhase.CUT, AttemptPhase.RELAY_ALONE, AttemptPhase.STOPPED},
    AttemptPhase.RELAY_ALONE: {AttemptPhase.CUT, AttemptPhase.STOPPED},
    AttemptPhase.CUT: {AttemptPhase.STOPPED},
    AttemptPhase.STOPPED: set(),
}


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    pipeline: Pipeline | None
    handoff_at: int | None
    md_kv_delay_s: float
    handoff_mode: HandoffMode | None = None
    failure_policy: FailurePolicy | None = None  # None: the gateway's --failure-policy
    deadline_at: float | None = None  # time.monotonic() the request must end by (it may have queued at
    # admission); None: --request-timeout-s after its run starts
    prompt_logprobs: int | None = None  # N: P scores the prompt (PromptLogprobs), with the N likeliest tokens
    max_tokens_param: str | None = None  # the field the client set max_tokens with; None: the gateway's
    # default (the rest of the context), which dispatch lowers to what the chosen decoders' KV budget holds

    def __post_init__(self) -> None:
        try:  # the KV wire carries the id as a UUID: any other would only fail later, on P's sockets
            request_id_bytes(self.request_id)
        except ValueError:
            raise ValueError(f"request id {self.request_id!r} is not 'req-' and a UUID (new_request_id)") from None

    @property
    def prefill_only(self) -> bool:
        """No output token (max_tokens 0): the prompt's logprobs alone, served by P (Pipeline.P)."""
        return self.sampling.max_tokens == 0


@dataclass
class Attempt:
    """One dispatch of a request: the instances it runs on and how far it got."""

    request: GenerationRequest  # what the tiers were sent; a migration's prompt ends with the streamed tokens
    output_offset: int  # the request's output index of this attempt's first token
    pipeline: Pipeline
    decision: PipelineDecision | None
    instances: dict[Role, str]  # role -> instance id
    cached_tokens: int = 0  # P's prefix-cache hit: prompt tokens not computed again
    main_cached_tokens: int = 0  # MD's DRC hit: prompt tokens whose KV did not cross the WAN
    main_backfill: bool = False  # MD would keep the KV should RLD finish first (DecodeAccepted.backfill)
    phase: AttemptPhase = AttemptPhase.DISPATCHED
    served_by: Pipeline | None = None  # the pipeline that serves it, as far as it got: see `served_pipeline`
    prefill: PrefillDone | None = None  # P's report that every KV path is sent
    lost: set[Role] = field(default_factory=set)  # roles lost (and recovered from, or ignored)
    streaming: set[str] = field(default_factory=set)  # tiers whose tokens of it came: each holds its KV
    relay_watch: RelayWatch | None = None  # P holds MD's KV back until RLD no longer looks like finishing first
    main_started: bool = False  # MD made a token or took over
    warmed_tokens: int = 0  # output tokens of this attempt P was last asked to cache
    last_chunk_at: dict[str, float] = field(default_factory=dict)  # tier -> time.monotonic() of its last tokens

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def served_pipeline(self) -> Pipeline:
        """The pipeline that serves it: the one it was dispatched on, but P-RLD while RLD finishes
        alone (MD let go before the cut), which stays so once it is stopped."""
        return self.served_by or self.pipeline

    def move(self, phase: AttemptPhase) -> None:
        self.phase = checked_move(_MOVES, self.phase, phase, f"attempt {self.request_id}")
        if phase is AttemptPhase.RELAY_ALONE:
            self.served_by = Pipeline.P_RLD
        elif phase is AttemptPhase.CUT:
            self.served_by = None  # RLD had handed off before it heard: MD serves after all

    def chunk_gap_s(self, tier: str, now: float) -> float | None:
        """A chunk from `tier` came at `now`: the time since its previous one (None: its first)."""
        last = self.last_chunk_at.get(tier)
        self.last_chunk_at[tier] = now
        return None if last is None else now - last
