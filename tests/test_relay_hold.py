"""Don't pay the WAN for what RLD will finish: on real processes with the tiny model, P holds MD's KV
stream back while RLD is predicted to finish first, and sends it once RLD turns out slower.

The gateway believes MD's link carries 4 Mbit/s (--wan-mbps-guess; 240-token prompts stay below
the size P measures a link from), so a fresh prompt's 245 KB take MD 0.5 s after RLD could start.
"""
from __future__ import annotations

import aiohttp
import pytest

from tools.api_client import stream_completion
from tools.launcher import LocalStack
from tools.stack_config import StackConfig

from helpers import fresh_heartbeats, random_prompt

PROMPT_TOKENS = 240
KV_BYTES_PER_TOKEN = 1024  # the tiny model, float32


@pytest.fixture(scope="module")
async def stack(tmp_path_factory):
    # the step guess is far below the tiny model's real pace: the first request is held, then released
    config = StackConfig(model="tiny", port=0, log_dir=tmp_path_factory.mktemp("logs"), torch_threads=1,
                         chunk_tokens=64, pipeline="auto", startup_timeout_s=120,
                         extra_args={"gateway": ["--wan-mbps-guess", "4", "--decode-step-s-guess", "0.00001"]})
    async with LocalStack(config) as running:
        yield running


async def complete(session, stack, prompt_ids, max_tokens):
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return await stream_completion(session, stack.api_url, body)


async def gateway_counter(session: aiohttp.ClientSession, stack: LocalStack, name: str) -> float:
    async with session.get(stack.api_url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def test_a_held_stream_is_released_when_relay_is_slower_than_predicted(stack, session, tiny_generate):
    prompt = random_prompt(1, PROMPT_TOKENS)
    result = await complete(session, stack, prompt, 400)  # predicted 4 ms of RLD; it takes seconds
    assert result.summary["pipeline"] == "p-rld-md"
    assert result.summary["policy"]["reason"].startswith("short output"), "held at first"
    assert result.summary["policy"]["main_kv_held"]
    assert await gateway_counter(session, stack, "pdd_main_kv_releases_total") == 1
    assert "main" in result.tiers, "released: MD took over"
    assert result.token_ids == tiny_generate(prompt, 400)


async def test_a_short_answer_sends_nothing_over_the_wan(stack, session, tiny_generate):
    before = (await fresh_heartbeats(stack.nats_url, ("prefill",)))["prefill"].stats
    prompt = random_prompt(2, PROMPT_TOKENS)
    result = await complete(session, stack, prompt, 4)
    assert result.summary["pipeline"] == "p-rld-md" and set(result.tiers) == {"relay"}
    assert result.token_ids == tiny_generate(prompt, 4)
    after = (await fresh_heartbeats(stack.nats_url, ("prefill",)))["prefill"].stats
    assert after["relay_finished_kv_bytes"] - before["relay_finished_kv_bytes"] == (PROMPT_TOKENS - 1) * KV_BYTES_PER_TOKEN
    assert after["relay_finished_wan_bytes"] == before["relay_finished_wan_bytes"], "MD's stream never left P"
    assert after["kv_bytes_saved_by_abort"] > before["kv_bytes_saved_by_abort"]
    assert await gateway_counter(session, stack, "pdd_finished_on_relay_total") >= 1


async def test_a_request_that_names_its_handoff_is_never_held(stack, session, tiny_generate):
    """Held, RLD would wait at the cut for KV that P keeps back until RLD turns out slow, which a
    4-token answer never does: the request would get no token after its cut."""
    prompt = random_prompt(3, PROMPT_TOKENS)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "pdd": {"pipeline": "p-rld-md", "handoff_at": 2}}
    result = await stream_completion(session, stack.api_url, body)
    assert result.summary["pipeline"] == "p-rld-md" and not result.summary["policy"]["main_kv_held"]
    assert result.tiers == ["relay"] * 2 + ["main"] * 2
    assert result.token_ids == tiny_generate(prompt, 4)
