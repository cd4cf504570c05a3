"""Faults on real processes (tiny model): every request ends complete (token-exact) or with a
terminal error within its deadline, recovery takes the paths the failure policy names, and
nothing is left behind."""
from __future__ import annotations

import asyncio
import functools
import json
import random

from tools.api_client import ApiError, stream_completion

from helpers import abandon_stream, complete, fresh_heartbeats, random_prompt

BEAT = ["--heartbeat-s", "0.25"]
TOKEN_TIMEOUT_S = 20
STACK = {"extra_args": {"prefill": BEAT, "relay": BEAT, "main": BEAT,
                        "gateway": [*BEAT, "--token-timeout-s", str(TOKEN_TIMEOUT_S), "--request-timeout-s", "60"]}}
complete = functools.partial(complete, ignore_eos=True)


def prompt(seed: int, n: int = 80) -> list[int]:
    return random_prompt(seed, n)


async def healthy(session, stack) -> None:
    await asyncio.sleep(1.2)  # a killed instance's heartbeats go stale first (3.5 x 0.25 s)
    async with asyncio.timeout(60):
        while True:
            async with session.get(stack.api_url + "/healthz") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.2)


async def kill_after(stack, role: str, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    stack.kill(role)


async def test_main_killed_during_its_kv_transfer_relay_finishes_the_request(stack, session, tiny_generate):
    p = prompt(1)
    request = complete(session, stack, p, 40, pipeline="p-rld-md", handoff_at=10, md_kv_delay_ms=4000)
    result, _ = await asyncio.gather(request, kill_after(stack, "main", 0.5))
    assert result.token_ids == tiny_generate(p, 40)
    assert set(result.tiers) == {"relay"} and result.summary["recovery"] == "finish_on_relay"
    await stack.restart("main")
    await healthy(session, stack)


async def test_under_the_fail_policy_a_lost_main_is_a_prompt_error(stack, session):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    request = complete(session, stack, prompt(2), 40, pipeline="p-rld-md", handoff_at=10, md_kv_delay_ms=4000,
                       failure_policy="fail")
    outcome = await asyncio.gather(request, kill_after(stack, "main", 0.5), return_exceptions=True)
    assert isinstance(outcome[0], ApiError) and "main" in str(outcome[0])
    assert loop.time() - t0 < TOKEN_TIMEOUT_S, "the watchdog noticed before any token deadline"
    await stack.restart("main")
    await healthy(session, stack)


async def test_relay_killed_before_the_cut_main_takes_over_without_repeating_tokens(stack, session, tiny_generate):
    p = prompt(3)
    request = complete(session, stack, p, 40, pipeline="p-rld-md", handoff_at=10, md_kv_delay_ms=3000)
    result, _ = await asyncio.gather(request, kill_after(stack, "relay", 0.8))
    assert result.token_ids == tiny_generate(p, 40)
    assert result.tiers == ["relay"] * 10 + ["main"] * 30
    assert result.summary["recovery"] == "main_takes_over"
    await stack.restart("relay")
    await healthy(session, stack)


async def test_main_killed_while_decoding_the_request_moves_to_relay_without_repeating_tokens(
        stack, session, tiny_generate):
    """P-MD, the only MD dies after 20 tokens: the request migrates (prompt + the tokens streamed)
    and, with no other MD, RLD serves the rest. The client sees every token once, token-exact."""
    p = prompt(4)
    killed = []

    def kill_at_20(index: int, tier: str) -> None:
        if index == 20 and not killed:
            stack.kill("main")
            killed.append(tier)

    body = {"prompt": p, "max_tokens": 600, "temperature": 0, "ignore_eos": True, "pdd": {"pipeline": "p-md"}}
    result = await stream_completion(session, stack.api_url, body, on_token=kill_at_20)
    assert killed == ["main"]
    assert result.token_ids == tiny_generate(p, 600)
    migration, = result.summary["migrations"]
    assert result.summary["recovery"] == "migrate" and migration["lost"] == "main"
    assert migration["pipeline"] == "p-rld", "no MD left: RLD serves alone"
    assert migration["after_tokens"] >= 21
    gap = result.token_times_s[migration["after_tokens"]] - result.token_times_s[migration["after_tokens"] - 1]
    print(f"migration: the client waited {gap:.2f}s for the token after the kill")
    assert set(result.tiers[:migration["after_tokens"]]) == {"main"}
    assert set(result.tiers[migration["after_tokens"]:]) == {"relay"}
    # while no MD is reachable, new requests are served by RLD alone rather than refused
    alone = await complete(session, stack, prompt(10), 12)
    assert alone.token_ids == tiny_generate(prompt(10), 12)
    assert alone.summary["pipeline"] == "p-rld" and set(alone.tiers) == {"relay"}
    assert alone.summary["policy"]["reason"].startswith("no main decode reachable")
    await stack.restart("main")
    await healthy(session, stack)


async def undisturbed_and_migrated(session, stack, body: dict, kill_at: int = 15):
    """The same request twice: alone, then with MD killed as token `kill_at` arrives (MD restarted after)."""
    undisturbed = await stream_completion(session, stack.api_url, body)

    def kill_main(index: int, tier: str) -> None:
        if index == kill_at:
            stack.kill("main")

    migrated = await stream_completion(session, stack.api_url, body, on_token=kill_main)
    assert migrated.summary["migrations"], "the kill landed after the last token"
    await stack.restart("main")
    await healthy(session, stack)
    return undisturbed, migrated


async def test_a_migrated_seeded_sample_draws_what_it_would_have_drawn(stack, session):
    """The sampler's draw for token i depends on (seed, i) only; a migration keeps i absolute."""
    body = {"prompt": prompt(9), "max_tokens": 300, "temperature": 0.9, "top_p": 0.95, "seed": 7, "ignore_eos": True,
            "pdd": {"pipeline": "p-md"}}
    undisturbed, migrated = await undisturbed_and_migrated(session, stack, body)
    assert migrated.token_ids == undisturbed.token_ids


async def test_a_migrated_answer_keeps_its_grammar(stack, session):
    """The instance that takes over replays the tokens the client has through its own matcher: the
    answer is the one an undisturbed run gives, and it follows the schema."""
    schema = {"type": "object", "properties": {"steps": {"type": "array", "items": {"enum": ["left", "right", "up"]},
                                                         "minItems": 40, "maxItems": 40}},
              "required": ["steps"]}
    body = {"prompt": prompt(12), "max_tokens": 200, "temperature": 0.9, "seed": 21, "pdd": {"pipeline": "p-md"},
            "response_format": {"type": "json_schema", "json_schema": {"name": "walk", "schema": schema}}}
    undisturbed, migrated = await undisturbed_and_migrated(session, stack, body)
    assert migrated.token_ids == undisturbed.token_ids and migrated.finish_reason == "stop"
    assert len(json.loads(migrated.text)["steps"]) == 40


async def test_an_echo_with_logprobs_survives_a_migration(stack, session):
    """The prompt's logprobs (from P) and the answer's come out whole and equal to an undisturbed run's
    when MD is lost mid-answer and the request migrates."""
    # 160 tokens: with 40, the tiny model could stream the rest before the kill at token 15 landed
    body = {"prompt": prompt(13), "max_tokens": 160, "temperature": 0, "ignore_eos": True, "echo": True,
            "logprobs": 2, "pdd": {"pipeline": "p-md"}}
    undisturbed, migrated = await undisturbed_and_migrated(session, stack, body)

    def token_logprobs(result) -> list[float | None]:
        return [value for chunk in result.logprobs for value in chunk["token_logprobs"]]

    assert migrated.token_ids == undisturbed.token_ids and migrated.text == undisturbed.text
    expected, got = token_logprobs(undisturbed), token_logprobs(migrated)
    assert len(got) == len(expected) == len(body["prompt"]) + body["max_tokens"] and got[0] is None is expected[0]
    assert max(abs(a - b) for a, b in zip(got[1:], expected[1:])) < 1e-4


async def test_main_killed_while_decoding_under_the_fail_policy_is_an_error_within_its_deadline(stack, session):
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def kill_at_5(index: int, tier: str) -> None:
        if index == 5:
            stack.kill("main")

    body = {"prompt": prompt(4), "max_tokens": 600, "temperature": 0, "ignore_eos": True,
            "pdd": {"pipeline": "p-md", "failure_policy": "fail"}}
    outcome = await asyncio.gather(stream_completion(session, stack.api_url, body, on_token=kill_at_5),
                                   return_exceptions=True)
    assert isinstance(outcome[0], ApiError) and "main" in str(outcome[0]), outcome[0]
    assert loop.time() - t0 < TOKEN_TIMEOUT_S
    await stack.restart("main")
    await healthy(session, stack)


async def test_prefill_killed_mid_transfer_fails_the_request_within_its_deadline(stack, session):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    outcome = await asyncio.gather(complete(session, stack, prompt(5), 20, pipeline="p-md", md_kv_delay_ms=5000),
                                   kill_after(stack, "prefill", 0.5), return_exceptions=True)
    assert isinstance(outcome[0], ApiError) and "prefill" in str(outcome[0])
    assert loop.time() - t0 < TOKEN_TIMEOUT_S
    await stack.restart("prefill")
    await healthy(session, stack)


async def test_prefill_killed_once_its_kv_is_out_does_not_disturb_the_request(stack, session, tiny_generate):
    p = prompt(11)

    def kill_at_10(index: int, tier: str) -> None:
        if index == 10:
            stack.kill("prefill")

    body = {"prompt": p, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "pdd": {"pipeline": "p-md"}}
    result = await stream_completion(session, stack.api_url, body, on_token=kill_at_10)
    assert result.token_ids == tiny_generate(p, 400)
    assert result.summary["recovery"] is None and not result.summary["migrations"]
    await stack.restart("prefill")
    await healthy(session, stack)


async def test_services_survive_a_nats_restart(stack, session, tiny_generate):
    in_flight = asyncio.create_task(complete(session, stack, prompt(6), 3000, pipeline="p-md"))
    await asyncio.sleep(0.5)
    await stack.restart("nats")
    try:
        result = await in_flight
        assert len(result.token_ids) == 3000  # it may also end with an error: one way or the other
    except ApiError:
        pass
    await healthy(session, stack)
    p = prompt(7)
    after = await complete(session, stack, p, 16)
    assert after.token_ids == tiny_generate(p, 16)


async def test_two_hundred_random_aborts_leave_nothing_behind(stack, session):
    await healthy(session, stack)
    rng = random.Random(99)
    base = prompt(8, 200)
    for wave in range(5):
        await asyncio.gather(*(
            abandon_stream(session, stack.api_url,
                           base[:rng.randrange(20, 200)] + prompt(1000 + wave * 40 + i, rng.randrange(1, 40)), 100,
                           rng.randrange(0, 15), {"pipeline": rng.choice(["p-md", "p-rld-md"]), "md_kv_delay_ms": 30})
            for i in range(40)))
    await asyncio.sleep(1.0)
    for beat in (await fresh_heartbeats(stack.nats_url)).values():
        assert beat.running == 0, beat
        assert beat.stats.get("open_inboxes", 0) == 0 and beat.stats.get("open_transfers", 0) == 0, beat
        assert beat.stats.get("locked_nodes", 0) == 0, beat
