"""Several instances and the gateway's policy, on real processes with the tiny model: cache-aware
routing keeps a session on the MD that holds its history, a dead MD stops being chosen, and the
pipeline choice follows MD's cache hit."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tools.api_client import stream_completion
from tools.launcher import LocalStack

from helpers import busy_instance, complete, random_prompt

BEAT = ["--heartbeat-s", "0.25"]
STACK = {"pipeline": "auto",
         "extra_args": {"main": ["--instance-id", "main-1", *BEAT], "prefill": ["--instance-id", "prefill-1", *BEAT],
                        "relay": BEAT, "gateway": [*BEAT, "--wan-mbps-guess", "1"]}}


def spawn(stack: LocalStack, role: str, instance_id: str) -> subprocess.Popen:
    """One more instance of `role` beside the launcher's, on the same NATS."""
    extra = ["--kv-host", "127.0.0.1", "--kv-port", "0"] if role != "prefill" else ["--chunk-tokens", "64"]
    return subprocess.Popen(
        [sys.executable, "-m", f"services.{role}", "--nats-url", stack.nats_url, "--model", str(stack.model_path),
         "--torch-threads", "1", "--instance-id", instance_id, "--kv-secret-file", str(stack.kv_secret_file),
         *extra, *BEAT],
        stdout=open(stack.log_dir / f"{instance_id}.log", "ab"), stderr=subprocess.STDOUT)


async def wait_for_instances(stack: LocalStack, role: str, count: int) -> None:
    async with aiohttp.ClientSession() as client, asyncio.timeout(60):
        while True:
            async with client.get(stack.api_url + "/healthz") as resp:
                if (await resp.json())["instances"][role] == count:
                    return
            await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
async def stack(stack: LocalStack) -> AsyncIterator[LocalStack]:
    """conftest's stack with a second MD and a second P beside the launcher's."""
    stack.extra = {"main-2": spawn(stack, "main", "main-2"), "prefill-2": spawn(stack, "prefill", "prefill-2")}
    try:
        await wait_for_instances(stack, "main", 2)
        await wait_for_instances(stack, "prefill", 2)
        yield stack
    finally:
        for proc in stack.extra.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)


def kill(stack: LocalStack, instance_id: str) -> None:
    if instance_id in stack.extra:
        stack.extra[instance_id].send_signal(signal.SIGKILL)
    else:
        stack.kill(instance_id.split("-")[0])


async def revive(stack: LocalStack, instance_id: str) -> None:
    role = instance_id.split("-")[0]
    if instance_id in stack.extra:
        stack.extra[instance_id].wait(10)
        stack.extra[instance_id] = spawn(stack, role, instance_id)
    else:
        await stack.restart(role)
    await asyncio.sleep(1.2)  # the dead one's heartbeats go stale first
    await wait_for_instances(stack, role, 2)


async def test_pipeline_choice_follows_the_main_hit(stack, session, tiny_generate):
    prompt = random_prompt(1, 300)
    cold = await complete(session, stack, prompt, 64)  # long enough that MD takes over and keeps the KV
    assert cold.summary["pipeline"] == "p-rld-md", "300 KB at the 1 Mbit/s guess: MD starts 2.4 s after RLD"
    assert cold.summary["policy"]["wan_bytes_predicted"] > 0
    warm = await complete(session, stack, prompt, 64)
    assert warm.summary["pipeline"] == "p-md", "MD holds the whole prompt: it starts as soon as RLD could"
    assert warm.summary["policy"]["main_hit_predicted"] > 299 - 16  # the index is block-granular
    assert warm.summary["instances"]["main"] == cold.summary["instances"]["main"]
    for result in (cold, warm):
        assert result.token_ids == tiny_generate(prompt, 64)
        policy = result.summary["policy"]
        assert policy["main_ready_predicted_s"] >= 0 and policy["main_ready_actual_s"] is not None


async def test_a_session_stays_on_the_main_that_holds_its_history(stack, session):
    for seed in (10, 11, 12):
        history = random_prompt(seed, 120)
        served_by = set()
        for turn in range(3):
            result = await complete(session, stack, history, 8)
            served_by.add(result.summary["instances"]["main"])
            if turn:
                assert result.summary["cached_tokens"]["main"] > 0
            history = history + result.token_ids + random_prompt(seed * 10 + turn, 20)
        assert len(served_by) == 1, f"session {seed} moved between MDs: {served_by}"


async def test_a_request_whose_main_dies_mid_decode_moves_to_the_other_main(stack, session, tiny_generate):
    prompt = random_prompt(40, 60)
    serving = (await complete(session, stack, prompt, 4, pipeline="p-md")).summary["instances"]["main"]
    killed = []

    def kill_at_20(index: int, tier: str) -> None:
        if index == 20 and not killed:
            kill(stack, serving)
            killed.append(serving)

    body = {"prompt": prompt, "max_tokens": 600, "temperature": 0, "ignore_eos": True, "pdd": {"pipeline": "p-md"}}
    result = await stream_completion(session, stack.api_url, body, on_token=kill_at_20)
    assert killed, "the session's MD served the request (cache-aware routing)"
    assert result.token_ids == tiny_generate(prompt, 600)
    migration, = result.summary["migrations"]
    assert migration["instances"]["main"] != serving
    # the policy chooses the new attempt's pipeline as for any request: at the 1 Mbit/s guess the
    # other MD, which lacks the whole prompt, starts later than RLD
    assert migration["pipeline"] == "p-rld-md" and result.tiers[-1] == "main"
    assert result.tiers[:20] == ["main"] * 20
    await revive(stack, serving)


async def test_a_prefill_that_dies_before_any_token_is_retried_on_the_other(stack, session, tiny_generate):
    prompt = random_prompt(41, 60)
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "pdd": {"pipeline": "p-md", "md_kv_delay_ms": 3000}}
    request = asyncio.create_task(stream_completion(session, stack.api_url, body))
    serving = await busy_instance(stack.nats_url, "prefill")  # P streams its KV, slowly, to MD
    kill(stack, serving)
    result = await request
    assert result.token_ids == tiny_generate(prompt, 16)
    migration, = result.summary["migrations"]
    assert migration["lost"] == "prefill" and migration["after_tokens"] == 0
    assert migration["instances"]["prefill"] != serving
    await revive(stack, serving)


async def test_a_killed_main_stops_receiving_requests(stack, session, tiny_generate):
    kill(stack, "main-2")
    stack.extra["main-2"].wait(10)
    for seed in range(20, 30):
        prompt = random_prompt(seed, 40)
        result = await complete(session, stack, prompt, 8)
        assert result.token_ids == tiny_generate(prompt, 8)
        assert result.summary["instances"]["main"] == "main-1"
