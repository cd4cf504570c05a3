"""PDD's pipeline choice: P-MD when MD can start in time, P-RLD-MD otherwise. Plain logic.

The gateway predicts when MD could emit the first token: P must compute the tokens MD lacks
and send their KV over the WAN (the two overlap, since KV streams out chunk by chunk), after
MD's queue, plus P's fixed cost per prefill and a round trip to MD (the assign's answer, then
the KV's last byte). If that fits the TTFT budget (a fraction of the TTFT SLO) the request goes P-MD;
otherwise RLD covers the wait. P-RLD is never planned, except by the anomalous-traffic filter:
a request so short (max_tokens at most `skip_wan_max_tokens`) that RLD will finish it before any
KV could reach MD skips the WAN transfer from the start (counted: it leaves MD's cache behind).
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.names import Pipeline


@dataclass(frozen=True)
class PolicyConfig:
    ttft_slo_s: float
    budget_fraction: float
    skip_wan_max_tokens: int  # 0: never skip
    default_link_bytes_per_s: float
    default_prefill_tokens_per_s: float

    @property
    def budget_s(self) -> float:
        """How soon MD must be predicted ready for P-MD."""
        return self.ttft_slo_s * self.budget_fraction


@dataclass(frozen=True)
class LinkEstimate:
    """What the gateway currently believes about one MD's path."""

    link_bytes_per_s: float | None  # measured by P (moving average); None before any sample
    prefill_tokens_per_s: float | None  # measured from P's reports
    main_queue_s: float  # work already waiting on that MD
    prefill_fixed_s: float = 0.0  # P's cost per prefill whatever its length (fitted)
    round_trip_s: float = 0.0  # gateway <-> MD: the assign's answer, then the KV's last byte, each half of it


@dataclass(frozen=True)
class PipelineDecision:
    pipeline: Pipeline
    reason: str
    main_hit_tokens: int
    wan_bytes: int
    predicted_main_ready_s: float
    budget_s: float


def choose_pipeline(config: PolicyConfig, prompt_tokens: int, max_tokens: int, main_hit_tokens: int,
                    kv_bytes_per_token: int, estimate: LinkEstimate) -> PipelineDecision:
    missing = max(0, prompt_tokens - 1 - main_hit_tokens)  # P never sends the last prompt token's KV
    wan_bytes = missing * kv_bytes_per_token
    link = estimate.link_bytes_per_s or config.default_link_bytes_per_s
    prefill_rate = estimate.prefill_tokens_per_s or config.default_prefill_tokens_per_s
    predicted = (estimate.main_queue_s + estimate.round_trip_s + estimate.prefill_fixed_s
                 + max(missing / prefill_rate, wan_bytes / link))
    budget = config.budget_s
    if config.skip_wan_max_tokens and max_tokens <= config.skip_wan_max_tokens and predicted > budget:
        return PipelineDecision(Pipeline.P_RLD, "short output: RLD finishes before MD could start", main_hit_tokens,
                                0, predicted, budget)
    if predicted <= budget:
        return PipelineDecision(Pipeline.P_MD, "MD can start within the TTFT budget", main_hit_tokens, wan_bytes,
                                predicted, budget)
    return PipelineDecision(Pipeline.P_RLD_MD, "MD would start too late: RLD covers the wait", main_hit_tokens,
                            wan_bytes, predicted, budget)
