"""pdd beside a peer server on the same machine, by one client: the issue "Under load"'s table.

Starts pdd (one datacenter, P-MD) with `pdd up`'s launcher and a peer from a command (for example
vLLM's CPU build, see docs/benchmarks.md "Against vLLM-CPU"), both serving the same model on the
same cores. Then, for each repeat and each concurrency, it replays the same fixed-length random
workload (the synthetic one of `pdd bench`: `--input-len` tokens in, `--output-len` out,
`ignore_eos`, all at once under `--concurrency`) against pdd and then against the peer, so slow
drifts of a shared machine hit both alike. Only one system is measured at a time; both stay up.

    .venv/bin/python scripts/bench_peer.py --peer-cmd '/root/peers/vllm_serve.sh' \
        --peer-url http://127.0.0.1:8100 --peer-model smollm2 --concurrency 1,4,16,64 --repeats 3

Writes every run's metrics to --out (JSON) and prints a markdown table of medians over repeats.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.bench import metrics  # noqa: E402
from tools.bench.config import Costs, LoadOptions, Slo, SyntheticOptions  # noqa: E402
from tools.bench.replay import Replayer  # noqa: E402
from tools.bench.workloads import synthetic_workload  # noqa: E402
from tools.launcher import LocalStack  # noqa: E402
from tools.stack_config import StackConfig  # noqa: E402


def num_prompts(concurrency: int, minimum: int) -> int:
    """Two waves at each concurrency (one at 64), never fewer than `minimum`."""
    return max(minimum, concurrency if concurrency >= 64 else 2 * concurrency)


async def wait_ready(url: str, timeout_s: float, proc: subprocess.Popen | None) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the peer exited with {proc.returncode} before answering")
            try:
                async with http.get(url + "/v1/models") as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            await asyncio.sleep(1.0)
    raise RuntimeError(f"{url} did not answer /v1/models within {timeout_s:.0f} s")


async def measure(url: str, pdd_fields: dict | None, model: str | None, concurrency: int, n: int,
                  synthetic: SyntheticOptions, seed: int, timeout_s: float) -> dict:
    load = LoadOptions(request_rate=math.inf, max_concurrency=concurrency, max_requests=n,
                       request_timeout_s=timeout_s, warmup_requests=1, progress=False)
    workload = synthetic_workload(synthetic, n, math.inf, seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as http:
        replayer = Replayer(http, url, pdd_fields, load, model=model)
        await replayer.warm_up(workload.warmup + tuple(workload.requests[:1]))
        records, duration_s = await replayer.run(workload.requests)
    m = metrics.summarize(records, duration_s, slo=Slo(), costs=Costs(), instances={"target": 1},
                          kv_bytes_per_token=0)
    errors = sorted({r.error for r in records if r.error})
    return {"failed": m["requests"]["failed"], "completed": m["requests"]["completed"], "sent": m["requests"]["sent"],
            "ttft_mean_ms": m["ttft_ms"]["mean"], "ttft_p99_ms": m["ttft_ms"]["p99"],
            "tpot_mean_ms": m["tpot_ms"]["mean"], "itl_p99_ms": m["itl_ms"]["p99"],
            "output_tokens_per_s": m["output_token_throughput"], "duration_s": duration_s, "errors": errors[:3]}


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def table(runs: list[dict], peer: str) -> str:
    lines = [f"| concurrency | requests | failed pdd / {peer} | TTFT mean ms pdd / {peer} | TTFT P99 ms pdd / {peer} "
             f"| TPOT mean ms pdd / {peer} | out tok/s pdd / {peer} | tok/s ratio | TPOT ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in sorted({r["concurrency"] for r in runs}):
        by = {s: [r for r in runs if r["concurrency"] == c and r["system"] == s] for s in ("pdd", peer)}
        if not by["pdd"] or not by[peer]:
            continue
        med = {s: {k: _median(rows, k) for k in ("ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms",
                                                  "output_tokens_per_s")} for s, rows in by.items()}
        failed = {s: sum(r["failed"] for r in rows) for s, rows in by.items()}

        def pair(key: str, fmt: str = ",.0f") -> str:
            a, b = med["pdd"][key], med[peer][key]
            return f"{'-' if a is None else format(a, fmt)} / {'-' if b is None else format(b, fmt)}"

        tok = med["pdd"]["output_tokens_per_s"], med[peer]["output_tokens_per_s"]
        tpot = med["pdd"]["tpot_mean_ms"], med[peer]["tpot_mean_ms"]
        lines.append(f"| {c} | {by['pdd'][0]['sent']} | {failed['pdd']} / {failed[peer]} | {pair('ttft_mean_ms')} "
                     f"| {pair('ttft_p99_ms')} | {pair('tpot_mean_ms', '.1f')} | {pair('output_tokens_per_s', '.1f')} "
                     f"| {tok[0] / tok[1]:.2f}× | {tpot[0] / tpot[1]:.2f}× |" if all(tok) and all(tpot) else
                     f"| {c} | {by['pdd'][0]['sent']} | {failed['pdd']} / {failed[peer]} | - | - | - | - | - | - |")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> list[dict]:
    extra = {"gateway": ["--max-running-requests", str(args.max_running_requests)]}
    config = StackConfig(model=args.model, dtype=args.dtype, port=0, pipeline="p-md",
                         log_dir=Path(tempfile.mkdtemp(prefix="pdd-peer-")), startup_timeout_s=600, extra_args=extra,
                         **({"torch_threads": args.torch_threads} if args.torch_threads else {}))
    peer_proc = None
    if args.peer_cmd:
        log = open(config.log_dir / "peer.log", "wb")
        peer_proc = subprocess.Popen(["bash", "-c", args.peer_cmd], stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
    synthetic = SyntheticOptions(args.input_len, args.output_len)
    runs: list[dict] = []
    try:
        async with LocalStack(config) as stack:
            systems = {"pdd": (stack.api_url, {}, None)}
            if args.peer_url:  # empty: pdd alone (e.g. to compare pdd's own settings)
                await wait_ready(args.peer_url, args.peer_startup_s, peer_proc)
                systems[args.peer_name] = (args.peer_url, None, args.peer_model)
            for repeat in range(args.repeats):
                for c in args.concurrency:
                    n = num_prompts(c, args.min_prompts)
                    for system, (url, fields, model) in systems.items():
                        row = await measure(url, fields, model, c, n, synthetic, seed=repeat * 1000 + c,
                                            timeout_s=args.request_timeout_s)
                        row.update(system=system, concurrency=c, repeat=repeat)
                        runs.append(row)
                        print(json.dumps(row), flush=True)
                        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                        "runs": runs}, indent=1, default=str))
    finally:
        if peer_proc is not None:
            os.killpg(peer_proc.pid, signal.SIGTERM)
            try:
                peer_proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(peer_proc.pid, signal.SIGKILL)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--torch-threads", type=int, default=0, help="per pdd model process; 0: the launcher's")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--peer-cmd", default="",
                   help="shell command that starts the peer in the foreground; empty: it is running already")
    p.add_argument("--peer-url", default="http://127.0.0.1:8100", help="empty: measure pdd alone")
    p.add_argument("--peer-model", default=None, help="`model` of the peer's requests")
    p.add_argument("--peer-name", default="vllm-cpu")
    p.add_argument("--peer-startup-s", type=float, default=600)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-timeout-s", type=float, default=600)
    p.add_argument("--out", type=Path, default=Path("bench-results/peer.json"))
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = asyncio.run(run(args))
    if args.peer_url:
        print(table(runs, args.peer_name))


if __name__ == "__main__":
    main()
