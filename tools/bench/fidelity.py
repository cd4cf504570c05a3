"""The simulated engine against the real one: two sets of `pdd bench` results of the same workloads and
modes (one with --engine real, one with --engine sim), joined by workload and mode, as a markdown table
of TTFT mean and P90, TPOT mean, median ITL, the pipelines chosen and the CPU the stack used.

    python -m tools.bench.fidelity --real DIR [DIR ...] --sim DIR [DIR ...] [--tolerance 0.15] \
        [--timelines FILE ...]

With the real run's engine timelines (`--service-flags prefill=--engine-timeline=FILE`, the same for
relay and main), it also says how much of each tier's step time was spent waiting for a core: the
steps' wall time over their engine thread's CPU time, within each run's window. The sim's steps sleep
their profiled time, measured with the tier alone on a core; this ratio is what sharing the cores added.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from shared.engine_timeline import read_timeline
from tools.bench.report import load_results

Json = dict[str, object]


def _by_run(dirs: Sequence[Path]) -> dict[tuple[str, str], Json]:
    return {(r["workload"]["name"], r["mode"]): r for d in dirs for r in load_results(d)}  # type: ignore[index]


def _dev(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or not real else sim / real - 1


def _cell(real: float | None, sim: float | None, tolerance: float) -> tuple[str, bool]:
    """'real / sim (±x %)', and whether the deviation is within tolerance."""
    dev = _dev(sim, real)
    if dev is None or real is None or sim is None:
        return "-", False
    within = abs(dev) <= tolerance
    mark = "" if within else "**"
    return f"{real:,.0f} / {sim:,.0f} ({mark}{100 * dev:+.0f} %{mark})", within


def _pipelines(m: Json) -> str:
    counts: dict[str, int] = m["pdd"]["pipelines"]  # type: ignore[index]
    return ", ".join(f"{p} {n}" for p, n in sorted(counts.items())) or "-"


def _cores(r: Json) -> str:
    used: dict[str, float] = r.get("cpu_s") or {}  # type: ignore[assignment]
    wall = r["metrics"]["duration_s"]  # type: ignore[index]
    return f"{sum(used.values()) / wall:.2f}" if used and wall else "-"


def fidelity_table(real: dict[tuple[str, str], Json], sim: dict[tuple[str, str], Json],
                   tolerance: float = 0.15) -> tuple[str, int, int]:
    """The table, and how many of its latency cells are within tolerance out of how many."""
    lines = ["| workload | mode | TTFT mean ms real / sim | TTFT P90 | TPOT mean | ITL median | pipelines real "
             "| pipelines sim | RLD tokens real / sim | cores busy real / sim |",
             "|---|---|---:|---:|---:|---:|---|---|---:|---:|"]
    within = cells = 0
    for key in sorted(real.keys() & sim.keys()):
        r, s = real[key]["metrics"], sim[key]["metrics"]
        row = []
        for metric, stat in (("ttft_ms", "mean"), ("ttft_ms", "p90"), ("tpot_ms", "mean"), ("itl_ms", "median")):
            shown, ok = _cell(r[metric][stat], s[metric][stat], tolerance)  # type: ignore[index]
            row.append(shown)
            if metric != "itl_ms":
                within, cells = within + ok, cells + 1
        share = (f"{100 * r['pdd']['relay_token_share']:.1f} % / "  # type: ignore[index]
                 f"{100 * s['pdd']['relay_token_share']:.1f} %")  # type: ignore[index]
        lines.append(f"| {key[0]} | {key[1]} | {' | '.join(row)} | {_pipelines(r)} | {_pipelines(s)} | {share} "
                     f"| {_cores(real[key])} / {_cores(sim[key])} |")
    return "\n".join(lines), within, cells


def cpu_table(real: dict[tuple[str, str], Json], sim: dict[tuple[str, str], Json]) -> str:
    """CPU seconds per process over each replay, real / sim."""
    names = sorted({n for runs in (real, sim) for r in runs.values() for n in (r.get("cpu_s") or {})})  # type: ignore[union-attr]
    lines = ["| workload | mode | " + " | ".join(names) + " | total |", "|---|---|" + "---:|" * (len(names) + 1)]
    for key in sorted(real.keys() & sim.keys()):
        a: dict[str, float] = real[key].get("cpu_s") or {}  # type: ignore[assignment]
        b: dict[str, float] = sim[key].get("cpu_s") or {}  # type: ignore[assignment]
        cells = [f"{a.get(n, 0):,.0f} / {b.get(n, 0):,.0f}" for n in names]
        lines.append(f"| {key[0]} | {key[1]} | {' | '.join(cells)} | {sum(a.values()):,.0f} / {sum(b.values()):,.0f} |")
    return "\n".join(lines)


def _window(run: Json) -> tuple[float, float]:
    """Wall-clock seconds from the run's first send to its last answer."""
    done = [r for r in run["requests"] if r["sent_at"] is not None]  # type: ignore[attr-defined]
    return (min(r["sent_at"] for r in done),
            max(r["sent_at"] + (r["e2e_s"] or 0.0) for r in done))


def step_waits(real: dict[tuple[str, str], Json], timelines: Sequence[Path]) -> str:
    """Per run and tier (a timeline file each): the steps' wall time over their CPU time in the run's window."""
    steps = {path.stem: [e for e in read_timeline(path) if e["kind"] == "step"] for path in timelines}
    lines = ["| workload | mode | " + " | ".join(f"{name}: steps, wall / CPU" for name in steps) + " |",
             "|---|---|" + "---:|" * len(steps)]
    for key in sorted(real):
        t0, t1 = _window(real[key])
        cells = []
        for events in steps.values():
            inside = [e for e in events if t0 * 1e9 <= e["t_ns"] <= t1 * 1e9]  # type: ignore[operator]
            wall = sum(e["end_ns"] - e["t_ns"] for e in inside) / 1e9  # type: ignore[operator]
            cpu = sum(e["cpu_ns"] for e in inside) / 1e9  # type: ignore[misc]
            cells.append(f"{len(inside)}, {wall:,.1f} / {cpu:,.1f} s = {wall / cpu:.2f}" if cpu else "-")
        if any(c != "-" for c in cells):
            lines.append(f"| {key[0]} | {key[1]} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", type=Path, nargs="+", required=True, help="results directories, real engine")
    parser.add_argument("--sim", type=Path, nargs="+", required=True, help="results directories, simulated engine")
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--timelines", type=Path, nargs="*", default=[],
                        help="the real run's engine timelines (one file per tier), for the time steps waited")
    args = parser.parse_args(argv)
    real, sim = _by_run(args.real), _by_run(args.sim)
    table, within, cells = fidelity_table(real, sim, args.tolerance)
    print(table)
    print(f"\n{within} of {cells} latency figures (TTFT mean, P90, TPOT mean) within {100 * args.tolerance:.0f} %; "
          "bold: outside\n")
    print(cpu_table(real, sim))
    if args.timelines:
        print("\n" + step_waits(real, args.timelines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
