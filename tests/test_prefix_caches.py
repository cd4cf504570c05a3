"""P's prefix cache, MD's Decode-side RadixCache (DRC) and RLD's cache on real processes with the
tiny model: token-exact at every hit length, only the missing suffix's KV crosses to MD (and to
RLD), nothing leaks."""
from __future__ import annotations

import asyncio
import functools
import random

from helpers import abandon_stream, complete, fresh_heartbeats, random_prompt

P_CACHE_TOKENS = 300  # small on purpose: a long prompt does not fit, so MD's hit can exceed P's
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 16 * 4  # tiny model: layers x (K, V) x kv heads x head dim x fp32
HEARTBEAT_S = 0.25
BEAT = ["--heartbeat-s", str(HEARTBEAT_S)]
STACK = {"extra_args": {"prefill": ["--cache-tokens", str(P_CACHE_TOKENS), *BEAT],
                        "relay": BEAT, "main": BEAT, "gateway": BEAT}}
complete = functools.partial(complete, pipeline="p-md")


def hits(result) -> tuple[int, int]:
    cached = result.summary["cached_tokens"]
    assert result.usage["prompt_tokens_details"]["cached_tokens"] == cached["prefill"]
    return cached["prefill"], cached["main"]


async def test_no_partial_and_full_hits_are_token_exact(stack, session, tiny_generate):
    prompt = random_prompt(1, 120)
    first = await complete(session, stack, prompt, 16)
    assert hits(first) == (0, 0)
    assert first.summary["kv"]["main"]["kv_tokens"] == 119

    again = await complete(session, stack, prompt, 16)
    assert hits(again) == (119, 119), "the whole prompt (but its last token) is cached on both sides"
    assert again.summary["kv"]["main"]["kv_tokens"] == 0 and again.summary["kv"]["main"]["kv_bytes"] == 0

    branch = prompt[:80] + random_prompt(2, 40)
    partial = await complete(session, stack, branch, 16)
    assert hits(partial) == (80, 80)
    assert partial.summary["kv"]["main"]["kv_tokens"] == 39
    for result, ids in ((first, prompt), (again, prompt), (partial, branch)):
        assert result.token_ids == tiny_generate(ids, 16)


async def test_main_hit_longer_than_prefill_hit(stack, session, tiny_generate):
    prompt = random_prompt(3, 400)  # longer than P's cache: P keeps only a prefix of it
    await complete(session, stack, prompt, 16)
    again = await complete(session, stack, prompt, 16)
    p_hit, md_hit = hits(again)
    assert p_hit <= P_CACHE_TOKENS < md_hit == 399
    assert again.token_ids == tiny_generate(prompt, 16)


async def test_main_hit_shorter_than_prefill_hit(stack, session, tiny_generate):
    prompt = random_prompt(4, 150)
    # RLD finishes 2 tokens long before MD's (slow) KV arrives, so MD never stores this prompt
    early = await complete(session, stack, prompt, 2, pipeline="p-rld-md", md_kv_delay_ms=3000)
    assert set(early.tiers) == {"relay"} and "main" not in early.summary["kv"]
    again = await complete(session, stack, prompt, 16)
    p_hit, md_hit = hits(again)
    assert p_hit == 149 and md_hit < p_hit
    assert again.summary["kv"]["main"]["kv_tokens"] == 149 - md_hit
    assert again.token_ids == tiny_generate(prompt, 16)


async def test_multi_turn_session_sends_only_each_turns_new_tokens_to_main(stack, session, tiny_generate):
    history = random_prompt(5, 200)
    previous_len = 0
    for turn in range(4):
        result = await complete(session, stack, history, 12)
        assert result.token_ids == tiny_generate(history, 12)
        kv = result.summary["kv"]["main"]
        if turn > 0:
            # MD kept the last turn's prompt and answer; only the new tool output crosses
            assert kv["cached_tokens"] == previous_len + 12 - 1
            assert kv["kv_tokens"] == len(history) - 1 - kv["cached_tokens"]
            assert kv["kv_bytes"] < (kv["kv_tokens"] + 8) * KV_BYTES_PER_TOKEN
        previous_len = len(history)
        history = history + result.token_ids + random_prompt(100 + turn, 30)  # answer + tool output


async def test_multi_turn_session_sends_rld_only_what_it_lacks(stack, session, tiny_generate):
    """RLD keeps the prompt and its eager tokens at the cut: the next turn's KV over P's local link
    is the rest of the answer and the new tool output, not the whole context again."""
    eager = 5
    history = random_prompt(9, 200)
    previous_len = 0
    for turn in range(3):
        result = await complete(session, stack, history, 12, pipeline="p-rld-md", handoff_at=eager)
        assert result.token_ids == tiny_generate(history, 12)
        assert result.tiers[:eager] == ["relay"] * eager and result.tiers[eager:] == ["main"] * (12 - eager)
        kv = result.summary["kv"]["relay"]
        if turn > 0:
            # the last prompt token and the first eager - 1 tokens were fed on RLD: their KV is kept
            assert kv["cached_tokens"] == previous_len + eager - 1
            assert kv["kv_tokens"] == len(history) - 1 - kv["cached_tokens"]
        else:
            assert kv["cached_tokens"] == 0 and kv["kv_tokens"] == len(history) - 1
        previous_len = len(history)
        history = history + result.token_ids + random_prompt(300 + turn, 30)


async def test_abort_storm_leaves_no_lock_inbox_or_transfer(stack, session):
    rng = random.Random(7)
    base = random_prompt(8, 250)
    prompts = [base[:rng.randrange(50, 250)] + random_prompt(200 + i, rng.randrange(1, 60)) for i in range(40)]
    walk_away_after = [rng.randrange(0, 12) for _ in prompts]  # SSE lines each client reads before it leaves
    await asyncio.gather(*(
        abandon_stream(session, stack.api_url, p, 200, after,
                       {"pipeline": random.Random(after).choice(["p-md", "p-rld-md"]), "md_kv_delay_ms": 50})
        for p, after in zip(prompts, walk_away_after)))
    await asyncio.sleep(1.0)  # aborts propagate
    beats = await fresh_heartbeats(stack.nats_url)
    for beat in beats.values():
        stats = beat.stats
        assert stats.get("locked_nodes", 0) == 0, beat
        assert stats.get("open_inboxes", 0) == 0 and stats.get("open_transfers", 0) == 0, beat
        assert beat.running == 0, beat
        if beat.role == "prefill":
            assert stats["cache_tokens"] <= P_CACHE_TOKENS
    after = await complete(session, stack, prompts[0], 16)
    assert len(after.token_ids) == 16
