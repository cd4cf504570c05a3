"""Fixtures shared by the tests (the tiny model, a reference `generate`), and the `e2e` mark: a
test that starts processes, found from its own code and its fixtures', so `pytest -m "not e2e"`
is the fast tier."""
from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import torch

from shared.models import load_model, load_tokenizer, resolve_model

Generate = Callable[[list[int], int], list[int]]

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
    """An HTTP client for the module's stack, with a bound on every request."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as client:
        yield client
