"""The pure parts of scripts/bench_control_plane.py: CPU time from /proc, counter deltas, percentiles and
when a rate counts as sustained. The script's stack is not started here (docs/scale.md runs it)."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_control_plane.py"
_spec = importlib.util.spec_from_file_location("bench_control_plane", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_control_plane"] = bench
_spec.loader.exec_module(bench)


def test_counters_percentiles_and_the_sustained_rule() -> None:
    tck = os.sysconf("SC_CLK_TCK")
    # a command with spaces and a ')' of its own; utime and stime are fields 14 and 15
    line = f"4242 (python -m x) y)) S 1 2 3 4 5 6 7 8 9 10 {3 * tck} {tck // 2} 0 0 20 0 3 0 99 1000 50"
    assert bench.cpu_seconds_of_stat(line) == 3.5
    assert bench.cpu_seconds_of_stat(Path(f"/proc/{os.getpid()}/stat").read_text()) > 0

    before, after = {"in_msgs": 10, "out_msgs": 20}, {"in_msgs": 70, "out_msgs": 140, "in_bytes": 5}
    assert bench.counter_delta(before, after, ("in_msgs", "out_msgs", "in_bytes")) == \
        {"in_msgs": 60.0, "out_msgs": 120.0, "in_bytes": 5.0}

    latencies = [i / 100 for i in range(1, 101)]  # 0.01 .. 1.00 s
    assert bench.percentile(latencies, 50) == 0.5 and bench.percentile(latencies, 99) == 0.99
    assert bench.percentile(latencies, 100) == 1.0 and bench.percentile([0.3], 99) == 0.3

    assert bench.sustained(offered=100, completed=100, errors=0, p99_s=1.5, latency_bound_s=2.0)
    assert not bench.sustained(offered=100, completed=100, errors=1, p99_s=1.5, latency_bound_s=2.0)
    assert not bench.sustained(offered=100, completed=100, errors=0, p99_s=2.5, latency_bound_s=2.0)
    assert not bench.sustained(offered=100, completed=90, errors=0, p99_s=1.0, latency_bound_s=2.0)
