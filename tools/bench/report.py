"""Write a benchmark down: one results.json per run (mode x workload) and summary.md across runs.

Works from the JSON it writes, so a summary can be rebuilt from a results directory alone.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from tools.bench import paper
from tools.bench.modes import MODES
from tools.bench.runner import RunResult

Json = dict[str, object]
RESULTS_FILE = "results.json"
SUMMARY_FILE = "summary.md"
BASELINE_MODE = "pd-wan"


def result_json(result: RunResult) -> Json:
    w = result.workload
    return {
        "name": result.name,
        "mode": result.mode,
        "workload": {"name": w.name, "kind": w.kind, "params": w.params,
                     "planned_hit_rate": w.planned_hit_rate, "requests": len(w.requests),
                     "warmup_requests": len(w.warmup)},
        "stack": result.stack,
        "metrics": result.metrics,
        "cpu_s": result.cpu_s,
        "requests": [asdict(r) for r in result.records],
    }


def write_result(result: RunResult, out_dir: Path) -> Path:
    path = out_dir / result.name / RESULTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_json(result), indent=1) + "\n")
    return path


def load_results(out_dir: Path) -> list[Json]:
    """Every run under out_dir, by workload, then in the order modes are listed in MODES."""
    order = {name: i for i, name in enumerate(MODES)}
    results = [json.loads(p.read_text()) for p in out_dir.glob(f"*/{RESULTS_FILE}")]
    return sorted(results, key=lambda r: (r["workload"]["name"], order.get(r["mode"], len(order)), r["mode"]))


def _ms(d: object, key: str) -> str:
    value = d.get(key) if isinstance(d, dict) else None
    return "-" if value is None else f"{value:,.0f}"


def _mb(n: object) -> str:
    return "-" if n is None else f"{n / 1e6:,.2f}"


def _pct(x: object) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def latency_table(results: list[Json]) -> str:
    lines = [("| workload | mode | done/sent | req/s | out tok/s | goodput req/s | TTFT mean | TTFT P50 | TTFT P90 "
              "| TTFT P99 | TPOT mean | TPOT P90 | ITL mean | ITL P99 | E2E mean | E2E P90 | E2E P99 |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        m = r["metrics"]
        req = m["requests"]
        t, p, i, e = m["ttft_ms"], m["tpot_ms"], m["itl_ms"], m["e2e_ms"]
        lines.append(
            f"| {r['workload']['name']} | {r['mode']} | {req['completed']}/{req['sent']} "
            f"| {m['request_throughput']:.3f} | {m['output_token_throughput']:.1f} | {m['goodput']:.3f} "
            f"| {_ms(t, 'mean')} | {_ms(t, 'median')} | {_ms(t, 'p90')} | {_ms(t, 'p99')} "
            f"| {_ms(p, 'mean')} | {_ms(p, 'p90')} | {_ms(i, 'mean')} | {_ms(i, 'p99')} "
            f"| {_ms(e, 'mean')} | {_ms(e, 'p90')} | {_ms(e, 'p99')} |")
    return "\n".join(lines)


def _pipelines(counts: dict[str, int]) -> str:
    return ", ".join(f"{p} {n}" for p, n in sorted(counts.items())) or "-"


def pdd_table(results: list[Json]) -> str:
    lines = [("| workload | mode | pipelines | planned hit | P hit | MD hit | KV MD got MB | KV MD got KB/req "
              "| emulator A→B MB | DRC saved MB | RLD tokens | RLD-only reqs | RLD-only WAN / KV | handoffs "
              "| stall mean ms | stall max ms | cost | BCR |"),
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        m = r["metrics"]
        d = m["pdd"]
        done = m["requests"]["completed"]
        per_req = f"{d['wan_kv_bytes'] / done / 1e3:,.1f}" if done else "-"
        bcr = "-" if m["bcr"] is None else f"{m['bcr']:.4f}"
        lines.append(
            f"| {r['workload']['name']} | {r['mode']} | {_pipelines(d['pipelines'])} | {_pct(d['planned_hit_rate'])} "
            f"| {_pct(d['prefill_hit_rate'])} | {_pct(d['main_hit_rate'])} | {_mb(d['wan_kv_bytes'])} | {per_req} "
            f"| {_mb(d['wan_emulator_a_to_b_bytes'])} | {_mb(d['drc_saved_bytes'])} | {_pct(d['relay_token_share'])} "
            f"| {d['finished_by_relay']} | {_relay_only_wan(d)} | {d['handoffs']} "
            f"| {_ms(d['handoff_stall_ms'], 'mean')} "
            f"| {_ms(d['handoff_stall_ms'], 'max')} | {m['cost']['total']:g} | {bcr} |")
    return "\n".join(lines)


def _relay_only_wan(d: Json) -> str:
    """WAN bytes P sent toward MD for requests RLD finished alone, against the KV MD lacked of them."""
    sent, owed = d.get("relay_finished_wan_bytes"), d.get("relay_finished_kv_bytes")
    if sent is None or owed is None:
        return "-"
    backfill = d.get("backfill_wan_bytes")
    after = f"; then {_mb(backfill)} MB backfilled" if backfill else ""
    return f"{_mb(sent)} MB / {_mb(owed)} MB ({_pct(sent / owed) if owed else '-'}){after}"


def cpu_table(results: list[Json]) -> str:
    """CPU seconds each process used over the measured replay, and the cores they kept busy on average."""
    names = sorted({name for r in results for name in r.get("cpu_s") or {}})
    if not names:
        return ""
    lines = ["| workload | mode | replay s | " + " | ".join(names) + " | total | cores busy |",
             "|---|---|---:|" + "---:|" * (len(names) + 2)]
    for r in results:
        used = r.get("cpu_s") or {}
        if not used:
            continue
        total, wall = sum(used.values()), r["metrics"]["duration_s"]
        cells = " | ".join(f"{used[n]:,.1f}" if n in used else "-" for n in names)
        busy = f"{total / wall:.2f}" if wall else "-"
        lines.append(f"| {r['workload']['name']} | {r['mode']} | {wall:,.1f} | {cells} | {total:,.1f} | {busy} |")
    return "\n".join(lines)


def _change(new: object, old: object) -> str:
    if new is None or old is None or not old:
        return "-"
    return f"{100 * (new / old - 1):+.1f}%"


def _sent_bytes(m: Json) -> int:
    d = m["pdd"]
    return d["wan_kv_bytes"] if d["wan_emulator_a_to_b_bytes"] is None else d["wan_emulator_a_to_b_bytes"]


def baseline_table(results: list[Json], baseline: str = BASELINE_MODE) -> str:
    """Each mode against the baseline mode of the same workload (the paper's cross-DC PD)."""
    base = {r["workload"]["name"]: r["metrics"] for r in results if r["mode"] == baseline}
    lines = ["| workload | mode | TTFT mean | TTFT P90 | TTFT P99 | E2E mean | KV sent to MD | goodput | BCR |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        b = base.get(r["workload"]["name"])
        if b is None or r["mode"] == baseline:
            continue
        m = r["metrics"]
        t, bt = m["ttft_ms"], b["ttft_ms"]
        lines.append(f"| {r['workload']['name']} | {r['mode']} | {_change(t['mean'], bt['mean'])} "
                     f"| {_change(t['p90'], bt['p90'])} | {_change(t['p99'], bt['p99'])} "
                     f"| {_change(m['e2e_ms']['mean'], b['e2e_ms']['mean'])} "
                     f"| {_change(_sent_bytes(m), _sent_bytes(b))} "
                     f"| {_change(m['goodput'], b['goodput'])} | {_change(m['bcr'], b['bcr'])} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def summary_markdown(results: list[Json], skipped: dict[str, str]) -> str:
    first = results[0]["stack"] if results else {}
    parts = ["# pdd bench", ""]
    if first:
        parts += [(f"Model {first.get('model')} ({first.get('dtype')}). Times in ms; goodput and BCR use the SLOs "
                   f"{results[0]['metrics']['slo']}; BCR = goodput / cost of the instances the mode uses."),
                  ("KV MD got: the KV bytes MD reported receiving (summed over requests); emulator A→B: what "
                   "crossed the emulated WAN on MD's KV route, including transfers MD dropped because RLD "
                   "finished the request first (RLD-only requests) and frame headers. RLD-only WAN / KV: what P "
                   "sent toward MD for the requests RLD finished alone before it finished, against the KV MD "
                   "lacked of them; then what P sent MD of them in the background afterwards, for MD's DRC "
                   "(the backfill, gateway --backfill-link-share; the emulator's bytes include it)."), ""]
        if first.get("engine") == "sim":
            parts += [_sim_note(first), ""]
    parts += ["## Latency and throughput", "", latency_table(results), "",
              "## PDD", "", pdd_table(results), ""]
    if cpu := cpu_table(results):
        parts += ["## CPU", "", ("CPU seconds (user + system, from /proc) each process and its children used during "
                                 "the measured replay; client is the bench process itself. Cores busy: their sum "
                                 "over the replay's wall time."), "", cpu, ""]
    if against := baseline_table(results):
        parts += [f"## Change against {BASELINE_MODE} (cross-datacenter PD, whole KV over the WAN)", "",
                  "KV sent to MD counts the emulator's A→B bytes where there is a WAN; '-' where the baseline is 0.",
                  "", against, ""]
    if paper.applies(results):
        parts += ["## Against the PDD paper", "",
                  ("A goal is judged on the session workload, from this one run; figures are this machine's "
                   "(RLD, MD and P share its cores), so ratios within the run are what compares."), "",
                  paper.paper_table(results), ""]
    if skipped:
        parts += ["## Not run", ""] + [f"- `{mode}`: {reason}" for mode, reason in skipped.items()] + [""]
    return "\n".join(parts)


def _sim_note(stack: Json) -> str:
    """What a simulated run's figures are: which engine timing, which shape, and what its bytes mean."""
    timing = f"profile {stack['sim_profile']}" if stack.get("sim_profile") else f"{stack.get('sim_device')}'s roofline"
    note = f"Simulated engine (docs/sim.md), steps timed by {timing}"
    if own := stack.get("sim_devices"):
        note += " (" + ", ".join(f"{role} on {device}'s" for role, device in own.items()) + ")"
    if instances := {r: n for r, n in (stack.get("instances") or {}).items() if n > 1}:
        note += ", " + ", ".join(f"{n} {role} instances" for role, n in instances.items())
    if stack.get("sim_shape"):
        note += f", serving the shape {stack['sim_shape']}"
    scale = stack.get("kv_byte_scale") or 1
    if scale != 1:
        note += (f". **KV bytes scaled by 1/{scale}**: every KV byte figure here is a carried byte, the modelled "
                 f"model's are {scale}× as many, and the emulated WAN ran at 1/{scale} of the line rate given "
                 "(transfer times are the modelled ones)")
    return note + "."


def write_summary(out_dir: Path, skipped: dict[str, str]) -> Path:
    path = out_dir / SUMMARY_FILE
    path.write_text(summary_markdown(load_results(out_dir), skipped))
    return path
