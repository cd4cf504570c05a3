"""Prefill's own logic: compute a prompt's KV chunk by chunk. Knows nothing of NATS or sockets.

P computes KV for every prompt token except the last: the decoder feeds the last prompt token
itself, so the first output token always comes from the decoder that holds the KV.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.batch_engine import BatchEngine, Scoring
from shared.sampling import TokenLogprob


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
    """Prompts' chunks go through the batch engine, so chunks of several prompts share a forward."""

    def __init__(self, engine: BatchEngine, chunk_tokens: int) -> None:
        self.engine = engine
        self.chunk_tokens = chunk_tokens

    async def open(self, request_id: str, kv_tokens: int, cached_kv: Sequence[torch.Tensor] = ()) -> None:
        """Room for a prompt's KV, starting with the positions P's cache already had (its pieces, in order)."""
        await self.engine.open(request_id, cached_kv, kv_tokens)

    async def compute_chunk(self, request_id: str, token_ids: list[int],
                            chunk: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
        """Run positions [start, end) (the KV holds [0, start)): their KV on the CPU, and when the
        chunk was submitted and its forward began (time.time_ns)."""
        start, end = chunk
        return await self.engine.submit_timed(request_id, token_ids[start:end], sample=False, return_kv=True)

    async def compute_scored_chunk(self, request_id: str, prompt_ids: list[int], chunk: tuple[int, int],
                                   top_n: int) -> tuple[torch.Tensor, list[TokenLogprob], int, int]:
        """As compute_chunk, and the logprobs of prompt tokens start+1..end, each given the tokens before
        it, with the top_n likeliest there: the logits after position i score token i+1, so the last
        chunk (which ends before the prompt's last token) scores the whole prompt but its first token."""
        start, end = chunk
        (kv, logprobs), submitted_ns, started_ns = await self.engine.submit_timed(
            request_id, prompt_ids[start:end], sample=False, return_kv=True,
            score=Scoring(prompt_ids[start + 1:end + 1], top_n))
        return kv, logprobs, submitted_ns, started_ns

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)
