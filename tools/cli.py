"""The `pdd` command line: `pdd up`, `pdd demo`, `pdd model prepare` (add more in `build_parser`).

Commands that run a stack stop it in order on Ctrl-C or SIGTERM: a signal only sets an Event,
and a second one kills every process at once and exits.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from shared.config import ModelConfig, default_of, flag_help
from shared.models import resolve_model, served_model_name
from tools.bench.cli import add_bench_parser
from tools.demo import DEFAULT_PIPELINE, DEFAULT_PROMPT, DemoError, DemoOptions, TierPainter, run_demo
from tools.launcher import LocalStack
from tools.stack_config import StackConfig, StackError

log = logging.getLogger("pdd")
T = TypeVar("T")


@contextlib.contextmanager
def stop_on_signals(force: Callable[[], None]) -> Iterator[asyncio.Event]:
    """SIGINT/SIGTERM set the returned Event; a second one calls `force` and exits at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            print(f"\npdd: second {sig.name}: killing everything now", file=sys.stderr, flush=True)
            force()
            os._exit(128 + sig)
        print(f"\npdd: {sig.name}: stopping (again to force)", file=sys.stderr, flush=True)
        stop.set()

    sigs = (signal.SIGINT, signal.SIGTERM)
    for sig in sigs:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield stop
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)


async def until_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """Run `work` unless `stop` is set first, in which case cancel it and return None."""
    work_task = asyncio.ensure_future(work)
    stop_task = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({work_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (stop_task, work_task):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if work_task.cancelled() else work_task.result()


async def run_with_stack(config: StackConfig, body: Callable[[LocalStack, asyncio.Event], Awaitable[int]],
                         *, interrupted_code: int = 0) -> int:
    """Start a stack, run `body(stack, stop)` until it returns or a signal comes, then stop the stack."""
    stack = LocalStack(config)
    with stop_on_signals(stack.kill_all) as stop:
        try:
            print(f"pdd: starting the stack (model {config.model}); logs in {stack.log_dir}", flush=True)

            async def start_then_body() -> int:
                await stack.start()
                return await body(stack, stop)

            code = await until_stopped(start_then_body(), stop)
            return interrupted_code if code is None else code
        except StackError as exc:
            print(f"pdd: the stack failed: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            await stack.stop()


async def _serve(stack: LocalStack, stop: asyncio.Event, on_child_exit: str = "stop") -> int:
    print(f"pdd: ready. OpenAI API at {stack.api_url}/v1 (health: {stack.api_url}/healthz)", flush=True)
    print(f"pdd: try  curl -N {stack.api_url}/v1/chat/completions -H 'content-type: application/json' "
          "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"stream\": true}'", flush=True)
    if stack.config.two_dc:
        c = stack.config
        rate = f"{c.wan_bandwidth_mbps:g} Mbit/s" if c.wan_bandwidth_mbps else "unlimited"
        print(f"pdd: two datacenters: MD in B behind the WAN emulator ({rate}, {c.wan_delay_ms:g} ms one way"
              f"{f', ±{c.wan_jitter_ms:g} ms' if c.wan_jitter_ms else ''}); control API at {stack.wan_control_url} "
              f"(GET /stats, POST /cut?mode=reset|blackhole[&routes=kv,...], /restore, /link)", flush=True)
    print("pdd: Ctrl-C stops the stack", flush=True)
    exited = await until_stopped(stack.watch(restart=on_child_exit == "restart"), stop)
    if exited is None:
        return 0
    print(f"pdd: {exited} exited (see {stack.log_paths[exited]}); stopping the stack", file=sys.stderr, flush=True)
    return 1


def cmd_up(args: argparse.Namespace) -> int:
    async def serve(stack: LocalStack, stop: asyncio.Event) -> int:
        return await _serve(stack, stop, args.on_child_exit)

    return asyncio.run(run_with_stack(StackConfig.from_namespace(args), serve))


def _demo_options(args: argparse.Namespace) -> DemoOptions:
    md_kv_delay_ms = args.md_kv_delay_ms
    if md_kv_delay_ms is None and args.topology == "two-dc" and not args.api_url:
        md_kv_delay_ms = 0.0  # the emulated WAN holds MD's KV back by itself
    return DemoOptions(prompt=args.prompt, max_tokens=args.max_tokens, pipeline=args.pipeline,
                       md_kv_delay_ms=md_kv_delay_ms, temperature=args.temperature)


async def _demo_against(api_url: str, model: str | None, options: DemoOptions) -> int:
    painter = TierPainter.for_stream(sys.stdout)
    print(f"\nprompt: {options.prompt}\n{painter.legend()}\n", flush=True)
    try:
        result = await run_demo(api_url, options, sys.stdout, model=model, painter=painter)
    except (DemoError, OSError) as exc:
        print(f"pdd demo: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"\nsummary\n{result.summary()}\n", flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    options = _demo_options(args)
    if args.api_url:
        async def against_running() -> int:
            with stop_on_signals(lambda: None) as stop:
                code = await until_stopped(_demo_against(args.api_url.rstrip("/"), None, options), stop)
                return 130 if code is None else code
        return asyncio.run(against_running())

    async def body(stack: LocalStack, stop: asyncio.Event) -> int:
        assert stack.model_path is not None  # set by start()
        return await _demo_against(stack.api_url, served_model_name(stack.model_path), options)

    return asyncio.run(run_with_stack(StackConfig.from_namespace(args), body, interrupted_code=130))


def cmd_model_prepare(args: argparse.Namespace) -> int:
    try:
        path = resolve_model(args.model)
    except FileNotFoundError as exc:
        print(f"pdd: {exc}", file=sys.stderr)
        return 1
    print(f"{served_model_name(path)}: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdd", description="Prefill - Relay Decode - Main Decode serving")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser("up", help="start a local stack and serve until Ctrl-C")
    StackConfig.add_arguments(up)
    up.add_argument("--on-child-exit", choices=("stop", "restart"), default="stop",
                    help="when a service exits by itself: log it and stop the stack with exit code 1 (default), "
                         "or log it and start it again (at most 3 times per service)")
    up.set_defaults(func=cmd_up)

    demo = commands.add_parser("demo", help="start a stack, stream one answer marked by tier, stop")
    StackConfig.add_arguments(demo)
    demo.set_defaults(pipeline=DEFAULT_PIPELINE)  # the request's pipeline, so the demo shows a handoff
    demo.add_argument("--prompt", default=DEFAULT_PROMPT)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--temperature", type=float, default=0.0)
    demo.add_argument("--md-kv-delay-ms", type=float, default=None,
                      help="hold back MD's KV path so RLD makes eager tokens first "
                           "(default: 400 unless on p-md, 0 with --topology two-dc)")
    demo.add_argument("--api-url", default=None, help="use a running stack (e.g. from `pdd up`) instead")
    demo.set_defaults(func=cmd_demo)

    add_bench_parser(commands)

    model = commands.add_parser("model", help="model checkpoints")
    model_commands = model.add_subparsers(dest="model_command", required=True, metavar="COMMAND")
    prepare = model_commands.add_parser("prepare", help="convert or generate a model once; print its path")
    prepare.add_argument("--model", default=default_of(ModelConfig, "model"), help=flag_help(ModelConfig, "model"))
    prepare.set_defaults(func=cmd_model_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
