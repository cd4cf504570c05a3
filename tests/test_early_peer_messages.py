"""A peer's message about a request that reaches a decoder before its own DecodeAssign is handled,
on real processes (tiny model): it is kept and handled once the request is registered, so the
handoff still happens (services/decoder/early_messages.py).

The gateway assigns MD and RLD at once, and each subscription has its own task, so on a loaded
machine (CI) one decoder may handle its assignment late. Here that is made certain: a restarted
decoder gets a `sitecustomize` module on its PYTHONPATH that makes it handle every DecodeAssign
half a second late. Nothing else is mocked.
- MD, with the whole prompt in its DRC, reports its KV in (KVReady) at once, before a late RLD
  registered the request; with the cut pinned, RLD waits for that report: before the fix it was
  dropped and the request hung until the gateway's token deadline.
- RLD, with the whole prompt cached, streams Catch-Up tokens to MD from its first step, before a
  late MD registered the request: before the fix the first were dropped, MD found a gap ("handoff
  chunk starts at 1, MD holds 0") and RLD finished alone.
"""
from __future__ import annotations

import functools

from helpers import RESTART_TIMEOUT_S, complete, fresh_heartbeats, random_prompt, restart_patched

BEAT = ["--heartbeat-s", "0.25"]
STACK = {"extra_args": {"prefill": BEAT, "relay": BEAT, "main": BEAT,
                        "gateway": [*BEAT, "--token-timeout-s", "20", "--request-timeout-s", "40"]}}
complete = functools.partial(complete, ignore_eos=True, timeout_s=60, pipeline="p-rld-md")

LATE_ASSIGN = '''
import asyncio
from services.decoder import service

_on_assign = service.DecoderService._on_assign


async def _late(self, msg):
    await asyncio.sleep(0.5)
    await _on_assign(self, msg)


service.DecoderService._on_assign = _late
'''


async def test_mds_report_before_a_late_rld_registered_the_request_is_kept_for_it(
        stack, session, tiny_generate, tmp_path, monkeypatch):
    await restart_patched(stack, "relay", LATE_ASSIGN, tmp_path, monkeypatch)
    before = (await fresh_heartbeats(stack.nats_url))["relay"].stats
    prompt = random_prompt(61, 80)
    for turn in range(2):  # the first puts the prompt in MD's DRC; the second hits it whole
        result = await complete(session, stack, prompt, 12, handoff_mode="one-shot", handoff_at=4)
        assert result.token_ids == tiny_generate(prompt, 12)
        assert result.tiers == ["relay"] * 4 + ["main"] * 8, turn
    assert result.summary["cached_tokens"]["main"] == len(prompt) - 1, "MD had it all: it reported at once"
    after = (await fresh_heartbeats(stack.nats_url))["relay"].stats
    assert after["early_replayed"] > before["early_replayed"], "RLD kept MD's report for the late assignment"


async def test_rlds_tokens_before_a_late_md_registered_the_request_are_kept_for_it(
        stack, session, tiny_generate, tmp_path, monkeypatch):
    await stack.restart("relay")  # on time again
    await restart_patched(stack, "main", LATE_ASSIGN, tmp_path, monkeypatch)
    before = (await fresh_heartbeats(stack.nats_url))["main"].stats
    prompt = random_prompt(62, 80)
    for turn in range(2):  # the first puts the prompt in RLD's cache; the second starts decoding at once
        result = await complete(session, stack, prompt, 300, handoff_mode="catch-up")
        assert result.token_ids == tiny_generate(prompt, 300)
        cut = result.tiers.index("main") if "main" in result.tiers else None
        assert cut is not None, f"turn {turn}: MD took over (it did not: {result.summary['recovery']})"
        assert result.tiers == ["relay"] * cut + ["main"] * (300 - cut), turn
    after = (await fresh_heartbeats(stack.nats_url))["main"].stats
    assert after["early_replayed"] > before["early_replayed"], "MD kept RLD's first tokens for the late assignment"
    await stack.restart("main")
    await fresh_heartbeats(stack.nats_url, timeout_s=RESTART_TIMEOUT_S)
