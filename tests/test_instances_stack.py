"""Several instances per role, started by the launcher itself (`--instances`, as `pdd bench --scenario
paper-scale` starts them), in two datacenters: every instance joins, requests spread over the Ps
and the MDs, each MD's KV crosses its own WAN route, and every answer is the model's own, token for
token, whichever instances served it."""
from __future__ import annotations

import asyncio

import aiohttp

from tools.launcher import LocalStack
from tools.stack_config import md_kv_route

from helpers import complete, random_prompt

STACK: dict[str, object] = {"topology": "two-dc", "instances": {"prefill": 2, "main": 2},
                            "wan_bandwidth_mbps": 200.0, "wan_delay_ms": 5.0, "wan_jitter_ms": 0.0}
REQUESTS = 8
MAX_TOKENS = 12


async def test_the_launchers_instances_all_serve_and_answer_token_for_token(stack: LocalStack,
                                                                            session: aiohttp.ClientSession,
                                                                            tiny_generate) -> None:
    async with session.get(stack.api_url + "/healthz") as resp:
        counts = (await resp.json())["instances"]
    assert (counts["prefill"], counts["relay"], counts["main"]) == (2, 1, 2), counts

    prompts = [random_prompt(700 + i, 90 + 7 * i) for i in range(REQUESTS)]
    results = await asyncio.gather(*(complete(session, stack, prompt, MAX_TOKENS, ignore_eos=True, timeout_s=120)
                                     for prompt in prompts))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.finish_reason == "length", result.summary
        assert result.token_ids == tiny_generate(prompt, MAX_TOKENS), result.summary

    served = [attempt["instances"] for result in results for attempt in result.summary["attempts"]]
    assert len({instances["prefill"] for instances in served}) == 2, served  # spread by load: none has a hit
    mains = {instances["main"] for instances in served}
    assert len(mains) == 2, served

    routes = (await stack.wan.stats())["routes"]
    md_routes = [md_kv_route(1), md_kv_route(2)]
    assert all(routes[name]["a_to_b"]["bytes"] > 0 for name in md_routes), routes  # each MD's KV, its own route
