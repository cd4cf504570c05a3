"""A request that finds no live instance of a role it needs waits for one (--instance-wait-s) instead
of failing at once, on real processes (tiny model). Its own stack: the wait here must outlast a
restarted P's start on a loaded machine (tens of seconds), which would break test_faults' tests
that expect a failure within a deadline."""
from __future__ import annotations

import asyncio

from helpers import complete, random_prompt

BEAT = ["--heartbeat-s", "0.25"]
STACK = {"pipeline": "p-md",
         "extra_args": {"prefill": BEAT, "relay": BEAT, "main": BEAT,
                        "gateway": [*BEAT, "--instance-wait-s", "90", "--request-timeout-s", "120"]}}


async def heard(session, stack, role: str) -> int:
    async with session.get(stack.api_url + "/healthz") as resp:
        return (await resp.json())["heard"][role]


async def test_a_request_sent_while_prefill_restarts_waits_for_it_instead_of_a_503(stack, session, tiny_generate):
    stack.kill("prefill")
    async with asyncio.timeout(30):  # the gateway has found P dead: no live prefill instance
        while await heard(session, stack, "prefill") != 0:
            await asyncio.sleep(0.1)
    await stack.restart("prefill")  # spawned, not yet beating: the request comes before it is up
    assert await heard(session, stack, "prefill") == 0
    p = random_prompt(12, 80)
    result = await complete(session, stack, p, 16, ignore_eos=True, timeout_s=110)
    assert result.token_ids == tiny_generate(p, 16)
    async with session.get(stack.api_url + "/metrics") as resp:
        metrics = await resp.text()
    assert 'pdd_instance_waits_total{outcome="found",role="prefill"} 1.0' in metrics
