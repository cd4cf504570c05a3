"""Requests without max_tokens, on real processes with the tiny model: the default is the rest of the
context, as vLLM's, and MD's KV grows as it decodes instead of being reserved whole. When MD's KV
budget cannot give a step's growth, the newest request is preempted and the gateway restarts it with
the tokens it made; every answer is still exactly transformers' `generate`.

MD's budget (2,200 positions) holds one request grown to the whole context (2,048). For the growth
past it, MD is restarted with 900 positions, which hold one or two answers of 300 tokens to a prompt
of 100 but not three: they outgrow it together at about 300 positions each. (That test is the last
here: it leaves MD with the smaller budget.)
"""
from __future__ import annotations

import asyncio

from tools.api_client import stream_completion

from helpers import RESTART_TIMEOUT_S, fresh_heartbeats, random_prompt

CONTEXT = 2048  # the tiny model's
PROMPT_TOKENS = 100
LONG_PROMPT_TOKENS = 1500
SMALL_BUDGET_TOKENS = 900
ANSWER_TOKENS = 300  # three answers of 100 + 300 positions outgrow 900 together


STACK = {"pipeline": "p-md", "chunk_tokens": 256,
         "extra_args": {"main": ["--kv-budget-tokens", "2200", "--kv-grow-tokens", "32"]}}


async def test_without_max_tokens_the_answer_runs_to_the_end_of_the_context(stack, session, tiny_generate):
    prompt = random_prompt(40, LONG_PROMPT_TOKENS)  # long, so the answer to the end of the context is short
    before = (await fresh_heartbeats(stack.nats_url, ("main",)))["main"].stats["kv_grows"]
    result = await stream_completion(session, stack.api_url, {"prompt": prompt, "temperature": 0,
                                                               "ignore_eos": True})
    assert result.finish_reason == "length" and len(result.token_ids) == CONTEXT - LONG_PROMPT_TOKENS
    assert result.token_ids == tiny_generate(prompt, CONTEXT - LONG_PROMPT_TOKENS)
    grows = (await fresh_heartbeats(stack.nats_url, ("main",)))["main"].stats["kv_grows"] - before
    # grown as it decoded, not reserved whole: from the prompt and 32 positions by a quarter of what it
    # held (1,532 to 2,047 positions is 2 growths; 32 at a time would be 16; reserved whole, none)
    assert 1 <= grows <= 4, grows


async def test_growth_past_the_budget_preempts_and_restarts_the_newest_token_exact(stack, session, tiny_generate):
    await stack.restart("main", ["--kv-budget-tokens", str(SMALL_BUDGET_TOKENS)])  # the last flag wins
    beat = (await fresh_heartbeats(stack.nats_url, ("main",), RESTART_TIMEOUT_S))["main"]
    assert beat.kv_budget_tokens == SMALL_BUDGET_TOKENS
    await stack.wait_healthy(RESTART_TIMEOUT_S)
    before = beat.stats["preemptions"]
    prompts = [random_prompt(41 + i, PROMPT_TOKENS) for i in range(3)]

    async def complete(prompt: list[int]):
        body = {"prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True}
        return await stream_completion(session, stack.api_url, body)

    results = await asyncio.gather(*(complete(p) for p in prompts))
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == "length"
        assert result.token_ids == tiny_generate(prompt, ANSWER_TOKENS)
    restarts = [m for r in results for m in r.summary["migrations"]]
    assert restarts and all(m["preempted"] and m["lost"] == "main" for m in restarts)
    after = (await fresh_heartbeats(stack.nats_url, ("main",)))["main"].stats
    assert after["preemptions"] - before == len(restarts)
    assert after["kv_used_tokens"] == 0
