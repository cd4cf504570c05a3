"""MD's half of the handoff: adopting RLD's eager tokens until the cut. Plain logic; no NATS, no model.

RLD sends Handoff messages (when is services/relay/handoff.py's to decide). For each one,
`Takeover.adopt` says which tokens MD's output gains and what the move is:
- a Catch-Up chunk (final=False): EXTEND; its tokens wait in `unfed` for a pass that recomputes
  them (`take_unfed`), without sampling;
- the cut (final=True): CUT, feeding what is still unfed and sampling the next token
  (extend-decode). A pass recomputes every token it has, the newest included, so the cut's pass
  feeds only what came since; a cut that brings nothing new drops the newest token's KV and feeds
  it again (`unfeed`), for the logits to sample from;
- finished=True: RLD made the last token itself (RELAY_FINISHED); MD drops the request.
Tokens MD already holds are skipped: the gateway's recovery handoff repeats all the client has.
A handoff that starts past what MD holds leaves a gap: ProtocolError.

What MD does with Catch-Up chunks before the cut is `Takeover.catch_up_pass`'s to say: recompute
them and report holding them once (RLD cuts at that report), recompute on while the cut is not
announced (so the cut's pass stays short: each token it feeds adds a pass over the context), and
once RLD announces the cut (CutComing), only collect them for the cut's pass, so none of MD's
passes is running when the cut arrives and its engine can hold a step for it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.errors import ProtocolError
from shared.messages import Handoff, HandoffStats
from shared.names import HandoffMode


class Move(enum.Enum):
    EXTEND = "extend"
    CUT = "cut"
    RELAY_FINISHED = "relay_finished"


class Pass(enum.Enum):
    """What MD does with the Catch-Up tokens it just adopted (their `feed_ids`)."""

    REPORT = "report"  # recompute them, then report holding them (KVReady): RLD cuts at that report
    RECOMPUTE = "recompute"  # recompute them, so the cut's pass has less to feed
    COLLECT = "collect"  # keep them for the cut's pass: the cut is on its way


@dataclass(frozen=True)
class Adoption:
    move: Move
    new_ids: list[int]  # eager tokens MD's output gains (the part MD held already skipped)
    feed_ids: list[int] = field(default_factory=list)  # CUT: feed, then sample the next token
    unfeed: int = 0  # CUT: drop the KV of this many newest positions first (to feed them again)


class Takeover:
    """One request's takeover on MD, from its KV being complete to the cut."""

    def __init__(self, last_prompt_id: int) -> None:
        self.adopted = 0  # eager tokens MD holds as output
        self.chunks = 0  # handoff messages adopted, the cut's included
        self.mode: HandoffMode | None = None  # the last adopted handoff's (None: none adopted yet)
        self.ended = False
        self._unfed = [last_prompt_id]  # adopted (or the prompt's last), not yet fed
        self._newest = last_prompt_id  # the newest of those: the cut's pass ends on it
        self.reported_holding = False  # MD told RLD it holds some of its tokens (it reports that once)

    def adopt(self, handoff: Handoff) -> Adoption:
        if self.ended:
            raise ProtocolError(f"handoff for {handoff.request_id} after its takeover ended")
        if handoff.finished:
            self.ended = True
            return Adoption(Move.RELAY_FINISHED, [])
        if handoff.start > self.adopted:
            raise ProtocolError(f"handoff chunk starts at {handoff.start}, MD holds {self.adopted}")
        new_ids = handoff.eager_ids[self.adopted - handoff.start:]
        self.adopted += len(new_ids)
        self.chunks += 1
        self.mode = handoff.mode
        self._unfed += new_ids
        self._newest = self._unfed[-1] if self._unfed else self._newest
        if not handoff.final:
            return Adoption(Move.EXTEND, new_ids)
        self.ended = True
        if self._unfed:
            return Adoption(Move.CUT, new_ids, self.take_unfed())
        return Adoption(Move.CUT, new_ids, [self._newest], unfeed=1)

    def take_unfed(self) -> list[int]:
        """The tokens for a pass to feed (every adopted token not yet fed, in order); they count as fed."""
        unfed, self._unfed = self._unfed, []
        return unfed

    def catch_up_pass(self, cut_announced: bool) -> Pass:
        if not self.reported_holding:
            return Pass.REPORT
        return Pass.COLLECT if cut_announced else Pass.RECOMPUTE

    def reported(self) -> None:
        """MD sent KVReady(adopted): a report of holding tokens when it held any."""
        self.reported_holding = self.adopted > 0

    def stats(self, request_id: str, kv_wait_s: float, handoff_s: float) -> HandoffStats:
        """The handoff's stats for the gateway; extend_s is filled in after the extend-decode pass."""
        return HandoffStats(request_id, self.adopted, kv_wait_s, handoff_s, 0.0, self.mode or HandoffMode.ONE_SHOT,
                            self.chunks)
