"""Where each RLD -> MD switch's time went: a `pdd bench` run's records joined with MD's and RLD's
engine timelines (`--engine-timeline`).

    pdd bench ... --modes pdd --out bench-results/T \
      --service-flags main=--engine-timeline=$PWD/bench-results/T/main.jsonl \
      --service-flags relay=--engine-timeline=$PWD/bench-results/T/relay.jsonl
    python scripts/handoff_timeline.py bench-results/T --main bench-results/T/main.jsonl \
      --relay bench-results/T/relay.jsonl [--json out.json]

For every handoff, in ms: the stall the client saw (the larger gap around its first MD token, as
`pdd bench` counts it) and its parts: RLD's cut sent -> received on MD (the hop), received -> its
work submitted to MD's engine (MD's event loop), submitted -> its step began (the wait, and what
MD's engine ran meanwhile: steps, KV copies, holds), the step itself (and the CPU time MD's engine
thread got in it: short of the step's wall time, it waited for a core), and the step's end -> the
token at the client. Times are wall clock, so the client, MD and RLD must share a host's clock.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.engine_timeline import read_timeline  # noqa: E402
from tools.bench.metrics import handoff_stall_s  # noqa: E402
from tools.bench.replay import RequestRecord  # noqa: E402


def request_key(response_id: str) -> str:
    """The gateway's request id (the engines' key) from a response id ("cmpl-<hex>")."""
    return "req-" + response_id.split("-", 1)[1]


def _ms(a_ns: float, b_ns: float) -> float:
    return (b_ns - a_ns) / 1e6


def _marks(events: list[dict], key: str) -> dict[str, dict]:
    return {e["what"]: e for e in events if e["kind"] == "mark" and e["key"] == key}


def _cut_step(steps: list[dict], key: str, after_ns: int) -> dict | None:
    """MD's first step after `after_ns` in which `key`'s row samples: the cut's pass."""
    return next((s for s in steps if s["t_ns"] >= after_ns and any(r[0] == key and r[2] for r in s["rows"])), None)


def _between(events: list[dict], start_ns: int, end_ns: int) -> list[dict]:
    return [e for e in events if e["kind"] in ("step", "command", "hold") and e["end_ns"] > start_ns
            and e["t_ns"] < end_ns]


def _busy(events: list[dict]) -> dict[str, float]:
    """What MD's engine did during a wait, in ms: others' steps, its KV copies and other commands, holds."""
    out = {"steps_ms": 0.0, "steps": 0, "copies_ms": 0.0, "commands_ms": 0.0, "held_ms": 0.0}
    for e in events:
        took = _ms(e["t_ns"], e["end_ns"])
        if e["kind"] == "step":
            out["steps_ms"] += took
            out["steps"] += 1
        elif e["kind"] == "hold":
            out["held_ms"] += took
        elif e["label"] in ("fill", "export", "grow"):
            out["copies_ms"] += took
        else:
            out["commands_ms"] += took
    return out


def analyse(records: list[RequestRecord], main: list[dict], relay: list[dict]) -> list[dict]:
    main_steps = [e for e in main if e["kind"] == "step"]
    out = []
    for rec in records:
        stall = handoff_stall_s(rec)
        if stall is None or not rec.response_id or rec.sent_at is None:
            continue
        key = request_key(rec.response_id)
        k = next(i for i in range(1, len(rec.tiers)) if rec.tiers[i] == "main" and rec.tiers[i - 1] == "relay")
        sent_ns = rec.sent_at * 1e9
        last_relay_ns, first_main_ns = (sent_ns + rec.token_times_s[i] * 1e9 for i in (k - 1, k))
        md, rld = _marks(main, key), _marks(relay, key)
        row: dict[str, object] = {"key": key, "eager": k, "stall_ms": stall * 1000,
                                  "gap_ms": _ms(last_relay_ns, first_main_ns),
                                  "after_ms": (rec.token_times_s[k + 1] - rec.token_times_s[k]) * 1000
                                  if k + 1 < len(rec.token_times_s) else None,
                                  "announced": "cut_coming_received" in md}
        received = md.get("cut_received")
        if received is not None and "cut_sent" in rld:
            row["hop_ms"] = _ms(rld["cut_sent"]["t_ns"], received["t_ns"])
            # < 0: RLD sent the cut before the client saw RLD's last token
            row["rld_sent_after_token_ms"] = _ms(last_relay_ns, rld["cut_sent"]["t_ns"])
        step = _cut_step(main_steps, key, received["t_ns"] if received else 0)
        if step is not None:
            submitted = next(r[3] for r in step["rows"] if r[0] == key and r[2])
            row.update(loop_ms=_ms(received["t_ns"], submitted) if received else None,
                       wait_ms=_ms(submitted, step["t_ns"]), pass_ms=_ms(step["t_ns"], step["end_ns"]),
                       pass_cpu_ms=step["cpu_ns"] / 1e6 if "cpu_ns" in step else None,
                       pass_rows=len(step["rows"]), pass_tokens=sum(r[1] for r in step["rows"]),
                       to_client_ms=_ms(step["end_ns"], first_main_ns),
                       during_wait=_busy(_between(main, submitted, step["t_ns"])))
        out.append(row)
    return out


def _print(rows: list[dict], itl_ms: float) -> None:
    cols = ("stall_ms", "gap_ms", "after_ms", "hop_ms", "loop_ms", "wait_ms", "pass_ms", "pass_cpu_ms", "pass_rows",
            "to_client_ms")
    print(f"median ITL {itl_ms:.1f} ms; {len(rows)} handoffs")
    print("| key | x ITL | " + " | ".join(cols) + " | wait: steps / copies / commands / held ms |")
    print("|---" * (len(cols) + 3) + "|")
    for r in sorted(rows, key=lambda r: -r["stall_ms"]):
        cells = [f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols]
        w = r.get("during_wait")
        busy = "-" if not w else (f"{w['steps']}: {w['steps_ms']:.1f} / {w['copies_ms']:.1f} / "
                                  f"{w['commands_ms']:.1f} / {w['held_ms']:.1f}")
        print(f"| {r['key'][-8:]} | {r['stall_ms'] / itl_ms:.2f} | " + " | ".join(cells) + f" | {busy} |")
    for c in cols[:-2]:
        values = [r[c] for r in rows if isinstance(r.get(c), float)]
        if values:
            print(f"{c}: median {statistics.median(values):.1f}, max {max(values):.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a pdd bench --out directory (its pdd mode's results.json)")
    parser.add_argument("--main", type=Path, required=True, help="MD's --engine-timeline file")
    parser.add_argument("--relay", type=Path, required=True, help="RLD's --engine-timeline file")
    parser.add_argument("--workload", default="agentic-h0.90")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    results = json.loads((args.run / f"{args.workload}__pdd" / "results.json").read_text())
    fields = RequestRecord.__dataclass_fields__
    records = [RequestRecord(**{k: v for k, v in r.items() if k in fields}) for r in results["requests"]]
    rows = analyse(records, read_timeline(args.main), read_timeline(args.relay))
    _print(rows, results["metrics"]["itl_ms"]["median"])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
