"""A decoder whose engine thread dies (a bug outside the forward), on real processes (tiny model):
the process stops and exits with status 1, so a supervisor sees it gone, and the request it held
moves on (to RLD, the only decoder left) instead of hanging on an engine nobody runs.

The bug is put into a restarted MD through a `sitecustomize` module on its PYTHONPATH: the
engine's scheduler raises at the first step that has work, and the service's stop starts a second
late, as on a loaded machine (CI): the request's failure reaches the gateway while the process is
still there, and must say it is stopping, or the gateway, seeing MD answer its pings, gives it the
request again. Nothing else is mocked."""
from __future__ import annotations

import asyncio

from tools.api_client import stream_completion

from helpers import RESTART_TIMEOUT_S, fresh_heartbeats, random_prompt, restart_patched

BEAT = ["--heartbeat-s", "0.25"]
STACK = {"pipeline": "p-md",
         "extra_args": {"prefill": BEAT, "relay": BEAT, "main": BEAT,
                        "gateway": [*BEAT, "--token-timeout-s", "20", "--request-timeout-s", "60"]}}

# Runs at the interpreter's start, before services.main is imported.
BROKEN_ENGINE = '''
from shared import batch_engine

_make_room = batch_engine.BatchEngine._make_room


def _broken(self, batch):
    if batch:
        raise RuntimeError("injected: a bug in the engine's scheduling")
    return _make_room(self, batch)


batch_engine.BatchEngine._make_room = _broken

import asyncio
from services.decoder import service

_stop = service.DecoderService.stop


async def _late_stop(self):
    await asyncio.sleep(1.0)
    await _stop(self)


service.DecoderService.stop = _late_stop
'''


async def wait_exited(stack, role: str, timeout_s: float) -> int:
    async with asyncio.timeout(timeout_s):
        while (code := stack.processes[role].poll()) is None:
            await asyncio.sleep(0.05)
    return code


async def test_an_md_whose_engine_dies_exits_with_status_1_and_its_request_moves_to_relay(
        stack, session, tiny_generate, tmp_path, monkeypatch):
    # the broken MD is up and beating (its loop is fine until work comes), and answers pings
    await restart_patched(stack, "main", BROKEN_ENGINE, tmp_path, monkeypatch)

    prompt = random_prompt(41, 60)
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "pdd": {"pipeline": "p-md"}}
    async with asyncio.timeout(60):
        result = await stream_completion(session, stack.api_url, body)
    # MD failed the request before its first token and is gone: the gateway moved it to RLD
    assert result.token_ids == tiny_generate(prompt, 24) and set(result.tiers) == {"relay"}
    migration, = result.summary["migrations"]
    assert (migration["lost"], migration["pipeline"], migration["after_tokens"]) == ("main", "p-rld", 0)

    assert await wait_exited(stack, "main", 30) == 1
    log = stack.log_paths["main"].read_text()
    assert "engine loop died" in log and "injected: a bug in the engine's scheduling" in log
    assert "Traceback" in log

    await stack.restart("main")  # the unbroken MD again, for whatever runs next in this module
    await fresh_heartbeats(stack.nats_url, timeout_s=RESTART_TIMEOUT_S)
