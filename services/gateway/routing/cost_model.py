"""The cost model: what the gateway has measured about the stack, for the policy's predictions. Plain logic.

- P's prefill time as a fixed cost plus a per-token cost, fitted by least squares to P's recent
  PrefillDone reports (a rate alone would call a 30-token prefill nearly free, which it is not).
- The round trip to each instance, from the liveness pings (services/gateway/routing/liveness.py).
- The KV link from each P to each MD: the rate MD saw the KV arrive at (KVReceived), smoothed.
- One decode step per tier (RLD, MD): the median gap between two tokens of one request from that
  tier, over its recent tokens (a median, so a handoff or a queue wait does not count as a step).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

PREFILL_SAMPLES = 64
STEP_SAMPLES = 256
RTT_ALPHA = 0.2
LINK_ALPHA = 0.3


@dataclass(frozen=True)
class PrefillModel:
    fixed_s: float
    tokens_per_s: float

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + tokens / self.tokens_per_s


def fit_prefill(samples: list[tuple[int, float]]) -> PrefillModel | None:
    """Least squares of seconds = fixed + tokens / rate; None until two different sizes were seen.
    A negative fixed cost (noise) is clamped to 0 with the rate refitted through the origin."""
    if len({n for n, _ in samples}) < 2:
        return None
    count = len(samples)
    mean_n = sum(n for n, _ in samples) / count
    mean_s = sum(s for _, s in samples) / count
    var_n = sum((n - mean_n) ** 2 for n, _ in samples)
    slope = sum((n - mean_n) * (s - mean_s) for n, s in samples) / var_n
    fixed = mean_s - slope * mean_n
    if slope <= 0:
        return None
    if fixed < 0:
        slope = sum(n * s for n, s in samples) / sum(n * n for n, _ in samples)
        fixed = 0.0
    return PrefillModel(fixed, 1.0 / slope)


class CostModel:
    def __init__(self) -> None:
        self._prefills: deque[tuple[int, float]] = deque(maxlen=PREFILL_SAMPLES)
        self.prefill: PrefillModel | None = None
        self.round_trip_s: dict[str, float] = {}  # instance id -> smoothed ping round trip
        self.link_bytes_per_s: dict[tuple[str, str], float] = {}  # (P, decoder) instance ids -> smoothed rate
        self._steps: dict[str, deque[float]] = {}  # tier -> recent gaps per token

    def observe_prefill(self, computed_tokens: int, prefill_s: float) -> None:
        if computed_tokens <= 0 or prefill_s <= 0:
            return
        self._prefills.append((computed_tokens, prefill_s))
        self.prefill = fit_prefill(list(self._prefills))

    def observe_round_trip(self, instance_id: str, seconds: float) -> None:
        _smooth(self.round_trip_s, instance_id, seconds, RTT_ALPHA)

    def observe_link(self, prefill_id: str, decoder_id: str, bytes_per_s: float) -> None:
        _smooth(self.link_bytes_per_s, (prefill_id, decoder_id), bytes_per_s, LINK_ALPHA)

    def observe_tokens(self, tier: str, tokens: int, gap_s: float | None) -> None:
        """A chunk of `tokens` tokens of one attempt from `tier`, `gap_s` after its previous chunk from
        that tier (None: its first, which is no gap)."""
        if gap_s is not None and tokens > 0:
            self._steps.setdefault(tier, deque(maxlen=STEP_SAMPLES)).append(gap_s / tokens)

    def step_s(self, tier: str) -> float | None:
        """The median gap between two tokens from `tier`; None before any."""
        gaps = self._steps.get(tier)
        return statistics.median(gaps) if gaps else None


def _smooth(averages: dict, key: object, sample: float, alpha: float) -> None:
    """An exponential moving average per key; the first sample starts it."""
    old = averages.get(key)
    averages[key] = sample if old is None else old + alpha * (sample - old)
