"""Measure what tracing costs a request: the same requests through a local stack with tracing off,
with spans made but not exported, and with every service exporting to the gateway's own OTLP
receiver (POST /v1/traces), as docs/observability.md describes.

    .venv/bin/python scripts/bench_tracing_overhead.py --model tiny --requests 40

Each mode gets its own stack, all up at once; after a few warm-up requests each, requests go
round-robin over the stacks one at a time, so load from anything else on the machine falls on
every mode alike. Also prints the in-process cost of one span in each mode.
Prints a markdown table; `--out FILE` also writes the raw numbers as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.api_client import StreamResult, stream_completion  # noqa: E402
from tools.launcher import LocalStack  # noqa: E402
from tools.stack_config import StackConfig, free_port  # noqa: E402

ROLES = ("gateway", "prefill", "relay", "main")
MODES = {
    "off": "OTEL_SDK_DISABLED=true: no spans at all",
    "spans": "spans made and propagated, no exporter",
    "export": "every service exports to the gateway's OTLP receiver",
}
PROMPT = "Tracing must not slow the request it watches; this sentence pads the prompt. "


def span_cost_us(mode: str, spans: int = 20_000) -> float:
    """In-process: microseconds per span like ours (a few attributes, an event), including the
    export to a local OTLP/HTTP receiver for `export` (its CPU shares the machine like a service's)."""
    import http.server
    import threading
    import time

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import NoOpTracerProvider

    class Sink(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    provider = NoOpTracerProvider() if mode == "off" else TracerProvider()
    if mode == "export":
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
            endpoint=f"http://127.0.0.1:{server.server_port}/v1/traces"), max_queue_size=spans + 1))
    tracer = provider.get_tracer("bench")
    t0 = time.perf_counter()
    for i in range(spans):
        with tracer.start_as_current_span("prefill.chunk") as span:
            span.set_attributes({"pdd.request_id": "req-0123456789abcdef", "pdd.token_start": i,
                                 "pdd.token_end": i + 64, "pdd.queue_s": 0.001})
            span.add_event("kv_transfer", {"pdd.kv_bytes": 65536})
    if mode != "off":
        provider.force_flush()
        provider.shutdown()
    server.shutdown()
    return (time.perf_counter() - t0) / spans * 1e6


@dataclass
class Samples:
    e2e_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    gap_s: list[float] = field(default_factory=list)  # mean inter-token gap per request


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


@contextlib.asynccontextmanager
async def stack_for(mode: str, args: argparse.Namespace, log_dir: Path) -> AsyncIterator[LocalStack]:
    port = free_port()
    extra = {role: ["--otlp-endpoint", f"http://127.0.0.1:{port}/v1/traces"] for role in ROLES} \
        if mode == "export" else {}
    config = StackConfig(model=args.model, port=port, log_dir=log_dir / mode, torch_threads=args.torch_threads,
                         chunk_tokens=args.chunk_tokens, pipeline=args.pipeline, extra_args=extra,
                         startup_timeout_s=300, log_level="WARNING")
    saved = os.environ.get("OTEL_SDK_DISABLED")
    os.environ["OTEL_SDK_DISABLED"] = "true" if mode == "off" else "false"  # read by the children at start
    try:
        stack = LocalStack(config)
        await stack.start()
    finally:
        if saved is None:
            os.environ.pop("OTEL_SDK_DISABLED", None)
        else:
            os.environ["OTEL_SDK_DISABLED"] = saved
    try:
        yield stack
    finally:
        await stack.stop()


async def one_request(session: aiohttp.ClientSession, stack: LocalStack, model: str, tag: str,
                      args: argparse.Namespace) -> StreamResult:
    prompt = PROMPT * max(1, args.prompt_tokens // 16)
    pdd = {"pipeline": args.pipeline}
    if args.pipeline == "p-rld-md":
        pdd.update(md_kv_delay_ms=args.md_kv_delay_ms, handoff_at=args.handoff_at)
    body = {"model": model, "prompt": f"[{tag}] {prompt}", "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "pdd": pdd}
    return await stream_completion(session, stack.api_url, body)


async def run(args: argparse.Namespace, modes: list[str], log_dir: Path) -> dict[str, Samples]:
    """All modes' stacks up at once, requests round-robin over them (the order rotating), so
    whatever else loads the machine falls on every mode alike; only one request runs at a time."""
    results = {mode: Samples() for mode in modes}
    async with contextlib.AsyncExitStack() as exits:
        stacks = {}
        for mode in modes:
            print(f"starting the {mode} stack ({MODES[mode]})", file=sys.stderr, flush=True)
            stacks[mode] = await exits.enter_async_context(stack_for(mode, args, log_dir))
        session = await exits.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)))
        async with session.get(f"{stacks[modes[0]].api_url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        for i in range(args.warmup + args.requests):
            order = modes[i % len(modes):] + modes[:i % len(modes)]
            for mode in order:
                served = await one_request(session, stacks[mode], model, f"{mode} {i}", args)
                if i < args.warmup or not served.token_times_s:
                    continue
                samples = results[mode]
                samples.e2e_s.append(served.token_times_s[-1])
                samples.ttft_s.append(served.ttft_s)
                if served.gaps_s:
                    samples.gap_s.append(statistics.fmean(served.gaps_s))
            if i >= args.warmup and (i - args.warmup + 1) % 20 == 0:
                print(f"{i - args.warmup + 1}/{args.requests} rounds of requests", file=sys.stderr, flush=True)
    return results


def table(results: dict[str, Samples]) -> str:
    base = results["off"]
    lines = ["| mode | requests | e2e median | e2e p90 | TTFT median | TTFT p90 | mean gap "
             "| paired e2e Δ vs off (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, s in results.items():
        paired = statistics.median(b - a for a, b in zip(base.e2e_s, s.e2e_s))
        lines.append(f"| {mode} | {len(s.e2e_s)} | {statistics.median(s.e2e_s) * 1e3:.1f} ms "
                     f"| {pct(s.e2e_s, 90) * 1e3:.1f} ms | {statistics.median(s.ttft_s) * 1e3:.1f} ms "
                     f"| {pct(s.ttft_s, 90) * 1e3:.1f} ms | {statistics.fmean(s.gap_s) * 1e3:.2f} ms "
                     f"| {paired * 1e3:+.1f} ms ({paired / statistics.median(base.e2e_s) * 100:+.1f}%) |")
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--pipeline", default="p-rld-md", choices=("p-md", "p-rld-md"))
    parser.add_argument("--requests", type=int, default=40, help="measured requests per mode and round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="roughly")
    parser.add_argument("--md-kv-delay-ms", type=float, default=20.0)
    parser.add_argument("--handoff-at", type=int, default=8,
                        help="RLD hands off after exactly this many tokens, so every request does the same work")
    parser.add_argument("--chunk-tokens", type=int, default=64)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, help="write the raw samples here as JSON")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if "off" not in modes:
        raise SystemExit("--modes must include 'off', the baseline")
    with tempfile.TemporaryDirectory(prefix="pdd-bench-tracing-") as tmp:
        results = await run(args, modes, Path(tmp))
    print(f"model {args.model}, pipeline {args.pipeline}, ~{args.prompt_tokens} prompt tokens, "
          f"{args.max_tokens} output tokens, {args.requests} requests per mode, interleaved\n")
    print(table(results))
    for mode, what in MODES.items():
        if mode in results:
            print(f"\n- {mode}: {what}", end="")
    print()
    print("\nper span, in process (20,000 spans like prefill.chunk, flushed):")
    for mode in MODES:
        print(f"- {mode}: {span_cost_us(mode):.1f} µs")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "samples": {m: asdict(s) for m, s in results.items()}}, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
