"""Helpers shared by the tests: the stack a module runs on (conftest's `stack` fixture starts it), a
streamed completion, deterministic prompts, fresh heartbeats, a role restarted with code of a
test's put into its process, and a batch engine over a runner in the test's own process."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from shared import bus, messages, subjects
from shared.batch_engine import BatchEngine
from shared.config import EngineConfig
from shared.model_runner import ModelRunner
from tools.api_client import StreamResult, stream_completion
from tools.launcher import LocalStack
from tools.stack_config import StackConfig

# What a test's stack is unless its module says otherwise (`STACK` in the module, or its own
# `stack_overrides` fixture): the tiny model, P-RLD-MD, one torch thread per process.
TINY_STACK: dict[str, object] = {"model": "tiny", "pipeline": "p-rld-md", "port": 0, "torch_threads": 1,
                                 "chunk_tokens": 64, "startup_timeout_s": 150.0}


# A restarted role imports torch afresh: seconds on a quiet machine, tens of seconds on a loaded one.
RESTART_TIMEOUT_S = 60.0


def stack_config(log_dir: Path, **overrides: object) -> StackConfig:
    """TINY_STACK with `overrides` over it, logging to `log_dir`."""
    return StackConfig(**{**TINY_STACK, "log_dir": log_dir, **overrides})  # type: ignore[arg-type]


class SharedStacks:
    """The stacks of the session that modules share: one per configuration, started when a module
    first asks for it and stopped when the session ends. Only for modules whose tests leave the
    stack as they found it (no kill, restart or stop), and that do not count on what another
    module's requests left in its caches."""

    def __init__(self, log_root: Path) -> None:
        self._log_root = log_root
        self._stacks: dict[str, LocalStack] = {}
        self._exit = contextlib.AsyncExitStack()

    async def get(self, **overrides: object) -> LocalStack:
        key = repr(sorted(overrides.items()))
        if key not in self._stacks:
            log_dir = self._log_root / f"shared-{len(self._stacks)}"
            self._stacks[key] = await self._exit.enter_async_context(LocalStack(stack_config(log_dir, **overrides)))
        return self._stacks[key]

    async def aclose(self) -> None:
        await self._exit.aclose()


async def complete(session: aiohttp.ClientSession, stack: LocalStack, prompt: list[int] | str, max_tokens: int, *,
                   ignore_eos: bool = False, timeout_s: float | None = None, **pdd: object) -> StreamResult:
    """A streamed greedy completion of `prompt` (token ids or text); keyword arguments other than
    `ignore_eos` and `timeout_s` are the request's `pdd` fields. A module that always sends some
    binds them with functools.partial (a caller's own keyword still wins)."""
    body: dict[str, object] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if ignore_eos:
        body["ignore_eos"] = True
    if pdd:
        body["pdd"] = pdd
    async with asyncio.timeout(timeout_s):
        return await stream_completion(session, stack.api_url, body)


def random_prompt(seed: int, n: int) -> list[int]:
    """n token ids in the tiny model's vocabulary, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


async def fresh_heartbeats(nats_url: str, roles: tuple[str, ...] = ("prefill", "relay", "main"),
                           timeout_s: float = 10.0) -> dict[str, messages.Heartbeat]:
    """One heartbeat per role, each sent after this call began (so it reflects the present)."""
    after = time.time() + 0.05
    nc = await bus.connect(nats_url, "test-heartbeats")
    seen: dict[str, messages.Heartbeat] = {}

    async def on_beat(msg) -> None:
        beat = messages.decode(msg.data)
        if beat.sent_at > after:
            seen[beat.role] = beat

    await nc.subscribe(subjects.heartbeat_all(), cb=on_beat)
    try:
        async with asyncio.timeout(timeout_s):
            while not set(roles) <= set(seen):
                await asyncio.sleep(0.05)
    finally:
        await nc.close()
    return seen


async def busy_instance(nats_url: str, role: str, timeout_s: float = 10.0) -> str:
    """The id of an instance of `role` whose fresh heartbeat shows a request running on it."""
    after = time.time() + 0.05
    nc = await bus.connect(nats_url, "test-busy-instance")
    found: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_beat(msg) -> None:
        beat = messages.decode(msg.data)
        if beat.role == role and beat.sent_at > after and beat.running > 0 and not found.done():
            found.set_result(beat.instance_id)

    await nc.subscribe(subjects.heartbeat_all(), cb=on_beat)
    try:
        async with asyncio.timeout(timeout_s):
            return await found
    finally:
        await nc.close()


async def abandon_stream(session, api_url: str, prompt: list[int], max_tokens: int, after_chunks: int,
                         pdd: dict) -> None:
    """Stream a completion and walk away after `after_chunks` SSE lines, as a client that disconnects."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "pdd": pdd}
    async with session.post(api_url + "/v1/completions", json=body) as resp:
        seen = 0
        async for _ in resp.content:
            seen += 1
            if seen >= after_chunks:
                break
        resp.close()


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def restart_patched(stack, role: str, sitecustomize: str, directory: Path, monkeypatch) -> None:
    """Restart `role` with `sitecustomize` in `directory` on its PYTHONPATH (Python runs it at the
    interpreter's start, before the service is imported: a bug or a delay put into that process
    alone). Returns once every role beats again and the gateway has had the new instance's pings
    answered (every 0.25 s): it looks alive, and busy rather than gone should it fail a request."""
    (directory / "sitecustomize.py").write_text(sitecustomize)
    monkeypatch.setenv("PYTHONPATH", str(directory), prepend=os.pathsep)
    await stack.restart(role)
    monkeypatch.undo()  # only the restarted role gets it
    await fresh_heartbeats(stack.nats_url, timeout_s=RESTART_TIMEOUT_S)
    await asyncio.sleep(1.0)


@contextlib.contextmanager
def engine_with(runner: ModelRunner, **config: object) -> Iterator[BatchEngine]:
    """A BatchEngine over `runner` (a real model's or the sim's) with EngineConfig(**config), shut down after."""
    engine = BatchEngine(runner, EngineConfig(**config), name="test")
    try:
        yield engine
    finally:
        engine.shutdown()
