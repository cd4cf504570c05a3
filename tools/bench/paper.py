"""pdd bench against the PDD paper: the presets that put pdd in the paper's regime (`--scenario
paper`) and at the paper's scale (`--scenario paper-scale`), and the side-by-side table of the
paper's figures, the goals of issues 17 and 45 and pdd's own.

The regime: SmolLM2 over a 100 Mbit/s, 30 ms RTT link; agent sessions of 1,024-token prompts,
128-token answers and 8 turns at a 90 % mean hit, where a turn's missing suffix crosses in a
fraction of a second against seconds of decoding; and the Mooncake conversation trace with its
own answer lengths, capped at 128 tokens. Works from results JSON alone, like report.py.

At the paper's scale: the simulated engine serving Llama-3-70B's shape, P on H800's roofline, RLD
and MD on H20's, 2 P, 1 RLD and 4 MD, a 10 Gbit/s link of 30 ms RTT (the paper's class of link; it
states no single figure we could find), KV and line rate scaled by 1/32 so this machine's emulator
carries it, and a few hundred requests per workload.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

Json = dict[str, object]
SESSIONS = "agentic-h0.90"
TRACE = "mooncake"

# argparse dest -> value: what `--scenario paper` sets wherever the command line did not give the flag
PRESET: dict[str, object] = {
    "modes": ("pdd", "pd-local", "pd-wan", "pd-wan-drc"), "workloads": ("agentic", "mooncake"),
    "model": "smollm2", "hit_rate": 0.9, "prefix_tokens": 1024, "output_tokens": 128, "turns_per_session": 8,
    "max_context_tokens": 3200, "max_requests": 16, "request_rate": 0.2, "max_concurrency": 4,
    "wan_bandwidth_mbps": 100.0, "wan_rtt_ms": 30.0, "slo_ttft_ms": 2000.0, "slo_tpot_ms": 150.0,
    "max_input_tokens": 1024, "max_output_tokens": 128,
}
# the paper's model class, GPUs, link and load, on simulated engines (docs/benchmarks.md, "At the paper's scale")
SCALE_PRESET: dict[str, object] = {
    **PRESET, "engine": "sim", "sim_shape": "llama-70b", "dtype": "bfloat16", "sim_device": "h20",
    "sim_devices": {"prefill": "h800"}, "instances": {"prefill": 2, "relay": 1, "main": 4},
    "wan_bandwidth_mbps": 10_000.0, "kv_byte_scale": 32, "max_requests": 200, "request_rate": 4.0,
    "max_concurrency": 64, "block_tokens": 32, "max_input_tokens": 2048, "time_scale": 0.75,
}
SCENARIOS: dict[str, dict[str, object]] = {"paper": PRESET, "paper-scale": SCALE_PRESET}


@dataclass(frozen=True)
class Row:
    what: str
    paper: str
    goal: str
    measure: Callable[[dict[str, Json]], tuple[str, float | None]]  # runs of a workload by mode -> (shown, value)
    met: Callable[[float], bool] | None = None


def _m(runs: dict[str, Json], mode: str) -> Json | None:
    run = runs.get(mode)
    return run["metrics"] if run else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _sent(m: Json) -> int:
    d = m["pdd"]
    return d["wan_kv_bytes"] if d["wan_emulator_a_to_b_bytes"] is None else d["wan_emulator_a_to_b_bytes"]


def _ttft_vs(base: str) -> Callable[[dict[str, Json]], tuple[str, float | None]]:
    def measure(runs: dict[str, Json]) -> tuple[str, float | None]:
        pdd, other = _m(runs, "pdd"), _m(runs, base)
        if pdd is None or other is None:
            return "-", None
        ratios = {q: _ratio(pdd["ttft_ms"][q], other["ttft_ms"][q]) for q in ("p99", "p90", "mean")}
        if None in ratios.values():
            return "-", None
        shown = ", ".join(f"{q.upper() if q != 'mean' else q} {r:.2f}× ({100 * (r - 1):+.0f} %)"
                          for q, r in ratios.items())
        return shown, ratios["p99"]
    return measure


def _wan_bytes(runs: dict[str, Json]) -> tuple[str, float | None]:
    pdd, wan = _m(runs, "pdd"), _m(runs, "pd-wan")
    if pdd is None or wan is None or not _sent(pdd):
        return "-", None
    fewer = _sent(wan) / _sent(pdd)
    return f"{fewer:.1f}× fewer ({_sent(pdd) / 1e6:,.1f} MB against {_sent(wan) / 1e6:,.1f} MB)", 1 / fewer


def _relay_share(runs: dict[str, Json]) -> tuple[str, float | None]:
    pdd = _m(runs, "pdd")
    if pdd is None:
        return "-", None
    share = pdd["pdd"]["relay_token_share"]
    return f"{100 * share:.1f} %", share


def _relay_alone(runs: dict[str, Json]) -> tuple[str, float | None]:
    pdd = _m(runs, "pdd")
    if pdd is None or not pdd["requests"]["completed"]:
        return "-", None
    alone, done = pdd["pdd"]["finished_by_relay"], pdd["requests"]["completed"]
    return f"{100 * alone / done:.0f} % ({alone} of {done})", alone / done


def _relay_only_wan(runs: dict[str, Json]) -> tuple[str, float | None]:
    pdd = _m(runs, "pdd")
    if pdd is None or pdd["pdd"].get("relay_finished_kv_bytes") is None:
        return "-", None
    sent, owed = pdd["pdd"]["relay_finished_wan_bytes"], pdd["pdd"]["relay_finished_kv_bytes"]
    if not owed:
        return "no RLD-only request with an MD", None
    backfill = pdd["pdd"].get("backfill_wan_bytes") or 0
    after = f"; then {backfill / 1e6:,.2f} MB backfilled in the background" if backfill else ""
    return f"{100 * sent / owed:.1f} % ({sent / 1e6:,.2f} of {owed / 1e6:,.2f} MB){after}", sent / owed


def _recompute(runs: dict[str, Json]) -> tuple[str, float | None]:
    run = runs.get("pdd")
    extends = [1000 * r["handoff"]["extend_s"] for r in (run or {}).get("requests", ())
               if r.get("ok") and r.get("handoff")]
    if not extends:
        return "no handoff", None
    std = statistics.pstdev(extends)
    waits = [1000 * r["handoff"].get("extend_wait_s", 0.0) for r in run["requests"] if r.get("ok") and r.get("handoff")]
    return (f"mean {statistics.mean(extends):.0f}, max {max(extends):.0f}, std {std:.1f} ms ({len(extends)}); "
            f"of it waiting for MD's step: mean {statistics.mean(waits):.0f}, max {max(waits):.0f} ms"), None


def _stall(runs: dict[str, Json]) -> tuple[str, float | None]:
    pdd = _m(runs, "pdd")
    if pdd is None or not pdd["pdd"]["handoffs"] or not pdd["itl_ms"]["median"]:
        return "no handoff", None
    stall, itl = pdd["pdd"]["handoff_stall_ms"], pdd["itl_ms"]["median"]
    return (f"P90 {stall['p90'] / itl:.2f}×, max {stall['max'] / itl:.2f}× the median ITL ({itl:.0f} ms; "
            f"{pdd['pdd']['handoffs']} handoffs)"), stall["p90"] / itl


def _hits(runs: dict[str, Json]) -> tuple[str, float | None]:
    pdd = _m(runs, "pdd")
    if pdd is None:
        return "-", None
    p, md = pdd["pdd"]["prefill_hit_rate"], pdd["pdd"]["main_hit_rate"]
    return f"P {100 * p:.1f} %, MD {100 * md:.1f} % ({100 * (p - md):+.1f} points)", abs(p - md)


ROWS = (
    Row("TTFT vs cross-DC PD (pd-wan)", "−51.5 %", "P99 ≤ 0.5×", _ttft_vs("pd-wan"), lambda r: r <= 0.5),
    Row("TTFT vs the DRC alone (pd-wan-drc)", "—", "P99 ≤ 0.9×", _ttft_vs("pd-wan-drc"), lambda r: r <= 0.9),
    Row("TTFT vs same-datacenter PD (pd-local)", "—", "P99 ≤ 1.2×", _ttft_vs("pd-local"), lambda r: r <= 1.2),
    Row("WAN bytes vs pd-wan at 90 % hit", "up to 10× fewer", "≤ 1/8", _wan_bytes, lambda r: r <= 1 / 8),
    Row("share of tokens made by RLD", "6.2 %", "3–10 % in sessions", _relay_share, lambda r: 0.03 <= r <= 0.10),
    Row("requests RLD finished alone", "~3–4 %", "—", _relay_alone),
    Row("WAN bytes for RLD-only requests / their KV", "—", "≤ 10 %", _relay_only_wan, lambda r: r <= 0.10),
    Row("handoff recompute (MD's extend pass)", "max 321 ms, std 4.8 ms", "—", _recompute),
    Row("handoff stall / median ITL", "—", "≤ 2×", _stall, lambda r: r <= 2.0),
    Row("P hit vs MD hit", "—", "within 2 points", _hits, lambda r: r <= 0.02),
)


def paper_table(results: list[Json]) -> str:
    """The paper's figures, the goals, and pdd's on the session workload and the trace; a goal is
    judged on the sessions, from this one run."""
    by_workload: dict[str, dict[str, Json]] = {}
    for r in results:
        by_workload.setdefault(r["workload"]["name"], {})[r["mode"]] = r
    sessions, trace = by_workload.get(SESSIONS, {}), by_workload.get(TRACE, {})
    lines = ["| | paper | goal | pdd, sessions | goal met | pdd, Mooncake trace |", "|---|---|---|---|---|---|"]
    for row in ROWS:
        shown, value = row.measure(sessions)
        verdict = "—" if row.met is None else ("n/a" if value is None else ("yes" if row.met(value) else "**no**"))
        lines.append(f"| {row.what} | {row.paper} | {row.goal} | {shown} | {verdict} | {row.measure(trace)[0]} |")
    return "\n".join(lines)


def applies(results: list[Json]) -> bool:
    """The runs include pdd on the session workload or the trace: the table has something to say."""
    return any(r["mode"] == "pdd" and r["workload"]["name"] in (SESSIONS, TRACE) for r in results)
