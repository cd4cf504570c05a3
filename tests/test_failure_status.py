"""A failure says what happened, on real processes (tiny model): one that comes before the first
byte of the answer is an HTTP error with its own status (P lost with no other to take the request:
503 with Retry-After), streamed or not; one that comes after a stream has started is an SSE error
event, and the gateway's response metric counts it under its error's status, not as a 200."""
from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tools.api_client import ApiError, stream_completion

from helpers import fresh_heartbeats, random_prompt

BEAT = ["--heartbeat-s", "0.25"]


STACK = {"pipeline": "p-md", "chunk_tokens": 256,
         "extra_args": {"prefill": BEAT, "relay": BEAT, "main": BEAT,
                        "gateway": [*BEAT, "--instance-wait-s", "1", "--token-timeout-s", "20",
                                    "--request-timeout-s", "60"]}}


@pytest.fixture(scope="module")
async def session():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as client:
        yield client


async def gateway_samples(session, stack, name: str) -> list:
    async with session.get(stack.api_url + "/metrics") as resp:
        text = await resp.text()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == name]


async def responses_by_status(session, stack) -> dict[str, float]:
    """pdd_http_responses_total for /v1/completions, by status."""
    return {sample.labels["status"]: sample.value
            for sample in await gateway_samples(session, stack, "pdd_http_responses_total")
            if sample.labels.get("route") == "/v1/completions"}


async def dispatched(session, stack, requests: int) -> None:
    """The gateway has started this many runs (each dispatched and accepted by its instances)."""
    async with asyncio.timeout(20):
        while (await gateway_samples(session, stack, "pdd_running_requests"))[0].value < requests:
            await asyncio.sleep(0.05)


async def restart(stack, role: str) -> None:
    await stack.restart(role)
    await fresh_heartbeats(stack.nats_url, timeout_s=90)  # a loaded machine loads the model slowly
    await asyncio.sleep(1.0)  # the gateway's pings have found the new instance


async def post_whole(session, stack, body: dict) -> tuple[int, dict[str, str], dict]:
    async with session.post(stack.api_url + "/v1/completions", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def post_streamed(session, stack, body: dict) -> tuple[int, dict[str, str], bytes]:
    async with session.post(stack.api_url + "/v1/completions", json={**body, "stream": True}) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def test_prefill_lost_before_the_first_token_is_a_503_with_retry_after_streamed_or_not(stack, session):
    """P dies while it holds both requests (MD's KV held back 5 s, so no token has come); the
    migration finds no P within --instance-wait-s, and nothing of the answer has been sent."""
    before = await responses_by_status(session, stack)
    bodies = [{"prompt": random_prompt(seed, 80), "max_tokens": 20, "temperature": 0,
               "pdd": {"pipeline": "p-md", "md_kv_delay_ms": 5000}} for seed in (1, 2)]
    streamed = asyncio.create_task(post_streamed(session, stack, bodies[0]))
    whole = asyncio.create_task(post_whole(session, stack, bodies[1]))
    await dispatched(session, stack, 2)
    assert not streamed.done() and not whole.done(), "both wait for P's KV"
    stack.kill("prefill")
    (stream_status, stream_headers, stream_body), (status, headers, body) = await asyncio.gather(streamed, whole)
    try:
        assert stream_status == 503, stream_body[:300]
        assert stream_headers["Retry-After"] == "1" and stream_headers["Content-Type"].startswith("application/json")
        error = orjson.loads(stream_body)["error"]
        assert error["code"] == "peer_unavailable" and error["type"] == "server_error" and "prefill" in error["message"]
        assert status == 503 and headers["Retry-After"] == "1"
        assert body["error"]["code"] == "peer_unavailable" and "prefill" in body["error"]["message"]
        after = await responses_by_status(session, stack)
        assert after.get("503", 0) - before.get("503", 0) == 2
        assert after.get("200", 0) == before.get("200", 0)
    finally:
        await restart(stack, "prefill")


async def test_an_error_after_the_stream_started_is_counted_by_its_status(stack, session):
    """MD dies mid-answer under the fail policy: the client has tokens (status 200) and then an
    error event; the response metric counts the error's status, not a 200."""
    before = await responses_by_status(session, stack)

    def kill_at_5(index: int, tier: str) -> None:
        if index == 5:
            stack.kill("main")

    body = {"prompt": random_prompt(3, 80), "max_tokens": 600, "temperature": 0, "ignore_eos": True,
            "pdd": {"pipeline": "p-md", "failure_policy": "fail"}}
    try:
        with pytest.raises(ApiError) as info:
            await stream_completion(session, stack.api_url, body, on_token=kill_at_5)
        assert info.value.status == 200, "the stream had started"
        assert info.value.body["error"]["code"] == "peer_unavailable" and "main" in str(info.value)
        after = await responses_by_status(session, stack)
        assert after.get("503", 0) - before.get("503", 0) == 1, after
        assert after.get("200", 0) == before.get("200", 0)
    finally:
        await restart(stack, "main")
    result = await stream_completion(session, stack.api_url, {**body, "max_tokens": 4})
    assert len(result.token_ids) == 4
    assert (await responses_by_status(session, stack)).get("200", 0) == before.get("200", 0) + 1
