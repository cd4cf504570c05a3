"""Several instances and the gateway's policy, on real processes with the tiny model: cache-aware
routing keeps a session on the MD that holds its history, a dead MD stops being chosen, and the
pipeline choice follows MD's cache hit."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import aiohttp
import pytest

from shared.api_client import stream_completion
from shared.launcher import LocalStack, StackConfig

from helpers import random_prompt

BEAT = ["--heartbeat-s", "0.25"]


@pytest.fixture(scope="module")
async def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    config = StackConfig(model="tiny", port=0, log_dir=log_dir, torch_threads=1, chunk_tokens=64,
                         pipeline="auto", startup_timeout_s=120,
                         extra_args={"main": ["--instance-id", "main-1", *BEAT], "prefill": BEAT, "relay": BEAT,
                                     "gateway": [*BEAT, "--ttft-slo-ms", "100"]})
    async with LocalStack(config) as running:
        second = subprocess.Popen(
            [sys.executable, "-m", "services.main", "--nats-url", running.nats_url, "--model", str(running.model_path),
             "--torch-threads", "1", "--kv-host", "127.0.0.1", "--kv-port", "0", "--instance-id", "main-2", *BEAT],
            stdout=open(log_dir / "main-2.log", "wb"), stderr=subprocess.STDOUT)
        running.extra_main = second
        async with aiohttp.ClientSession() as client:
            for _ in range(100):
                async with client.get(running.api_url + "/healthz") as resp:
                    if (await resp.json())["instances"]["main"] == 2:
                        break
                await asyncio.sleep(0.1)
        try:
            yield running
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(10)



async def complete(session, stack, prompt_ids, max_tokens=8, **pdd):
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "pdd": pdd}
    return await stream_completion(session, stack.api_url, body)


async def test_pipeline_choice_follows_the_main_hit(stack, session, tiny_generate):
    prompt = random_prompt(1, 300)
    cold = await complete(session, stack, prompt, 64)  # long enough that MD takes over and keeps the KV
    assert cold.summary["pipeline"] == "p-rld-md", "300 uncached tokens cannot reach MD within a 50 ms budget"
    assert cold.summary["policy"]["wan_bytes_predicted"] > 0
    warm = await complete(session, stack, prompt, 64)
    assert warm.summary["pipeline"] == "p-md", "MD holds the whole prompt: nothing to wait for"
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
            result = await complete(session, stack, history)
            served_by.add(result.summary["instances"]["main"])
            if turn:
                assert result.summary["cached_tokens"]["main"] > 0
            history = history + result.token_ids + random_prompt(seed * 10 + turn, 20)
        assert len(served_by) == 1, f"session {seed} moved between MDs: {served_by}"


async def test_a_killed_main_stops_receiving_requests(stack, session, tiny_generate):
    stack.extra_main.send_signal(signal.SIGKILL)
    stack.extra_main.wait(10)
    for seed in range(20, 30):
        prompt = random_prompt(seed, 40)
        result = await complete(session, stack, prompt)
        assert result.token_ids == tiny_generate(prompt, 8)
        assert result.summary["instances"]["main"] == "main-1"
