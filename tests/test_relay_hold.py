"""Don't pay the WAN for what RLD will finish: on real processes with the tiny model, P holds MD's KV
stream back while RLD is predicted to finish first, and sends it once RLD turns out slower. When RLD
does finish first, MD's KV never crosses (the paper's filter, the default), or, with
`--backfill-link-share`, follows in the background for MD's DRC (the backfill).

The gateway believes MD's link carries 4 Mbit/s (--wan-mbps-guess; 240-token prompts stay below
the size P measures a link from), so a fresh prompt's 245 KB take MD 0.5 s after RLD could start.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tools.api_client import stream_completion
from tools.launcher import LocalStack

from helpers import complete, fresh_heartbeats, random_prompt, stack_config

PROMPT_TOKENS = 240
KV_BYTES_PER_TOKEN = 1024  # the tiny model, float32
# the step guess is far below the tiny model's real pace: the first request is held, then released
HELD = ["--wan-mbps-guess", "4", "--decode-step-s-guess", "0.00001"]
STACK = {"pipeline": "auto", "extra_args": {"gateway": HELD}}
complete = functools.partial(complete, ignore_eos=True)


@pytest.fixture(scope="module")
async def stack_with_backfill(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalStack]:
    config = stack_config(tmp_path_factory.mktemp("backfill"), pipeline="auto",
                          extra_args={"gateway": [*HELD, "--backfill-link-share", "0.5"]})
    async with LocalStack(config) as running:
        yield running


async def gateway_counter(session: aiohttp.ClientSession, stack: LocalStack, name: str) -> float:
    async with session.get(stack.api_url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


async def test_a_held_stream_is_released_when_relay_is_slower_than_predicted(stack, session, tiny_generate):
    prompt = random_prompt(1, PROMPT_TOKENS)
    # predicted 12 ms of RLD; it takes over a second even at the tiny model's quickest (1.7 ms a token,
    # seen on a quiet machine: 400 tokens there took RLD 0.7 s, about MD's KV crossing, so no release)
    result = await complete(session, stack, prompt, 1200)
    assert result.summary["pipeline"] == "p-rld-md"
    assert result.summary["policy"]["reason"].startswith("short output"), "held at first"
    assert result.summary["policy"]["main_kv_held"]
    assert await gateway_counter(session, stack, "pdd_main_kv_releases_total") == 1
    assert "main" in result.tiers, "released: MD took over"
    assert result.token_ids == tiny_generate(prompt, 1200)


async def prefill_stats(stack: LocalStack) -> dict[str, float]:
    return (await fresh_heartbeats(stack.nats_url, ("prefill",)))["prefill"].stats


async def backfills_ended(stack: LocalStack, before: dict[str, float], timeout_s: float = 30.0) -> dict[str, float]:
    """P's stats once a backfill started after `before` has ended (done, failed or aborted)."""
    ended = ("backfills_done", "backfills_failed", "backfills_aborted")
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await prefill_stats(stack)
        if sum(stats[k] for k in ended) > sum(before[k] for k in ended) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


async def test_a_short_answer_sends_nothing_over_the_wan_then_backfills_mds_cache(stack_with_backfill, session,
                                                                                  tiny_generate):
    stack = stack_with_backfill
    before = await prefill_stats(stack)
    prompt = random_prompt(2, PROMPT_TOKENS)
    result = await complete(session, stack, prompt, 4)
    assert result.summary["pipeline"] == "p-rld-md" and set(result.tiers) == {"relay"}
    assert result.summary["policy"]["main_kv_held"]
    assert result.token_ids == tiny_generate(prompt, 4)
    after = await backfills_ended(stack, before)
    relay_finished_kv_bytes = after["relay_finished_kv_bytes"] - before["relay_finished_kv_bytes"]
    assert relay_finished_kv_bytes == (PROMPT_TOKENS - 1) * KV_BYTES_PER_TOKEN
    assert after["relay_finished_wan_bytes"] == before["relay_finished_wan_bytes"], "nothing crossed while RLD ran"
    assert after["backfills_done"] == before["backfills_done"] + 1
    assert after["backfill_wan_bytes"] - before["backfill_wan_bytes"] >= (PROMPT_TOKENS - 1) * KV_BYTES_PER_TOKEN
    assert await gateway_counter(session, stack, "pdd_finished_on_relay_total") >= 1
    for beat in (await fresh_heartbeats(stack.nats_url)).values():  # the backfill freed both sides
        assert beat.running == 0 and beat.stats.get("open_inboxes", 0) == 0, beat
        assert beat.stats.get("open_transfers", 0) == 0 and beat.stats.get("locked_nodes", 0) == 0, beat

    # the session's next turn: MD's DRC holds the whole first prompt, only the new turn crosses
    turn = prompt + random_prompt(12, 16)
    for _ in range(50):  # MD's cache events reach the gateway's index a moment after the keep
        result = await complete(session, stack, turn, 4)
        if result.summary["cached_tokens"]["main"]:
            break
        await asyncio.sleep(0.1)
    assert result.summary["cached_tokens"]["main"] == PROMPT_TOKENS - 1
    assert result.token_ids == tiny_generate(turn, 4)


async def test_a_short_answer_sends_nothing_over_the_wan(stack, session, tiny_generate):
    before = await prefill_stats(stack)
    prompt = random_prompt(22, PROMPT_TOKENS)
    result = await complete(session, stack, prompt, 4)
    assert result.summary["pipeline"] == "p-rld-md" and set(result.tiers) == {"relay"}
    assert result.token_ids == tiny_generate(prompt, 4)
    after = await prefill_stats(stack)
    relay_finished_kv_bytes = after["relay_finished_kv_bytes"] - before["relay_finished_kv_bytes"]
    assert relay_finished_kv_bytes == (PROMPT_TOKENS - 1) * KV_BYTES_PER_TOKEN
    assert after["relay_finished_wan_bytes"] == before["relay_finished_wan_bytes"], "MD's stream never left P"
    assert after["kv_bytes_saved_by_abort"] > before["kv_bytes_saved_by_abort"]
    assert after["backfill_wan_bytes"] == before["backfill_wan_bytes"] == 0
    assert await gateway_counter(session, stack, "pdd_finished_on_relay_total") >= 1
    result = await complete(session, stack, prompt + random_prompt(23, 16), 4)
    assert result.summary["cached_tokens"]["main"] == 0, "MD never got the first turn: the next one misses"


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
