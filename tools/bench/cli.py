"""`pdd bench`: its flags, the BenchConfig they make, and the command that runs it and writes
results.json per run, summary.md and the plots under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared.config import ModelConfig, flag_help
from shared.models import DTYPES
from tools.bench import paper, report
from tools.bench.config import (
    WORKLOADS,
    AgenticOptions,
    BenchConfig,
    Costs,
    LoadOptions,
    MooncakeOptions,
    Slo,
    StackOptions,
    SyntheticOptions,
    Target,
    WanLink,
)
from tools.bench.modes import MODES, NOT_AVAILABLE
from tools.bench.runner import RunResult, run_bench, skipped_modes
from tools.stack_config import (
    DATACENTERS,
    StackError,
    add_engine_arguments,
    merge_cpu_affinity,
    parse_cpu_affinity,
    parse_instances,
)

ALL_MODES = (*MODES, *NOT_AVAILABLE)


def _names(known: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; choose from {', '.join(known)}")
        return names
    return parse


def _target(text: str) -> Target:
    """NAME=URL or URL (named by its host and port)."""
    name, _, url = text.rpartition("=") if "=" in text.split("://")[0] else ("", "", text)
    url = url.rstrip("/").removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=URL or URL, with http:// or https://")
    name = name or url.split("://", 1)[1]
    if name in ALL_MODES:
        raise argparse.ArgumentTypeError(f"{name!r} is a mode's name: name the target otherwise (NAME=URL)")
    return Target(name, url)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d, s, ld, a, m, y, w = (BenchConfig(), StackOptions(), LoadOptions(), AgenticOptions(), MooncakeOptions(),
                            SyntheticOptions(), WanLink())
    p = subparsers.add_parser("bench", help="replay workloads against a stack in each mode; write results",
                              description="Start the stack in each mode, replay each workload, write results.json "
                                          "per run, summary.md and PNG plots.")
    p.add_argument("--modes", type=_names(ALL_MODES), default=None,
                   help=f"comma list of {', '.join(ALL_MODES)} (default: all, or none with --target-url; unavailable "
                        "ones are listed as not run)")
    p.add_argument("--target-url", dest="targets", type=_target, action="append", default=[],
                   help="also replay every workload against this OpenAI-compatible server, as NAME=URL (e.g. "
                        "vllm=http://127.0.0.1:8100); repeatable. Same client and metrics; its requests carry no "
                        "`pdd` object")
    p.add_argument("--target-model", default=None,
                   help="the `model` field of requests to --target-url servers (default: left out)")
    p.add_argument("--workload", dest="workloads", type=_names(WORKLOADS), default=d.workloads,
                   help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--out", type=Path, default=None, help="results directory (default: bench-results/<timestamp>)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--scenario", choices=tuple(paper.SCENARIOS), default=None,
                   help="paper: the PDD paper's regime (SmolLM2, 100 Mbit/s, 30 ms RTT; agent sessions of 1,024-token "
                        "prompts, 128-token answers, 8 turns at a 90 %% hit; the Mooncake trace with its own answer "
                        "lengths capped at 128) in pdd, pd-local, pd-wan and pd-wan-drc, and summary.md's table "
                        "against the paper. paper-scale: the same at the paper's scale on the simulated engine "
                        "(Llama-3-70B's shape, P on H800, RLD and MD on H20, 2 P, 1 RLD, 4 MD, a 10 Gbit/s link, "
                        "hundreds of requests; docs/benchmarks.md). A flag given still wins over the preset")

    g = p.add_argument_group("stack")
    g.add_argument("--model", default=s.model, help=flag_help(ModelConfig, "model"))
    g.add_argument("--dtype", default=s.dtype, choices=tuple(DTYPES))
    g.add_argument("--torch-threads", type=int, default=s.torch_threads, help="per model process; 0: launcher default")
    g.add_argument("--chunk-tokens", type=int, default=s.chunk_tokens)
    g.add_argument("--cache-bytes", type=int, default=None,
                   help="P's cache, RLD's and MD's DRC capacity (default: services')")
    g.add_argument("--startup-timeout-s", type=float, default=s.startup_timeout_s)
    g.add_argument("--cpus", dest="cpu_affinity", type=parse_cpu_affinity, action="append", default=[],
                   metavar="NAME[,NAME]=CORES", help="pin processes to cores in every mode, e.g. prefill=0 "
                                                     "--cpus relay,main=1 (as pdd up); default: unpinned")
    add_engine_arguments(g, s)
    g.add_argument("--instances", type=parse_instances, default={}, metavar="ROLE=N[,ROLE=N]",
                   help="instances of P, RLD and MD in every mode, e.g. prefill=2,main=4 (default 1 each; as pdd up)")
    g.add_argument("--service-flags", dest="service_flags", type=_service_flags, action="append", default=[],
                   metavar="ROLE=FLAGS", help="more flags for one service in every mode, e.g. gateway='--backfill-"
                                              "link-share 0.5'; repeatable; ROLE one of " + ", ".join(SERVICE_ROLES))

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=ld.request_rate,
                   help="Poisson arrivals per second (agentic, synthetic); inf: all at once")
    g.add_argument("--max-concurrency", type=int, default=ld.max_concurrency)
    g.add_argument("--max-requests", type=int, default=ld.max_requests, help="measured requests per workload")
    g.add_argument("--duration-s", type=float, default=ld.duration_s, help="send nothing after this many seconds")
    g.add_argument("--request-timeout-s", type=float, default=ld.request_timeout_s)
    g.add_argument("--warmup-requests", type=int, default=ld.warmup_requests)
    g.add_argument("--no-progress", action="store_true", help="no progress bar")

    g = p.add_argument_group("agentic workload")
    g.add_argument("--hit-rate", type=float, default=a.hit_rate, help="mean prefix hit rate")
    g.add_argument("--hit-rates", type=_floats, default=(), help="sweep, e.g. 0,0.5,0.9,0.99 (overrides --hit-rate)")
    g.add_argument("--prefix-tokens", type=int, default=a.prefix_tokens, help="first prompt of a session")
    g.add_argument("--output-tokens", type=int, default=a.output_tokens, help="answer length")
    g.add_argument("--turns-per-session", type=int, default=a.turns_per_session)
    g.add_argument("--high-hit", type=float, default=a.high_hit, help="hit of a long-running session's turn")
    g.add_argument("--max-context-tokens", type=int, default=a.max_context_tokens)
    g.add_argument("--tool-call-share", type=float, default=a.tool_call_share,
                   help="of session turns, those answered by a short tool call instead (0-1)")
    g.add_argument("--tool-call-tokens", type=int, default=a.tool_call_tokens, help="a tool call's length")

    g = p.add_argument_group("mooncake workload")
    g.add_argument("--trace", type=Path, default=m.path)
    g.add_argument("--block-tokens", type=int, default=m.block_tokens, help="tokens per trace block (trace: 512)")
    g.add_argument("--max-input-tokens", type=int, default=m.max_input_tokens)
    g.add_argument("--max-output-tokens", type=int, default=m.max_output_tokens)
    g.add_argument("--time-scale", type=float, default=m.time_scale, help="multiply arrival times by this")
    g.add_argument("--trace-skip", type=int, default=m.skip, help="start at this line of the trace")

    g = p.add_argument_group("synthetic workload")
    g.add_argument("--input-len", type=int, default=y.input_tokens)
    g.add_argument("--output-len", type=int, default=y.output_tokens)

    g = p.add_argument_group("WAN (two-datacenter modes)")
    g.add_argument("--wan-bandwidth-mbps", type=float, default=w.bandwidth_mbps)
    g.add_argument("--wan-rtt-ms", type=float, default=w.rtt_ms)
    g.add_argument("--wan-jitter-ms", type=float, default=w.jitter_ms)
    g.add_argument("--wan-trace", type=Path, default=None, help="bandwidth trace for the emulator")
    g.add_argument("--gateway-dc", dest="gateway_datacenter", default=s.gateway_datacenter, choices=DATACENTERS,
                   help="the gateway's (and the client's) datacenter: a, beside P and RLD, or b, beside MD")

    g = p.add_argument_group("SLOs (goodput) and costs (BCR)")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--slo-e2e-ms", type=float, default=None)
    g.add_argument("--cost-prefill", type=float, default=1.0)
    g.add_argument("--cost-relay", type=float, default=1.0)
    g.add_argument("--cost-main", type=float, default=1.0)
    # a flag a scenario presets keeps its default wrapped, so a value given equal to it still wins
    preset = {dest for values in paper.SCENARIOS.values() for dest in values}
    p.set_defaults(func=cmd_bench, **{a.dest: NotGiven(a.default) for a in p._actions if a.dest in preset})
    return p


@dataclass(frozen=True)
class NotGiven:
    """The default of a flag a scenario presets, while the command line has not given it."""

    default: object


def _apply_scenario(args: argparse.Namespace) -> None:
    """A scenario's values replace the flags not given; the others keep their defaults."""
    preset = paper.SCENARIOS.get(args.scenario, {})
    for dest, given in vars(args).items():
        if isinstance(given, NotGiven):
            setattr(args, dest, preset.get(dest, given.default))


SERVICE_ROLES = ("prefill", "relay", "main", "gateway", "wan")


def _service_flags(text: str) -> tuple[str, tuple[str, ...]]:
    role, sep, flags = text.partition("=")
    if not sep or role not in SERVICE_ROLES:
        raise argparse.ArgumentTypeError(f"{text!r}: want ROLE=FLAGS with ROLE one of {', '.join(SERVICE_ROLES)}")
    try:
        return role, tuple(shlex.split(flags))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from exc


def _merge_service_flags(given: list[tuple[str, tuple[str, ...]]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """One entry per role, its flags in the order given."""
    merged: dict[str, tuple[str, ...]] = {}
    for role, flags in given:
        merged[role] = merged.get(role, ()) + flags
    return tuple(merged.items())


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    _apply_scenario(args)
    out = args.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
    targets = tuple(Target(t.name, t.url, args.target_model) for t in args.targets)
    modes = args.modes if args.modes is not None else (() if targets else ALL_MODES)
    return BenchConfig(
        modes=modes, targets=targets, workloads=args.workloads, hit_rates=args.hit_rates, seed=args.seed, out_dir=out,
        stack=StackOptions(model=args.model, dtype=args.dtype, torch_threads=args.torch_threads,
                           chunk_tokens=args.chunk_tokens, cache_bytes=args.cache_bytes,
                           startup_timeout_s=args.startup_timeout_s, log_dir=out / "logs",
                           gateway_datacenter=args.gateway_datacenter,
                           cpu_affinity=tuple(merge_cpu_affinity(args.cpu_affinity).items()),
                           extra_args=_merge_service_flags(args.service_flags), engine=args.engine,
                           sim_device=args.sim_device, sim_profile=args.sim_profile, sim_shape=args.sim_shape,
                           kv_byte_scale=args.kv_byte_scale, sim_devices=tuple(args.sim_devices.items()),
                           instances=tuple(args.instances.items())),
        load=LoadOptions(request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                         max_requests=args.max_requests, duration_s=args.duration_s,
                         request_timeout_s=args.request_timeout_s, warmup_requests=args.warmup_requests,
                         progress=not args.no_progress and sys.stderr.isatty()),
        wan=WanLink(args.wan_bandwidth_mbps, args.wan_rtt_ms, args.wan_jitter_ms, args.wan_trace),
        slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms),
        costs=Costs(args.cost_prefill, args.cost_relay, args.cost_main),
        agentic=AgenticOptions(args.hit_rate, args.prefix_tokens, args.output_tokens, args.turns_per_session,
                               args.high_hit, args.max_context_tokens, args.tool_call_share, args.tool_call_tokens),
        mooncake=MooncakeOptions(args.trace, args.block_tokens, args.max_input_tokens, args.max_output_tokens,
                                 args.time_scale, args.trace_skip),
        synthetic=SyntheticOptions(args.input_len, args.output_len),
    )


def finish_report(cfg: BenchConfig) -> list[Path]:
    """summary.md and the plots from whatever results.json files are in cfg.out_dir."""
    written = [report.write_summary(cfg.out_dir, skipped_modes(cfg))]
    results = report.load_results(cfg.out_dir)
    try:
        from tools.bench import plots  # matplotlib is an extra: `pip install -e '.[bench]'`
    except ImportError as exc:
        print(f"pdd bench: no plots ({exc}); pip install matplotlib", file=sys.stderr, flush=True)
        return written
    if results:
        written += plots.write_plots(results, cfg.out_dir)
    return written


def cmd_bench(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    for mode, reason in skipped_modes(cfg).items():
        print(f"pdd bench: {mode}: not available: {reason}", file=sys.stderr, flush=True)
    rate = "all at once" if math.isinf(cfg.load.request_rate) else f"{cfg.load.request_rate:g} req/s"
    print(f"pdd bench: model {cfg.stack.model}, workloads {', '.join(cfg.workloads)}, {rate}, "
          f"results in {cfg.out_dir}", file=sys.stderr, flush=True)

    def on_result(result: RunResult) -> None:
        path = report.write_result(result, cfg.out_dir)
        req = result.metrics["requests"]
        print(f"pdd bench: {result.name}: {req['completed']}/{req['sent']} requests in "
              f"{result.duration_s:.1f} s -> {path}", file=sys.stderr, flush=True)

    code = 0
    try:
        results = asyncio.run(run_bench(cfg, on_result))
        if any(r.metrics["requests"]["completed"] == 0 for r in results):
            code = 1
    except StackError as exc:
        print(f"pdd bench: a stack failed: {exc}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        print("pdd bench: interrupted; writing what finished", file=sys.stderr, flush=True)
        code = 130
    written = finish_report(cfg)
    print((cfg.out_dir / report.SUMMARY_FILE).read_text())
    print("pdd bench: wrote " + ", ".join(str(p) for p in written), file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.bench.cli [flags]`: the same as `pdd bench [flags]`."""
    parser = argparse.ArgumentParser(prog="pdd")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
