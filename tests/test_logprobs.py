"""Logprobs: the chosen token's and the likeliest tokens' logprobs under the model's raw distribution,
computed in the engine's step, carried on TokenChunk, and shown with each token's own strings."""
from __future__ import annotations

import pytest
import torch

from services.gateway.http.detokenizer import TokenStrings
from shared import messages
from shared.batch_engine import BatchEngine
from shared.config import EngineConfig
from shared.messages import TokenChunk
from shared.model_runner import DecodeSequence, ModelRunner
from shared.models import load_model, load_tokenizer
from shared.sampling import MIN_LOGPROB, sample_rows
from shared.sampling_params import SamplingParams, SamplingRow, TokenLogprob


def test_logprobs_come_from_the_raw_logits_before_any_option() -> None:
    torch.manual_seed(3)
    logits = torch.randn(1, 100)
    raw = torch.log_softmax(logits[0], dim=-1)
    params = SamplingParams(temperature=0.5, seed=2, top_k=3, min_p=0.1, presence_penalty=2.0,
                            logit_bias={7: 50.0}, logprobs=4)
    picked = sample_rows(logits, [SamplingRow(params, 0, (), [int(raw.argmax())])])[0]
    assert picked.token_id == 7  # the bias decides the token ...
    assert picked.logprob.logprob == pytest.approx(float(raw[7]))  # ... but not its logprob
    expected = raw.topk(4)
    assert [t for t, _ in picked.logprob.top] == expected.indices.tolist()
    assert [v for _, v in picked.logprob.top] == pytest.approx(expected.values.tolist())


def test_only_the_rows_that_ask_get_logprobs_each_as_many_as_it_asks() -> None:
    logits = torch.randn(3, 50)
    rows = [SamplingRow(SamplingParams(logprobs=0), 0), SamplingRow(SamplingParams(), 0),
            SamplingRow(SamplingParams(logprobs=5, temperature=1.0, seed=1), 4)]
    picked = sample_rows(logits, rows)
    assert picked[0].logprob.top == () and picked[1].logprob is None and len(picked[2].logprob.top) == 5
    alone = sample_rows(logits[2:], rows[2:])[0]
    assert alone == picked[2]  # what shares the step changes nothing


def test_an_impossible_token_has_a_finite_logprob() -> None:
    logits = torch.tensor([[0.0, float("-inf")]])
    row = SamplingRow(SamplingParams(logprobs=2, logit_bias={1: 100.0}), 0)
    picked = sample_rows(logits, [row])[0]
    assert picked.token_id == 0 and picked.logprob.top == ((0, 0.0), (1, MIN_LOGPROB))


def test_token_chunks_carry_logprobs_and_old_ones_still_decode() -> None:
    chunk = TokenChunk("r", 3, [42], "relay", None, [TokenLogprob(-0.123456789, ((42, -0.123456789), (7, -2.5)))])
    assert messages.decode(messages.encode(chunk)) == chunk
    old = b'{"type": "TokenChunk", "request_id": "r", "start": 0, "token_ids": [1], "tier": "main"}'
    assert messages.decode(old) == TokenChunk("r", 0, [1], "main")


def test_token_strings_are_each_tokens_own_text_and_bytes(tiny_path) -> None:
    tokenizer = load_tokenizer(tiny_path)
    strings = TokenStrings(tokenizer)
    text = " Hello café 🎉 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert [strings.text(t) for t in ids] == [tokenizer.decode([t]) for t in ids]
    assert b"".join(bytes(strings.get(t)[1]) for t in ids).decode() == text  # the emoji's pieces have its bytes
    assert strings.text(tokenizer.eos_token_id) == tokenizer.eos_token  # special tokens are shown


@pytest.fixture(scope="module")
def runner(tiny_path) -> ModelRunner:
    return ModelRunner(load_model(tiny_path, "float32", "cpu"))


async def test_the_engine_puts_each_sampled_tokens_logprobs_on_its_sequence(runner) -> None:
    prompt_ids = [5, 17, 300, 42, 9]
    kv = runner.new_kv(len(prompt_ids) + 4)
    expected = torch.log_softmax(runner.forward(kv, prompt_ids), dim=-1)
    engine = BatchEngine(runner, EngineConfig(), name="test")
    try:
        params = SamplingParams(max_tokens=4, logprobs=2, presence_penalty=1.0)
        seq = DecodeSequence("r", prompt_ids, params, runner.max_context_tokens)
        await engine.open("r", [], seq.kv_tokens_needed, seq)
        token, finish_reason = await engine.step(seq, prompt_ids)
        assert finish_reason is None and seq.output_ids == [token]
        assert seq.last_logprob.logprob == pytest.approx(float(expected[token]), abs=1e-4)
        assert [t for t, _ in seq.last_logprob.top] == expected.topk(2).indices.tolist()
        plain = DecodeSequence("p", prompt_ids, SamplingParams(max_tokens=4), runner.max_context_tokens)
        await engine.open("p", [], plain.kv_tokens_needed, plain)
        await engine.step(plain, prompt_ids)
        assert plain.last_logprob is None
    finally:
        engine.release("r")
        engine.release("p")
        engine.shutdown()
