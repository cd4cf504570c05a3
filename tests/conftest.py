"""Fixtures shared by the end-to-end tests: the tiny model and a reference `generate`."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import torch

from shared.models import load_model, load_tokenizer, resolve_model

Generate = Callable[[list[int], int], list[int]]


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
