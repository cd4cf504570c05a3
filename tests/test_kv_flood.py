"""A flood of strangers at the decoders' KV ports from P's own address (127.0.0.1): hundreds of
connections that never authenticate, each re-opened as the decoder closes it, must not lock P out.
A connection counts against the per-peer cap only once it has authenticated (issue 43, item 1)."""
from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import torch

from shared.kv_receiver import KVReceiver
from shared.kv_sender import KVSender, OutgoingTransfer
from shared.kv_transfer_state import TransferState
from shared.messages import KVTarget
from shared.models import KVLayout
from shared.names import Role
from tools.api_client import stream_completion

from helpers import fresh_heartbeats, random_prompt

LAYOUT = KVLayout("tiny@abc", num_layers=4, kv_heads=2, head_dim=16)
SECRET = b"s3cret"
FLOOD = 500  # per port, as in the issue: far over the per-peer cap of 64
GARBAGE_EVERY = 5  # one flood connection in five sends a bad hello, is refused at once and comes straight back
IDLE_S = 2.0  # the stack's decoders close an idle KV connection after this: P dials afresh under the flood


class Flood:
    """`count` connections from 127.0.0.1 to `port`, each re-opened as soon as the decoder closes it."""

    def __init__(self, host: str, port: int, count: int) -> None:
        self.host, self.port = host, port
        self.opened = 0
        self._tasks = [asyncio.create_task(self._one(i % GARBAGE_EVERY == 0)) for i in range(count)]

    async def _one(self, garbage: bool) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port, local_addr=("127.0.0.1", 0))
            except OSError:
                await asyncio.sleep(0.05)
                continue
            self.opened += 1
            try:
                if garbage:
                    writer.write(b"\x00\x00\x00\x02{}")  # a hello with nothing in it
                while await reader.read(65536):
                    pass
            except ConnectionError:
                pass
            finally:
                writer.close()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def flooding(*addresses: tuple[str, int], count: int = FLOOD) -> AsyncIterator[list[Flood]]:
    floods = [Flood(host, port, count) for host, port in addresses]
    try:
        async with asyncio.timeout(30):  # every connection up, and some already closed and re-opened
            while any(flood.opened < count * 1.1 for flood in floods):
                await asyncio.sleep(0.05)
        yield floods
    finally:
        for flood in floods:
            await flood.stop()


async def test_p_gets_through_a_flood_of_unauthenticated_connections_from_its_own_address() -> None:
    receiver = KVReceiver(LAYOUT, torch.float32, secret=SECRET)
    port = await receiver.start("127.0.0.1", 0)
    sender = KVSender(LAYOUT, torch.float32, 5.0, connections_per_peer=2, secret=SECRET)
    try:
        async with flooding(("127.0.0.1", port)):
            for seed in range(4):
                rid = "req-" + uuid.uuid4().hex
                kv = torch.randn(4, 2, 2, 40, 16, generator=torch.Generator().manual_seed(seed))
                inbox = receiver.expect(rid, 0, 40)
                outgoing = OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", port), rid, 0, deadline_s=10)
                for start in range(0, 40, 16):
                    await outgoing.put(start, kv[:, :, :, start:start + 16])
                result = await outgoing.finish()
                assert result.state is TransferState.DONE, result.error
                assert torch.equal(await inbox.wait(10, stall_timeout_s=5.0), kv)
                sender.drop("127.0.0.1", port)  # the next request dials again, into the flood
            assert receiver.open_connections <= 2, "only P's connections count against the caps"
        assert receiver.refused_connections > FLOOD // GARBAGE_EVERY  # the flood's bad hellos, refused
    finally:
        await sender.close()
        await receiver.stop()


# `pdd up`'s defaults (a KV secret), with decoders that close an idle KV connection after IDLE_S: P
# retires its connections at half that, and dials the decoders afresh into the flood.
STACK = {"chunk_tokens": 256,
         "extra_args": {"relay": ["--kv-idle-timeout-s", str(IDLE_S)], "main": ["--kv-idle-timeout-s", str(IDLE_S)]}}


async def test_sixteen_requests_complete_token_exact_while_rld_and_md_kv_ports_are_flooded(
        stack, session, tiny_generate) -> None:
    beats = await fresh_heartbeats(stack.nats_url, ("relay", "main"))
    await asyncio.sleep(IDLE_S)  # whatever P dialled while starting is retired: every path dials under the flood
    prompts = [random_prompt(100 + i, 40 + 7 * i) for i in range(16)]
    async with flooding(*((beats[role].kv_host, beats[role].kv_port) for role in ("relay", "main"))):
        results = await asyncio.gather(*(stream_completion(
            session, stack.api_url, {"prompt": prompt, "max_tokens": 24, "temperature": 0})
            for prompt in prompts))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == tiny_generate(prompt, 24)
