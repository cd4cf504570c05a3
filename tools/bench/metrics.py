"""Turn request records into the numbers of `vllm bench serve` plus PDD's own.

vllm's: TTFT, TPOT ((E2E - TTFT) / (output tokens - 1)), ITL (every gap between two tokens),
E2E latency (mean, median, P90, P99, in ms), request and token throughput, goodput (requests per
second that meet every SLO set). PDD's: KV bytes over the WAN, bytes MD's DRC saved, RLD's share of
tokens, the requests RLD finished alone and the WAN bytes P sent toward MD for them, the handoff
stall, P and MD hit rates (token-weighted), and BCR (goodput per unit of cost).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from tools.bench.config import Costs, Slo
from tools.bench.replay import RequestRecord

Json = dict[str, object]
PERCENTILES = (50, 90, 99)


def distribution_ms(values_s: Sequence[float]) -> Json:
    """mean, median, p90, p99, max (and n) in milliseconds; None values when there are none."""
    if not values_s:
        return {"n": 0, "mean": None, "median": None, "p90": None, "p99": None, "max": None}
    ms = np.asarray(values_s, dtype=float) * 1000
    p50, p90, p99 = (float(np.percentile(ms, p)) for p in PERCENTILES)
    return {"n": len(ms), "mean": float(ms.mean()), "median": p50, "p90": p90, "p99": p99, "max": float(ms.max())}


def tpot_s(rec: RequestRecord) -> float | None:
    if rec.ttft_s is None or rec.e2e_s is None or rec.completion_tokens < 2:
        return None
    return (rec.e2e_s - rec.ttft_s) / (rec.completion_tokens - 1)


def handoff_stall_s(rec: RequestRecord) -> float | None:
    """The largest of the gaps just before and just after the first MD token that follows RLD's."""
    tiers, times = rec.tiers, rec.token_times_s
    k = next((i for i in range(1, len(tiers)) if tiers[i] == "main" and tiers[i - 1] == "relay"), None)
    if k is None:
        return None
    gaps = [times[i] - times[i - 1] for i in (k, k + 1) if i < len(times)]
    return max(gaps)


def meets_slo(rec: RequestRecord, slo: Slo) -> bool:
    if not rec.ok or rec.ttft_s is None or rec.e2e_s is None:
        return False
    tpot = tpot_s(rec)
    return ((slo.ttft_ms is None or rec.ttft_s * 1000 <= slo.ttft_ms)
            and (slo.tpot_ms is None or tpot is None or tpot * 1000 <= slo.tpot_ms)
            and (slo.e2e_ms is None or rec.e2e_s * 1000 <= slo.e2e_ms))


def summarize(records: Sequence[RequestRecord], duration_s: float, *, slo: Slo, costs: Costs,
              instances: dict[str, int], kv_bytes_per_token: int,
              wan_emulator_bytes: int | None = None,
              relay_finished_bytes: tuple[int, int, int] | None = None) -> Json:
    """relay_finished_bytes: P's (bytes sent toward MD before RLD finished, KV MD lacked, bytes sent
    after, in the background, for MD's DRC) for requests RLD finished alone."""
    ok = [r for r in records if r.ok]
    sent = [r for r in records if r.sent_s is not None]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    completion_tokens = sum(r.completion_tokens for r in ok)
    good = sum(meets_slo(r, slo) for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    relay_tokens = sum(r.tokens_by_tier.get("relay", 0) for r in ok)
    stalls = [s for s in map(handoff_stall_s, ok) if s is not None]
    cost = costs.of(instances)
    goodput = per_s(good)
    return {
        "requests": {"planned": len(records), "sent": len(sent), "completed": len(ok),
                     "failed": len(sent) - len(ok), "good": good},
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(completion_tokens),
        "total_token_throughput": per_s(prompt_tokens + completion_tokens),
        "goodput": goodput,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms},
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([t for t in map(tpot_s, ok) if t is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in np.diff(r.token_times_s).tolist()]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "pdd": {
            "wan_kv_bytes": sum(r.main_kv_bytes for r in ok),
            "wan_emulator_a_to_b_bytes": wan_emulator_bytes,
            "drc_saved_bytes": sum(r.main_hit_tokens for r in ok) * kv_bytes_per_token,
            "kv_bytes_per_token": kv_bytes_per_token,
            "pipelines": dict(Counter(r.pipeline for r in ok)),
            "finished_by_relay": sum(1 for r in ok if r.tokens_by_tier.get("relay") == r.completion_tokens > 0),
            "relay_finished_wan_bytes": None if relay_finished_bytes is None else relay_finished_bytes[0],
            "relay_finished_kv_bytes": None if relay_finished_bytes is None else relay_finished_bytes[1],
            "backfill_wan_bytes": None if relay_finished_bytes is None else relay_finished_bytes[2],
            "relay_tokens": relay_tokens,
            "relay_token_share": relay_tokens / completion_tokens if completion_tokens else 0.0,
            "handoffs": len(stalls),
            "handoff_stall_ms": distribution_ms(stalls),
            "planned_hit_rate": _ratio(sum(r.planned_hit_tokens for r in ok), prompt_tokens),
            "prefill_hit_rate": _ratio(sum(r.prefill_hit_tokens for r in ok), prompt_tokens),
            "main_hit_rate": _ratio(sum(r.main_hit_tokens for r in ok), prompt_tokens),
            "prefill_ms": distribution_ms([r.prefill_s for r in ok if r.prefill_s is not None]),
        },
        "cost": {"instances": dict(instances), "total": cost},
        "bcr": goodput / cost if cost else None,
    }


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
