"""PDD's pipeline choice: P-RLD-MD only when RLD's first token is predicted meaningfully earlier
than MD's; P-MD otherwise. Plain logic.

Both first tokens wait for P to compute what *P's own* cache lacks. RLD, next to P, then starts
at once; MD also waits for the KV *its* cache lacks to cross the WAN (streaming out chunk by
chunk while P computes, so the two overlap, except the last computed chunk's KV, which leaves
after P has finished: all of a session turn's short suffix) and for the round trip to it. Each
decoder adds its queue and one decode step. The gain of RLD is the difference; a handoff costs a recompute and a
stall, so RLD is worth it only past `relay_min_gain_s`. In one datacenter the gain is MD's queue
against RLD's: P-MD unless MD is queued.

Anomalous traffic: when RLD is predicted to finish the whole answer before MD's KV could arrive
(a short `max_tokens`, a long missing suffix), P holds MD's KV stream back (`hold_main_kv`);
`RelayWatch` releases it once RLD's own pace says it no longer finishes first. Outside the policy,
the gateway plans P-RLD when no MD is reachable (services/gateway/routing/dispatcher.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.names import Pipeline

NO_RELAY_S = float("inf")


@dataclass(frozen=True)
class PolicyConfig:
    relay_min_gain_s: float  # how much earlier RLD's first token must be predicted for P-RLD-MD
    default_link_bytes_per_s: float
    default_prefill_tokens_per_s: float


@dataclass(frozen=True)
class Estimate:
    """What the gateway currently believes about the instances a request would run on."""

    link_bytes_per_s: float | None  # P -> this MD, measured by P (moving average); None before any sample
    prefill_tokens_per_s: float | None  # measured from P's reports
    main_queue_s: float  # MD's wait before the request's first step, the step included
    relay_queue_s: float = NO_RELAY_S  # the same on RLD; inf: no RLD reachable
    prefill_fixed_s: float = 0.0  # P's cost per prefill whatever its length (fitted)
    round_trip_s: float = 0.0  # the path gateway -> P -> MD -> gateway (path_round_trip_s)
    relay_round_trip_s: float = 0.0  # the same through RLD
    relay_step_s: float = 0.05  # one decode step on RLD
    prefill_chunk_tokens: int = 256  # P computes and sends the KV this many tokens at a time


def path_round_trip_s(prefill_ping_s: float, decoder_ping_s: float) -> float:
    """The network time of a request through P to a decoder and back: gateway -> P, P's KV -> decoder,
    decoder's token -> gateway. The gateway pings P and the decoder, not the hop between them; with
    every instance in one of two datacenters and the gateway in one of them, that hop is half the
    difference of the two pings, so the path is the larger ping: MD's round trip for a gateway beside
    P, P's for a gateway beside MD, and the same for RLD next to P either way."""
    return max(prefill_ping_s, decoder_ping_s)


@dataclass(frozen=True)
class PipelineDecision:
    pipeline: Pipeline
    reason: str
    main_hit_tokens: int
    wan_bytes: int
    predicted_main_ready_s: float
    budget_s: float  # MD had to be predicted ready by this for P-MD: RLD's predicted start plus the gain it must buy
    predicted_relay_ready_s: float = NO_RELAY_S
    prefill_hit_tokens: int = 0
    predicted_relay_finish_s: float = NO_RELAY_S  # RLD's last token, were it to make them all
    hold_main_kv: bool = False  # P holds MD's KV back: RLD is predicted to finish before it could arrive
    link_bytes_per_s: float = 0.0  # the P -> MD rate the prediction assumed


def choose_pipeline(config: PolicyConfig, prompt_tokens: int, max_tokens: int, main_hit_tokens: int,
                    kv_bytes_per_token: int, estimate: Estimate, prefill_hit_tokens: int = 0) -> PipelineDecision:
    kv_tokens = max(0, prompt_tokens - 1)  # P never computes nor sends the last prompt token's KV
    computed = max(0, kv_tokens - prefill_hit_tokens)
    crossing = max(0, kv_tokens - main_hit_tokens)
    wan_bytes = crossing * kv_bytes_per_token
    link = estimate.link_bytes_per_s or config.default_link_bytes_per_s
    prefill_rate = estimate.prefill_tokens_per_s or config.default_prefill_tokens_per_s
    compute_s = (estimate.prefill_fixed_s + computed / prefill_rate) if computed else 0.0
    last_chunk = min(crossing, computed, estimate.prefill_chunk_tokens)  # crosses once P is done
    main_ready = (estimate.main_queue_s + estimate.round_trip_s
                  + max(compute_s + last_chunk * kv_bytes_per_token / link, wan_bytes / link))
    relay_ready = estimate.relay_queue_s + estimate.relay_round_trip_s + compute_s
    budget = relay_ready + config.relay_min_gain_s
    relay_finish = relay_ready + max(0, max_tokens - 1) * estimate.relay_step_s

    def decided(pipeline: Pipeline, reason: str, hold: bool = False) -> PipelineDecision:
        return PipelineDecision(pipeline, reason, main_hit_tokens, wan_bytes, main_ready, budget, relay_ready,
                                prefill_hit_tokens, relay_finish, hold, link)

    if main_ready <= budget:
        return decided(Pipeline.P_MD, "MD starts about as soon as RLD could")
    if relay_finish <= main_ready:
        return decided(Pipeline.P_RLD_MD, "short output: RLD finishes before MD's KV could arrive", hold=True)
    return decided(Pipeline.P_RLD_MD, "RLD starts meaningfully earlier than MD")


PRIOR_GAPS = 2  # RelayWatch: how many gaps RLD's measured step counts for against a request's own


@dataclass
class RelayWatch:
    """A request whose MD KV P holds back: release it once RLD, at its own pace, is predicted to
    finish later than MD could take over (the KV's crossing and a round trip) plus the gain a
    handoff must buy. An answer that stops early (EOS, a stop string) only strengthens the hold."""

    max_tokens: int
    main_kv_s: float  # from a release to MD holding its KV: the bytes over the link and the round trip
    relay_min_gain_s: float
    relay_step_s: float  # predicted, until RLD's own gaps are known
    first_token_at: float | None = None

    @classmethod
    def of(cls, decision: PipelineDecision, config: PolicyConfig, estimate: Estimate,
           max_tokens: int) -> RelayWatch:
        link = estimate.link_bytes_per_s or config.default_link_bytes_per_s
        return cls(max_tokens, decision.wan_bytes / link + estimate.round_trip_s, config.relay_min_gain_s,
                   estimate.relay_step_s)

    def should_release(self, relay_tokens: int, now_s: float) -> bool:
        """RLD has made `relay_tokens` tokens, the last at `now_s` (monotonic).

        From two gaps on, RLD's pace is the request's own mean gap, shrunk toward RLD's measured
        step as if that were PRIOR_GAPS gaps already seen: a request's first gaps are its noisiest
        (it joins RLD's batch while P, beside it, may still be prefilling), and a release cannot be
        taken back, where a hold is looked at again at the next token.
        """
        if self.first_token_at is None:
            self.first_token_at = now_s
        step = self.relay_step_s
        if relay_tokens >= 3:  # two gaps of its own
            gaps = relay_tokens - 1
            step = ((now_s - self.first_token_at) + PRIOR_GAPS * self.relay_step_s) / (gaps + PRIOR_GAPS)
        relay_left_s = max(0, self.max_tokens - relay_tokens) * step
        return relay_left_s > self.main_kv_s + self.relay_min_gain_s
