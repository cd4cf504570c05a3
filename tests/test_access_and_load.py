"""Access and load on real processes (tiny model): authenticated KV sockets and API, bad frames
refused without harm, and admission control that refuses quickly instead of piling up."""
from __future__ import annotations

import asyncio
import random

import aiohttp
import orjson
import pytest

from shared import bus, kv_wire, messages, subjects
from tools.api_client import ApiError, stream_completion

API_KEY = "test-key-123"
MAX_RUNNING = 2


@pytest.fixture(scope="module")
def stack_overrides(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    secrets_dir = tmp_path_factory.mktemp("secrets")
    (secrets_dir / "kv").write_text("kv-shared-secret\n")
    (secrets_dir / "api").write_text(API_KEY)
    kv = ["--kv-secret-file", str(secrets_dir / "kv"), "--heartbeat-s", "0.25"]
    return {"chunk_tokens": 256, "api_key_file": secrets_dir / "api", "max_running_requests": MAX_RUNNING,  # pdd up's
            "extra_args": {"prefill": kv, "relay": kv, "main": kv,
                           "gateway": ["--max-queued-requests", "0"]}}  # refuse at once


@pytest.fixture(scope="module")
async def session():
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=120)) as client:
        yield client


def prompt(seed: int, n: int = 60) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


async def main_heartbeat(nats_url: str) -> messages.Heartbeat:
    nc = await bus.connect(nats_url, "test")
    beat: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_beat(msg) -> None:
        if not beat.done():
            beat.set_result(messages.decode(msg.data))

    await nc.subscribe(subjects.heartbeat("main"), cb=on_beat)
    async with asyncio.timeout(10):
        result = await beat
    await nc.close()
    return result


async def test_api_key_is_required_when_configured(stack, session, tiny_generate):
    async with aiohttp.ClientSession() as anonymous:
        async with anonymous.post(stack.api_url + "/v1/completions", json={"prompt": [1, 2, 3]}) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_api_key"
    p = prompt(1)
    result = await stream_completion(session, stack.api_url, {"prompt": p, "max_tokens": 8, "temperature": 0})
    assert result.token_ids == tiny_generate(p, 8), "with the shared KV secret, P, RLD and MD interoperate"


async def test_the_key_must_follow_the_bearer_scheme_written_in_any_case(stack):
    """RFC 9110: the scheme is case-insensitive; without it, a bare key is not a credential."""
    body = {"prompt": [1, 2, 3], "max_tokens": 1}
    forms = [(API_KEY, 401), (f"Basic {API_KEY}", 401), (f"bearer {API_KEY}", 200), (f"BEARER  {API_KEY}", 200)]
    async with aiohttp.ClientSession() as client:
        for authorization, status in forms:
            async with client.post(stack.api_url + "/v1/completions", json=body,
                                   headers={"Authorization": authorization}) as resp:
                assert resp.status == status, authorization
                if status == 401:
                    assert (await resp.json())["error"]["code"] == "invalid_api_key"


async def test_kv_port_refuses_unauthenticated_garbage_and_truncated_peers(stack, session):
    beat = await main_heartbeat(stack.nats_url)
    host, port = beat.kv_host, beat.kv_port
    refused_before = beat.stats["kv_refused_connections"]
    layout_hello = {"magic": "PDKV", "version": kv_wire.PROTOCOL_VERSION, "model_id": "tiny-llama@x",
                    "num_layers": 4, "kv_heads": 2, "head_dim": 16, "wire_dtype": "float32", "nonce": "ab"}
    attempts = [
        kv_wire.pack_message(layout_hello),  # no proof of the secret
        kv_wire.pack_message({**layout_hello, "auth": "0" * 64}),  # a wrong proof
        b"\x00\x00\x00\x10{not json at all",  # garbage
        b"\x00\x00",  # truncated, then the peer hangs up
        b"\xff\xff\xff\xff" + b"x" * 100,  # an absurd length prefix
    ]
    for data in attempts:
        reader, writer = await asyncio.open_connection(host, port)
        challenge = orjson.loads(await reader.readexactly(await _length(reader)))
        assert challenge["magic"] == "PDKV" and challenge["nonce"]
        writer.write(data)
        await writer.drain()
        if data == b"\x00\x00":
            writer.close()
            continue
        async with asyncio.timeout(10):
            rest = await reader.read()
        assert b'"ok":true' not in rest
        writer.close()
    await asyncio.sleep(0.6)
    after = await main_heartbeat(stack.nats_url)
    assert after.stats["kv_refused_connections"] >= refused_before + 4
    p = prompt(2)
    result = await stream_completion(session, stack.api_url, {"prompt": p, "max_tokens": 4, "temperature": 0})
    assert len(result.token_ids) == 4, "the decoder still serves"


async def _length(reader: asyncio.StreamReader) -> int:
    return kv_wire.unpack_length(await reader.readexactly(kv_wire.LENGTH_PREFIX_BYTES))


async def test_a_full_gateway_refuses_quickly_with_retry_after(stack, session):
    async def one(i: int) -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        body = {"prompt": prompt(100 + i), "max_tokens": 150, "temperature": 0, "ignore_eos": True}
        try:
            await stream_completion(session, stack.api_url, body)
            return "ok", loop.time() - t0
        except ApiError as exc:
            assert exc.status == 429
            return "refused", loop.time() - t0

    outcomes = await asyncio.gather(*(one(i) for i in range(8)))
    accepted = [t for kind, t in outcomes if kind == "ok"]
    refused = [t for kind, t in outcomes if kind == "refused"]
    assert len(accepted) >= MAX_RUNNING and refused, outcomes
    assert max(refused) < min(accepted), "a refusal comes before any accepted request finishes"
    async with session.post(stack.api_url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}) as resp:
        assert resp.status == 200


async def test_an_oversized_body_is_refused_without_harm(stack, session):
    async with session.post(stack.api_url + "/v1/completions", data=b"x" * (5 * 1024 * 1024),
                            headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 413
    result = await stream_completion(session, stack.api_url, {"prompt": prompt(3), "max_tokens": 2})
    assert len(result.token_ids) == 2
