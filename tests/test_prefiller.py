"""P's chunk pipeline (services/prefill/prefiller.py) on the tiny model: a prompt's next chunk is
queued before one is handed out, so its chunks take consecutive steps ahead of a later prompt's;
closing the pipeline early withdraws what it queued; the KV equals the prompt computed alone."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from contextlib import aclosing

import pytest
import torch

from services.prefill.prefiller import Prefiller
from shared.batch_engine import BatchEngine
from shared.config import EngineConfig
from shared.engine_timeline import read_timeline
from shared.model_runner import ModelRunner
from shared.models import load_model

CHUNK = 16


@pytest.fixture(scope="module")
def runner(tiny_path) -> ModelRunner:
    return ModelRunner(load_model(tiny_path, "float32", "cpu"))


class SlowRunner:
    """The runner with a step as long as a real model's (30 ms), longer than P's work on a chunk."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def forward_packed(self, rows):
        time.sleep(0.03)
        return self.runner.forward_packed(rows)


def alone(runner: ModelRunner, prompt_ids: list[int]) -> torch.Tensor:
    kv = runner.new_kv(len(prompt_ids) - 1)
    runner.forward(kv, prompt_ids[:-1])
    return kv.slice(0, kv.length)


def prompt(runner: ModelRunner, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(runner.config.vocab_size) for _ in range(n)]


async def prefill(prefiller: Prefiller, key: str, prompt_ids: list[int]) -> torch.Tensor:
    await prefiller.open(key, len(prompt_ids) - 1)
    try:
        async with aclosing(prefiller.chunks(key, prompt_ids, 0)) as chunks:
            return torch.cat([chunk.kv async for chunk in chunks], dim=3)
    finally:
        prefiller.release(key)


async def test_a_prompts_chunks_take_consecutive_steps_ahead_of_a_later_prompts(runner, tmp_path):
    path = tmp_path / "engine.jsonl"
    first, later = prompt(runner, 3 * CHUNK + 1, 1), prompt(runner, 3 * CHUNK + 1, 2)
    engine = BatchEngine(SlowRunner(runner), EngineConfig(max_batch_tokens=CHUNK, long_work_by_admission=True,
                                                          timeline_path=str(path)), name="test")
    try:
        prefiller = Prefiller(engine, CHUNK)
        await prefiller.open("first", 3 * CHUNK)
        await engine.open("later", [], 3 * CHUNK)
        gate = threading.Event()
        paused = asyncio.ensure_future(engine.run(gate.wait, 10))  # the engine waits while both queue
        await asyncio.sleep(0.05)
        # the later prompt's chunks are all queued first; the first's come through the pipeline
        queued = [engine.submit("later", later[s:s + CHUNK], sample=False, return_kv=True)
                  for s in range(0, 3 * CHUNK, CHUNK)]

        async def through_the_pipeline() -> torch.Tensor:
            computed = []
            async with aclosing(prefiller.chunks("first", first, 0)) as chunks:
                async for chunk in chunks:
                    computed.append(chunk.kv)
                    await asyncio.sleep(0.005)  # P queues the chunk's KV on its paths meanwhile
            return torch.cat(computed, dim=3)

        first_task = asyncio.create_task(through_the_pipeline())
        await asyncio.sleep(0.05)
        gate.set()
        await paused
        first_kv = await first_task
        later_kv = torch.cat(await asyncio.gather(*queued), dim=3)
        prefiller.release("first")
        engine.release("later")
    finally:
        engine.shutdown()
    order = [row[0] for e in read_timeline(path) if e["kind"] == "step" for row in e["rows"]]
    assert order == ["first"] * 3 + ["later"] * 3
    torch.testing.assert_close(first_kv, alone(runner, first), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(later_kv, alone(runner, later), rtol=1e-5, atol=1e-5)


async def test_closing_the_pipeline_early_withdraws_the_chunk_it_queued(runner):
    prompt_ids = prompt(runner, 4 * CHUNK + 1, 3)
    engine = BatchEngine(runner, EngineConfig(max_batch_tokens=CHUNK), name="test")
    try:
        prefiller = Prefiller(engine, CHUNK)
        await prefiller.open("p", 4 * CHUNK)
        async with aclosing(prefiller.chunks("p", prompt_ids, 0)) as chunks:
            async for chunk in chunks:
                assert chunk.span == (0, CHUNK) and chunk.started_ns >= chunk.ready_ns
                break
        async with asyncio.timeout(10):
            while engine.queued:
                await asyncio.sleep(0.005)
        steps = engine.steps
        await asyncio.sleep(0.1)
        assert engine.steps == steps <= 2, "the queued second chunk ran at most; nothing after it"
        prefiller.release("p")
        again = prompt(runner, 2 * CHUNK + 1, 4)
        torch.testing.assert_close(await prefill(prefiller, "q", again), alone(runner, again), rtol=1e-5, atol=1e-5)
    finally:
        engine.shutdown()
