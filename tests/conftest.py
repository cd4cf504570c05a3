"""Fixtures shared by the tests (the tiny model, a reference `generate`, the module's stack), and
the `e2e` mark: a test that starts processes, found from its own code and its fixtures', so
`pytest -m "not e2e"` is the fast tier."""
from __future__ import annotations

import functools
import inspect
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import torch

from shared.models import load_model, load_tokenizer, resolve_model
from tools.launcher import LocalStack

from helpers import SharedStacks, stack_config

Generate = Callable[[list[int], int], list[int]]

# The suite's stacks fork their Python services from a fork server that imported them once per
# worker (tools/fork_server.py), not a fresh interpreter each: the imports were most of a stack
# start's CPU. `pdd up` run by a test inherits it; README's commands (scripts/smoke.sh) do not.
os.environ.setdefault("PDD_FORK_SERVER", "1")

# What starts a process: a stack, a nats-server, a service, a CLI run, a compose check.
STARTS_PROCESSES = ("LocalStack", "subprocess.", "Popen", "create_subprocess", "restart_patched", "run_stack",
                    "pdd_up", "_pdd_command")


@functools.cache
def _starts_processes(func: Callable[..., object]) -> bool:
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    return any(word in source for word in STARTS_PROCESSES)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not isinstance(item, pytest.Function) or item.get_closest_marker("e2e"):
            continue
        fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        if any(_starts_processes(func) for func in (item.function, *fixtures)):
            item.add_marker(pytest.mark.e2e)


def reference_generate(model_path: Path, dtype: str = "float32") -> Generate:
    """transformers' own greedy `generate`, the ground truth every pipeline must match."""
    model = load_model(model_path, dtype, "cpu")

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        input_ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=model.config.eos_token_id)
        return out[0, len(prompt_ids):].tolist()

    return generate


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path: Path):
    return load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def tiny_generate(tiny_path: Path) -> Generate:
    return reference_generate(tiny_path)


@pytest.fixture(scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client for the module's stack, with a bound on every request. It drops a connection idle
    for 5 s: the gateway closes one idle for 10 s (its --header-timeout-s), and a request sent on a
    connection the gateway is closing fails as ServerDisconnected (seen when a loaded machine makes
    the gap between a test's requests long)."""
    connector = aiohttp.TCPConnector(keepalive_timeout=5.0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as client:
        yield client


@pytest.fixture(scope="module")
def stack_overrides(request: pytest.FixtureRequest) -> dict[str, object]:
    """What the module's stack changes from helpers.TINY_STACK: the module's `STACK`. A module whose
    changes are made at run time (a free port, a key file, an environment variable) overrides this."""
    return dict(getattr(request.module, "STACK", {}))


@pytest.fixture(scope="session")
async def shared_stacks(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SharedStacks]:
    stacks = SharedStacks(tmp_path_factory.mktemp("shared-stacks"))
    try:
        yield stacks
    finally:
        await stacks.aclose()


@pytest.fixture(scope="module")
async def stack(request: pytest.FixtureRequest, stack_overrides: dict[str, object], shared_stacks: SharedStacks,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalStack]:
    """The module's stack, started once for its tests. A module that sets SHARE_STACK = True (its tests
    leave the stack as they found it) gets one it shares with other such modules of the same STACK."""
    if getattr(request.module, "SHARE_STACK", False):
        yield await shared_stacks.get(**stack_overrides)
        return
    async with LocalStack(stack_config(tmp_path_factory.mktemp("stack"), **stack_overrides)) as running:
        yield running
