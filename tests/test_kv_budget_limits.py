"""A decoder's KV budget below the model's context, on real processes with the tiny model: a request
without max_tokens gets what the decoders can hold (not an error), an explicit max_tokens that
cannot fit is the client's 400 naming the field, and a prompt longer than the budget is a 400 too.
Nothing of this reaches a decoder to fail there and be retried as if it had broken."""
from __future__ import annotations

import pytest

from tools.api_client import ApiError, stream_completion

from helpers import random_prompt

BUDGET = 400  # KV positions on RLD and MD, a fifth of the tiny model's context (2,048)
PROMPT_TOKENS = 100


STACK = {"pipeline": "auto", "chunk_tokens": 256,
         "extra_args": {"main": ["--kv-budget-tokens", str(BUDGET)], "relay": ["--kv-budget-tokens", str(BUDGET)]}}


@pytest.mark.parametrize("pipeline", ["p-md", "p-rld-md"])
async def test_without_max_tokens_the_answer_runs_to_what_the_decoders_can_hold(stack, session, tiny_generate,
                                                                                pipeline):
    prompt = random_prompt(60 + len(pipeline), PROMPT_TOKENS)
    result = await stream_completion(session, stack.api_url, {"prompt": prompt, "temperature": 0, "ignore_eos": True,
                                                               "pdd": {"pipeline": pipeline}})
    longest = BUDGET + 1 - PROMPT_TOKENS  # every fed token needs a position; the last output none
    assert result.finish_reason == "length" and len(result.token_ids) == longest
    assert result.token_ids == tiny_generate(prompt, longest)
    assert result.summary["migrations"] == []


async def test_an_explicit_max_tokens_past_the_budget_is_the_clients_400(stack, session):
    body = {"prompt": random_prompt(61, PROMPT_TOKENS), "max_tokens": BUDGET, "temperature": 0}
    with pytest.raises(ApiError) as refused:
        await stream_completion(session, stack.api_url, body)
    assert refused.value.status == 400
    assert refused.value.body["error"]["param"] == "max_tokens" and "KV budget" in str(refused.value)


async def test_a_prompt_longer_than_the_budget_is_a_400(stack, session):
    body = {"prompt": random_prompt(62, BUDGET + 10), "temperature": 0}
    with pytest.raises(ApiError) as refused:
        await stream_completion(session, stack.api_url, body)
    assert refused.value.status == 400 and "KV budget" in str(refused.value)
