"""One-Shot and Catch-Up handoffs, and anomalous-traffic filtering, on real processes (tiny model)."""
from __future__ import annotations

import asyncio
import functools

import pytest

from helpers import complete, fresh_heartbeats, random_prompt

CATCH_UP_THRESHOLD = 8
HEARTBEAT_S = 0.25
BEAT = ["--heartbeat-s", str(HEARTBEAT_S)]
STACK = {"extra_args": {"relay": ["--catch-up-threshold", str(CATCH_UP_THRESHOLD), *BEAT],
                        "prefill": BEAT, "gateway": BEAT,
                        # the tiny model steps in about a millisecond: let a hold reach as far as
                        # RLD's announced cut, and wait for a cut that comes late by a loaded
                        # machine's messaging (tens of ms)
                        "main": [*BEAT, "--hold-steps", "1000", "--hold-grace-s", "0.5"]}}
complete = functools.partial(complete, ignore_eos=True, pipeline="p-rld-md")


@pytest.mark.parametrize(("mode", "seed"), [("one-shot", 21), ("catch-up", 22)])
async def test_handoff_is_token_exact_in_both_modes(stack, session, tiny_generate, mode, seed):
    prompt = random_prompt(seed, 200)
    result = await complete(session, stack, prompt, 120, handoff_mode=mode, md_kv_delay_ms=60)
    assert result.token_ids == tiny_generate(prompt, 120)
    assert len(result.token_ids) == 120 and result.tiers[0] == "relay"
    assert "main" in result.tiers and result.handoff is not None, "MD's KV came 60 ms late: MD took over"
    cut = result.tiers.index("main")
    assert set(result.tiers[:cut]) == {"relay"} and set(result.tiers[cut:]) == {"main"}, "no interleaving"
    assert result.handoff["eager_tokens"] == cut
    if mode == "one-shot":
        assert result.handoff["chunks"] == 1 and result.handoff["mode"] == "one-shot"
    else:  # MD's KV came tens of steps late: a first chunk, streamed tokens, then the cut
        assert result.handoff["mode"] == "catch-up" and result.handoff["chunks"] >= 2


async def test_catch_up_hands_off_in_chunks_and_cuts_exactly_where_told(stack, session, tiny_generate):
    prompt = random_prompt(11, 150)
    result = await complete(session, stack, prompt, 80, handoff_mode="catch-up", handoff_at=40)
    assert result.token_ids == tiny_generate(prompt, 80)
    assert result.tiers == ["relay"] * 40 + ["main"] * 40
    assert result.handoff["mode"] == "catch-up" and result.handoff["chunks"] >= 2
    assert result.handoff["eager_tokens"] == 40


async def test_rld_announces_its_cut_and_md_expects_it(stack, session, tiny_generate):
    """While MD is busy with another request, RLD announces the pinned cut (CutComing) as it
    starts the step making the last eager token, and MD's engine expects the cut's pass, so it
    may hold a step for it instead of making it wait one out. Tokens stay exact."""
    before = await fresh_heartbeats(stack.nats_url)
    busy_prompt = random_prompt(31, 40)
    busy = asyncio.create_task(complete(session, stack, busy_prompt, 800, pipeline="p-md"))
    await asyncio.sleep(0.3)
    prompt = random_prompt(32, 120)
    # the cut is announced only if MD reports its KV in before RLD makes its 60th token; under a
    # loaded machine a cut at 30 tokens sometimes came first (then RLD cuts on the report, unannounced)
    result = await complete(session, stack, prompt, 90, handoff_mode="one-shot", handoff_at=60)
    assert not busy.done(), "MD was decoding the other request throughout"
    assert result.token_ids == tiny_generate(prompt, 90)
    assert result.tiers == ["relay"] * 60 + ["main"] * 30
    assert (await busy).token_ids == tiny_generate(busy_prompt, 800)
    after = await fresh_heartbeats(stack.nats_url)
    assert after["relay"].stats["cuts_announced"] == before["relay"].stats["cuts_announced"] + 1
    # MD's engine took the announcement, and the cut came within its grace: a step was held for it,
    # or the cut was there before the engine was ready to step (tests/test_batch_engine.py holds one)
    assert after["main"].stats["announced"] == before["main"].stats["announced"] + 1
    assert after["main"].stats["announced_late"] == before["main"].stats["announced_late"]


async def test_relay_finishing_first_aborts_the_wan_transfer_and_frees_both_sides(stack, session, tiny_generate):
    before = (await fresh_heartbeats(stack.nats_url))["prefill"].stats
    prompt = random_prompt(12, 300)
    result = await complete(session, stack, prompt, 3, md_kv_delay_ms=5000)
    assert result.token_ids == tiny_generate(prompt, 3) and set(result.tiers) == {"relay"}
    assert "main" not in result.summary["kv"], "MD never received the KV"
    await asyncio.sleep(0.3)
    after = await fresh_heartbeats(stack.nats_url)
    assert after["prefill"].stats["aborted_transfers"] == before["aborted_transfers"] + 1
    saved = after["prefill"].stats["kv_bytes_saved_by_abort"] - before["kv_bytes_saved_by_abort"]
    assert saved == 299 * after["prefill"].kv_bytes_per_token, "nothing of the prompt crossed"
    for beat in after.values():
        assert beat.running == 0 and beat.stats.get("open_inboxes", 0) == 0
        assert beat.stats.get("open_transfers", 0) == 0 and beat.stats.get("locked_nodes", 0) == 0
