"""Prefill's own logic: compute a prompt's KV chunk by chunk. Knows nothing of NATS or sockets.

P computes KV for every prompt token except the last: the decoder feeds the last prompt token
itself, so the first output token always comes from the decoder that holds the KV.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from shared.model_runner import ModelRunner


def chunk_ranges(n_tokens: int, chunk_tokens: int, start: int = 0) -> list[tuple[int, int]]:
    """Positions [start, n_tokens) cut into chunks of at most chunk_tokens."""
    return [(first, min(n_tokens, first + chunk_tokens)) for first in range(start, n_tokens, chunk_tokens)]


def slice_for_target(kv: torch.Tensor, chunk: tuple[int, int], token_start: int) -> tuple[int, torch.Tensor] | None:
    """The part of a chunk's KV at or past a target's token_start, as (first position, kv)."""
    start, end = chunk
    first = max(start, token_start)
    if first >= end:
        return None
    return first, kv[:, :, :, first - start:end - start]


class Prefiller:
    def __init__(self, runner: ModelRunner, chunk_tokens: int) -> None:
        self.runner = runner
        self.chunk_tokens = chunk_tokens

    def new_cache(self) -> DynamicCache:
        return self.runner.new_cache()

    def compute_chunk(self, cache: DynamicCache, token_ids: list[int], chunk: tuple[int, int]) -> torch.Tensor:
        """Run positions [start, end) (the cache holds [0, start)); return their KV."""
        start, end = chunk
        self.runner.forward(cache, token_ids[start:end])
        return self.runner.kv_slice(cache, start, end).to("cpu")
