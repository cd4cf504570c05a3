"""Under load nothing fails because it waited (issue 15), on real processes (tiny model, one datacenter).

32 long prompts at once queue at P far longer than the KV stall deadline (2 s here): every request
completes with the tokens it asked for, no tier is lost and nothing is recovered, in P-MD and with a
busy relay in P-RLD-MD. Past --max-running-requests requests wait in the gateway's queue and are
served; past --max-queued-requests they get 429 with a Retry-After. The plain parts (admission's
queue, the registry's busy-or-gone choice) are tested without processes first.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.http.admission import Admission, ClientLeft, Overloaded
from services.gateway.routing.registry import InstanceRegistry, NoLiveInstance
from shared.errors import DeadlineExceeded, PeerGone
from shared.messages import Heartbeat
from shared.names import Role
from tools.api_client import sse_events, stream_completion
from tools.launcher import LocalStack
from tools.stack_config import StackConfig

from helpers import random_prompt

KV_STALL_TIMEOUT_S = 2.0
CHUNK_TOKENS = 16
PREFILL_BATCH_TOKENS = 16
CONCURRENT = 32
PROMPT_TOKENS = 1500
MAX_TOKENS = 16
MAX_RUNNING = CONCURRENT
MAX_QUEUED = 8


# --- admission's queue, plain ----------------------------------------------------------------------

def never_gone() -> bool:
    return False


async def test_past_the_running_limit_requests_queue_in_order_and_past_the_queue_get_a_retry_after():
    admission = Admission(max_running=1, max_queued=2, api_key=None)
    deadline = time.monotonic() + 10
    order: list[str] = []
    release_first = asyncio.Event()

    async def request(name: str, hold: asyncio.Event | None = None) -> None:
        async with admission.slot(deadline, never_gone):
            order.append(name)
            if hold is not None:
                await hold.wait()

    first = asyncio.create_task(request("first", release_first))
    await asyncio.sleep(0)
    queued = [asyncio.create_task(request(name)) for name in ("second", "third")]
    await asyncio.sleep(0.01)
    assert (admission.running, admission.queued) == (1, 2)
    with pytest.raises(Overloaded) as refused:
        async with admission.slot(deadline, never_gone):
            pass
    assert refused.value.retry_after_s >= 1
    release_first.set()
    await asyncio.gather(first, *queued)
    assert order == ["first", "second", "third"], "first come, first served"
    assert (admission.running, admission.queued) == (0, 0)


async def test_a_queued_request_leaves_at_its_deadline_or_when_its_client_goes():
    admission = Admission(max_running=1, max_queued=4, api_key=None)
    hold = asyncio.Event()

    async def running() -> None:
        async with admission.slot(time.monotonic() + 10, never_gone):
            await hold.wait()

    task = asyncio.create_task(running())
    await asyncio.sleep(0)
    with pytest.raises(DeadlineExceeded):
        async with admission.slot(time.monotonic() + 0.1, never_gone):
            pass
    gone = False
    leaving = asyncio.create_task(admission.slot(time.monotonic() + 10, lambda: gone).__aenter__())
    await asyncio.sleep(0.05)
    assert admission.queued == 1
    gone = True
    with pytest.raises(ClientLeft):
        await leaving
    assert admission.queued == 0
    hold.set()
    await task
    assert admission.running == 0


async def test_with_no_queue_a_full_gateway_refuses_at_once():
    admission = Admission(max_running=1, max_queued=0, api_key=None)
    async with admission.slot(time.monotonic() + 10, never_gone):
        with pytest.raises(Overloaded):
            async with admission.slot(time.monotonic() + 10, never_gone):
                pass


# --- busy or gone, plain ---------------------------------------------------------------------------

def beat(instance_id: str) -> Heartbeat:
    return Heartbeat("relay", instance_id, "127.0.0.1", 1, "m", 0, 0, time.time())


def test_an_instance_a_request_failed_on_is_picked_again_while_it_answers_and_no_other_serves():
    registry = InstanceRegistry(stale_after_s=60)
    registry.observe(beat("rld-a"))
    registry.mark_answered("rld-a")
    assert registry.pick("relay", avoid={"rld-a"}).heartbeat.instance_id == "rld-a", "busy, not gone"
    registry.observe(beat("rld-b"))
    registry.mark_answered("rld-b")
    assert registry.pick("relay", avoid={"rld-a"}).heartbeat.instance_id == "rld-b", "another one first"


def test_an_instance_that_failed_and_answers_no_ping_is_not_picked_again():
    registry = InstanceRegistry(stale_after_s=60)
    registry.observe(beat("rld-a"))  # heartbeats, but no ping answered (a one-way link)
    with pytest.raises(PeerGone, match="stopped answering pings"):
        registry.pick("relay", avoid={"rld-a"})
    registry.mark_gone("rld-a")
    with pytest.raises(PeerGone, match="no live relay instance$"):
        registry.pick("relay")


async def test_waiting_for_an_instance_ends_at_its_first_heartbeat():
    registry = InstanceRegistry(stale_after_s=60)
    registry.observe(beat("rld-a"))
    registry.mark_gone("rld-a")  # killed; restarting
    with pytest.raises(NoLiveInstance) as info:
        registry.pick("relay")
    assert info.value.role == "relay"
    loop = asyncio.get_running_loop()
    loop.call_later(0.2, lambda: registry.observe(beat("rld-a")))  # the restarted one beats
    t0 = loop.time()
    assert await registry.wait_alive(Role.RELAY, timeout_s=10, poll_s=5)
    assert 0.15 < loop.time() - t0 < 2, "woken by the heartbeat, not by a poll"
    assert registry.pick("relay").heartbeat.instance_id == "rld-a"


async def test_waiting_for_an_instance_gives_up_at_its_deadline():
    registry = InstanceRegistry(stale_after_s=60)
    registry.observe(Heartbeat("main", "md-a", "127.0.0.1", 1, "m", 0, 0, time.time()))  # another role beats
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert not await registry.wait_alive(Role.RELAY, timeout_s=0.3, poll_s=0.1)
    assert 0.3 <= loop.time() - t0 < 2


# --- on real processes -----------------------------------------------------------------------------

STALL = ["--kv-stall-timeout-s", str(KV_STALL_TIMEOUT_S)]
SLOW_PREFILL = [*STALL, "--max-batch-tokens", str(PREFILL_BATCH_TOKENS)]  # few tokens per forward: P is slow
STACK = {"pipeline": StackConfig.pipeline, "chunk_tokens": CHUNK_TOKENS,
         "extra_args": {"prefill": SLOW_PREFILL, "relay": STALL, "main": STALL,
                        "gateway": ["--max-running-requests", str(MAX_RUNNING),
                                    "--max-queued-requests", str(MAX_QUEUED)]}}


async def gateway_metrics(session: aiohttp.ClientSession, stack: LocalStack) -> dict[str, float]:
    """Each gateway sample, summed over its labels, by sample name."""
    async with session.get(stack.api_url + "/metrics") as resp:
        text = await resp.text()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def moved(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pipeline", ["p-md", "p-rld-md"])
async def test_long_prompts_that_queue_at_prefill_past_the_stall_deadline_all_complete(
        stack, session, tiny_generate, pipeline):
    seed = {"p-md": 1000, "p-rld-md": 2000}[pipeline]
    prompts = [random_prompt(seed + i, PROMPT_TOKENS) for i in range(CONCURRENT)]
    before = await gateway_metrics(session, stack)
    started = time.monotonic()
    results = await asyncio.gather(*(stream_completion(session, stack.api_url, {
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "pdd": {"pipeline": pipeline}}) for prompt in prompts), return_exceptions=True)
    wall_s = time.monotonic() - started
    after = await gateway_metrics(session, stack)

    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures
    assert [len(r.token_ids) for r in results] == [MAX_TOKENS] * CONCURRENT
    assert {r.finish_reason for r in results} == {"length"}
    assert {r.summary["pipeline"] for r in results} == {pipeline}
    for i in (0, CONCURRENT - 1):
        assert results[i].token_ids == tiny_generate(prompts[i], MAX_TOKENS)
    kv_wait_s = max(kv["kv_wait_s"] for r in results for kv in r.summary["kv"].values())
    print(f"UNDER-LOAD {pipeline}: {CONCURRENT} x {PROMPT_TOKENS} tokens in {wall_s:.1f}s, "
          f"longest KV wait {kv_wait_s:.1f}s")
    assert kv_wait_s > 2 * KV_STALL_TIMEOUT_S, "the test must make a decoder wait for its KV past the deadline"
    assert moved(before, after, "pdd_recoveries_total") == 0
    assert moved(before, after, "pdd_tier_losses_total") == 0, "no tier was lost, nor failed a request"
    assert moved(before, after, "pdd_instances_gone_total") == 0
    assert all(r.summary["migrations"] == [] and r.summary["recovery"] is None for r in results)


@pytest.mark.timeout(120)
async def test_past_the_queue_requests_get_429_with_retry_after_and_queued_ones_complete(stack, session):
    total = MAX_RUNNING + MAX_QUEUED + 4
    max_tokens = 64
    peak_queued = 0

    async def one(i: int) -> tuple[int, str | None, int]:
        body = {"prompt": random_prompt(3000 + i, 100), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with session.post(stack.api_url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return resp.status, resp.headers.get("Retry-After"), 0
            tokens = 0
            async for event in sse_events(resp):
                assert "error" not in event, event
                tokens += len((event.get("pdd") or {}).get("tokens", ()))
            return 200, None, tokens

    async def watch_queue() -> None:
        nonlocal peak_queued
        while True:
            async with session.get(stack.api_url + "/healthz") as resp:
                peak_queued = max(peak_queued, (await resp.json())["requests"]["queued"])
            await asyncio.sleep(0.05)

    before = await gateway_metrics(session, stack)
    watcher = asyncio.create_task(watch_queue())
    try:
        outcomes = await asyncio.gather(*(one(i) for i in range(total)))
    finally:
        watcher.cancel()
    async with asyncio.timeout(5):  # the last handlers leave their slots just after their last bytes
        while (after := await gateway_metrics(session, stack))["pdd_running_requests"]:
            await asyncio.sleep(0.05)

    refused = [retry for status, retry, _ in outcomes if status == 429]
    served = [tokens for status, _, tokens in outcomes if status == 200]
    assert len(refused) + len(served) == total, outcomes
    assert refused and all(int(retry) >= 1 for retry in refused), outcomes
    assert len(served) >= MAX_RUNNING + MAX_QUEUED and served == [max_tokens] * len(served), \
        "every request let in, queued ones too, completes"
    assert peak_queued > 0, "some requests waited in the queue"
    assert moved(before, after, "pdd_recoveries_total") == 0
    assert after["pdd_gateway_queued_requests"] == 0
    assert moved(before, after, 'pdd_http_responses_total') >= total
