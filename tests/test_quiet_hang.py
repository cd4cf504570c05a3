"""The quiet hang (issue 16, item 1): a P-MD request for a prompt P-RLD-MD had just served.

The first request leaves the whole prompt in MD's DRC, so the second one needs no KV: MD decodes
the moment it is assigned, in datacenter B, while the gateway's interest in the request's events
is still on its way there from A. A decoder that publishes before B knows anyone listens is
dropped by NATS without a word, and the client waits for the next-token deadline. The gateway
listens for every request's events from its start, so nothing a decoder says is lost.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tools.api_client import StreamResult, stream_completion
from tools.launcher import LocalStack

from helpers import random_prompt
from test_two_dc import BASE_LINK, TOKEN_TIMEOUT_S
from test_two_dc import STACK as TWO_DC

PAIRS = 200
PAIRS_AT_ONCE = 4  # pairs run side by side; within a pair the P-MD request follows the P-RLD-MD one
MAX_TOKENS = 8  # enough that MD takes over (and keeps the prompt) rather than RLD finishing alone
FIRST_TOKEN_S = 10.0
STACK = TWO_DC


@pytest.fixture(scope="module")
async def stack(stack: LocalStack) -> LocalStack:
    """conftest's stack, with the link at its base."""
    await stack.wan.set_link(**BASE_LINK)
    return stack


async def first_token_within(session: aiohttp.ClientSession, stack: LocalStack, prompt: list[int],
                             pipeline: str) -> StreamResult | None:
    """The finished request, or None if no token came within FIRST_TOKEN_S (the request is dropped)."""
    first_token = asyncio.Event()
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "pdd": {"pipeline": pipeline}}
    request = asyncio.create_task(stream_completion(session, stack.api_url, body,
                                                    on_token=lambda index, tier: first_token.set()))
    try:
        async with asyncio.timeout(FIRST_TOKEN_S):
            await first_token.wait()
    except TimeoutError:
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        return None
    async with asyncio.timeout(TOKEN_TIMEOUT_S * MAX_TOKENS):
        return await request


async def test_p_md_after_p_rld_md_of_the_same_prompt_always_streams(
        stack: LocalStack, session: aiohttp.ClientSession) -> None:
    hung: list[str] = []
    full_hits = 0
    mismatched: list[int] = []

    async def pair(seed: int) -> None:
        nonlocal full_hits
        prompt = random_prompt(16_000 + seed, 20 + (seed * 37) % 180)
        served: dict[str, StreamResult] = {}
        for pipeline in ("p-rld-md", "p-md"):
            result = await first_token_within(session, stack, prompt, pipeline)
            if result is None:
                hung.append(f"pair {seed} ({len(prompt)} tokens): {pipeline}")
                return
            assert result.summary["pipeline"] == pipeline, result.summary
            served[pipeline] = result
        if served["p-md"].summary["cached_tokens"]["main"] == len(prompt) - 1:
            full_hits += 1  # MD had the whole prompt: the path that used to hang
        if served["p-md"].token_ids != served["p-rld-md"].token_ids:
            mismatched.append(seed)

    started = time.monotonic()
    for first in range(0, PAIRS, PAIRS_AT_ONCE):
        await asyncio.gather(*(pair(seed) for seed in range(first, min(PAIRS, first + PAIRS_AT_ONCE))))
    elapsed_s = time.monotonic() - started

    assert not hung, f"{len(hung)} of {2 * PAIRS} requests had no token within {FIRST_TOKEN_S:g}s: {hung}"
    assert not mismatched, f"P-MD from MD's DRC differs from P-RLD-MD for pairs {mismatched}"
    assert full_hits >= PAIRS // 2, f"only {full_hits} of {PAIRS} P-MD requests found the whole prompt in the DRC"
    print(f"{PAIRS} pairs in {elapsed_s:.1f}s, {full_hits} full DRC hits")
