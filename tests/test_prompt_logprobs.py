"""A prompt's logprobs (completions `echo` with `logprobs`, the loglikelihood requests evaluation
harnesses send): P scores every prompt token but the first from the logits of its chunks, equal to
transformers' own forward over the prompt; served by P alone for `max_tokens: 0`, before the answer
otherwise."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from services.prefill.prefiller import Prefiller, chunk_ranges
from shared.batch_engine import BatchEngine
from shared.config import EngineConfig
from shared.model_runner import DecodeSequence, ModelRunner
from shared.models import load_model
from shared.sampling import SamplingParams, TokenLogprob

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path, "float32", "cpu")


def reference(model, prompt_ids: list[int], top_n: int) -> list[tuple[float, list[int]]]:
    """transformers' forward over the whole prompt: each token's logprob given the tokens before it
    (from the second on), and the top_n likeliest token ids there."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [(logprobs[i - 1, prompt_ids[i]].item(), logprobs[i - 1].topk(top_n).indices.tolist())
            for i in range(1, len(prompt_ids))]


def assert_matches(scored: list[TokenLogprob], expected: list[tuple[float, list[int]]]) -> None:
    assert len(scored) == len(expected)
    for i, (entry, (logprob, top_ids)) in enumerate(zip(scored, expected)):
        assert entry.logprob == pytest.approx(logprob, abs=TOLERANCE), f"prompt token {i + 1}"
        assert [token for token, _ in entry.top] == top_ids, f"prompt token {i + 1}"


async def prefill_scored(prefiller: Prefiller, key: str, prompt_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """P's loop for one prompt: every chunk of positions [0, n-1) through the engine, scored."""
    kv_tokens = len(prompt_ids) - 1
    await prefiller.open(key, kv_tokens)
    try:
        scored: list[TokenLogprob] = []
        for chunk in chunk_ranges(kv_tokens, prefiller.chunk_tokens):
            _, logprobs, _, _ = await prefiller.compute_scored_chunk(key, prompt_ids, chunk, top_n)
            scored += logprobs
        return scored
    finally:
        prefiller.release(key)


async def test_chunked_prompt_logprobs_equal_transformers_forward_beside_other_work(model):
    """Chunks split across steps (the batch budget is smaller than a chunk) and sharing them with a
    decode that samples and a prefill that is not scored: each row's logits go to their own work."""
    rng = random.Random(3)
    vocab = model.config.vocab_size
    prompt_ids = [rng.randrange(vocab) for _ in range(150)]
    other_ids = [rng.randrange(vocab) for _ in range(90)]
    engine = BatchEngine(ModelRunner(model), EngineConfig(max_batch_tokens=48), name="test")
    try:
        prefiller = Prefiller(engine, chunk_tokens=64)
        seq = DecodeSequence("decode", other_ids[:5], SamplingParams(max_tokens=30, ignore_eos=True),
                             engine.runner.max_context_tokens)

        async def decode() -> None:
            await engine.open("decode", [], seq.kv_tokens_needed, seq)
            try:
                await engine.step(seq, seq.prompt_ids)
                while len(seq.output_ids) < 30:
                    await engine.step(seq, seq.output_ids[-1:])
            finally:
                engine.release("decode")

        async def unscored() -> None:
            await prefiller.open("plain", len(other_ids) - 1)
            try:
                for chunk in chunk_ranges(len(other_ids) - 1, 64):
                    await prefiller.compute_chunk("plain", other_ids, chunk)
            finally:
                prefiller.release("plain")

        scored, *_ = await asyncio.gather(prefill_scored(prefiller, "scored", prompt_ids, 3), decode(), unscored())
    finally:
        engine.shutdown()
    assert_matches(scored, reference(model, prompt_ids, 3))
