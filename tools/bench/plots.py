"""PNG plots of a results directory: TTFT CDF per mode, WAN bytes against hit rate, and (with a
hit-rate sweep) throughput against hit rate, the paper's "bathtub". Reads results.json only.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window

import matplotlib.pyplot as plt
import numpy as np

Json = dict[str, object]


def _by_workload(results: list[Json]) -> dict[str, list[Json]]:
    groups: dict[str, list[Json]] = defaultdict(list)
    for r in results:
        groups[r["workload"]["name"]].append(r)
    return groups


def _save(fig, ax, path: Path) -> Path:
    """Grid, legend, tight layout; write the PNG and free the figure."""
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def ttft_cdf(results: list[Json], workload: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ttft_s = sorted(q["token_times_s"][0] for q in r["requests"] if q["ok"] and q["token_times_s"])
        if ttft_s:
            ax.step(ttft_s, np.arange(1, len(ttft_s) + 1) / len(ttft_s), where="post", label=r["mode"])
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title=f"TTFT CDF, {workload}", ylim=(0, 1.02))
    return _save(fig, ax, path)


def _per_mode_points(results: list[Json], y_of) -> dict[str, list[tuple[float, float]]]:
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in results:
        x = r["workload"]["params"].get("hit_rate", r["metrics"]["pdd"]["planned_hit_rate"])
        lines[r["mode"]].append((x, y_of(r)))
    return {mode: sorted(points) for mode, points in lines.items()}


def _line_plot(lines: dict[str, list[tuple[float, float]]], ylabel: str, title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, points in lines.items():
        xs, ys = zip(*points)
        ax.plot([100 * x for x in xs], ys, marker="o", label=mode)
    ax.set(xlabel="mean prefix hit rate (%)", ylabel=ylabel, title=title)
    return _save(fig, ax, path)


def wan_bytes_vs_hit(results: list[Json], path: Path) -> Path:
    def kb_per_request(r: Json) -> float:
        done, d = r["metrics"]["requests"]["completed"], r["metrics"]["pdd"]
        sent = d["wan_emulator_a_to_b_bytes"]
        return (d["wan_kv_bytes"] if sent is None else sent) / done / 1e3 if done else 0.0
    return _line_plot(_per_mode_points(results, kb_per_request), "KB per request",
                      "KV sent to MD (emulator A→B where two-dc) against hit rate", path)


def throughput_vs_hit(results: list[Json], path: Path) -> Path:
    return _line_plot(_per_mode_points(results, lambda r: r["metrics"]["output_token_throughput"]),
                      "output tokens/s", "throughput against hit rate", path)


def write_plots(results: list[Json], out_dir: Path) -> list[Path]:
    written = [ttft_cdf(rs, name, out_dir / f"ttft_cdf_{name}.png") for name, rs in _by_workload(results).items()]
    agentic = [r for r in results if r["workload"]["kind"] == "agentic"]
    over_wan = [r for r in agentic if r["stack"].get("two_dc")] or agentic  # one-dc modes have no WAN
    if over_wan:
        written.append(wan_bytes_vs_hit(over_wan, out_dir / "wan_bytes_vs_hit.png"))
    if len({r["workload"]["name"] for r in agentic}) > 1:
        written.append(throughput_vs_hit(agentic, out_dir / "throughput_vs_hit.png"))
    return written
