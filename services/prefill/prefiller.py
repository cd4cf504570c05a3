"""Prefill's own logic: compute a prompt's KV chunk by chunk. Knows nothing of NATS or sockets.

P computes KV for every prompt token except the last: the decoder feeds the last prompt token
itself, so the first output token always comes from the decoder that holds the KV.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import torch

from shared.batch_engine import BatchEngine, Scoring
from shared.sampling_params import TokenLogprob


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


@dataclass(frozen=True)
class ComputedChunk:
    """One chunk of a prompt computed: its positions' KV (on the CPU) and, when scored, the logprobs
    of prompt tokens start+1..end; when it could first run (submitted, and the prompt's previous
    chunk done) and when its forward began (time.time_ns)."""

    span: tuple[int, int]
    kv: torch.Tensor
    logprobs: list[TokenLogprob] | None
    ready_ns: int
    started_ns: int


class Prefiller:
    """Prompts' chunks go through the batch engine, so chunks of several prompts share a forward."""

    def __init__(self, engine: BatchEngine, chunk_tokens: int) -> None:
        self.engine = engine
        self.chunk_tokens = chunk_tokens

    async def open(self, request_id: str, kv_tokens: int, cached_kv: Sequence[torch.Tensor] = (),
                   background: bool = False) -> None:
        """Room for a prompt's KV, starting with the positions P's cache already had (its pieces, in
        order). A `background` prompt's chunks (a warm-up nobody waits for) go after everyone else's."""
        await self.engine.open(request_id, cached_kv, kv_tokens, background=background)

    async def chunks(self, request_id: str, prompt_ids: list[int], start: int,
                     top_n: int | None = None) -> AsyncGenerator[ComputedChunk, None]:
        """The KV of positions [start, n-1) of an n-token prompt, chunk by chunk, in order (the KV
        holds [0, start)).

        The next chunk is queued in the engine before one is handed out, so the engine finds it
        when this one's step ends, and work that came in meanwhile does not take its place. With
        `top_n`, also the logprobs of prompt tokens start+1..end, each given the tokens before it,
        with the top_n likeliest there: the logits after position i score token i+1, so the last
        chunk (which ends before the prompt's last token) scores the whole prompt but its first
        token. Use it in `contextlib.aclosing`: closing it withdraws what is still queued."""
        queued: deque[tuple[tuple[int, int], asyncio.Task]] = deque()
        spans = iter(chunk_ranges(len(prompt_ids) - 1, self.chunk_tokens, start))

        def queue_next() -> None:
            span = next(spans, None)
            if span is not None:
                queued.append((span, asyncio.ensure_future(self._compute(request_id, prompt_ids, span, top_n))))

        queue_next()
        previous_done_ns = 0
        try:
            while queued:
                queue_next()
                span, task = queued.popleft()
                (kv, logprobs), submitted_ns, started_ns = await task
                done_ns = time.time_ns()
                yield ComputedChunk(span, kv, logprobs, max(submitted_ns, previous_done_ns), started_ns)
                previous_done_ns = done_ns
        finally:
            for _, task in queued:
                if not task.cancel() and not task.cancelled():
                    task.exception()  # it had ended: its failure is the caller's, not an unretrieved warning

    async def _compute(self, request_id: str, prompt_ids: list[int], span: tuple[int, int],
                       top_n: int | None) -> tuple[tuple[torch.Tensor, list[TokenLogprob] | None], int, int]:
        start, end = span
        score = None if top_n is None else Scoring(prompt_ids[start + 1:end + 1], top_n)
        result, submitted_ns, started_ns = await self.engine.submit_timed(
            request_id, prompt_ids[start:end], sample=False, return_kv=True, score=score)
        return (result if score is not None else (result, None)), submitted_ns, started_ns

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)
