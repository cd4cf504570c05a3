"""What the KV transfer tests share: a small layout, request ids, a receiver on a free loopback
port, and a transfer that queues a KV tensor chunk by chunk."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch

from shared.kv_receiver import KVReceiver
from shared.kv_sender import KVSender, OutgoingTransfer
from shared.messages import KVTarget
from shared.models import KVLayout
from shared.names import Role

LAYOUT = KVLayout("tiny@abc", num_layers=4, kv_heads=2, head_dim=16)


def new_rid() -> str:
    return "req-" + uuid.uuid4().hex


@asynccontextmanager
async def running_receiver(layout: KVLayout = LAYOUT) -> AsyncIterator[KVReceiver]:
    """A float32 KVReceiver listening on a free loopback port, its number as `.port`."""
    receiver = KVReceiver(layout, torch.float32)
    receiver.port = await receiver.start("127.0.0.1", 0)  # type: ignore[attr-defined]
    try:
        yield receiver
    finally:
        await receiver.stop()


async def send_chunks(sender: KVSender, port: int, rid: str, kv: torch.Tensor, chunk: int, *,
                      queue_chunks: int = 0, deadline_s: float = 10.0) -> OutgoingTransfer:
    """A transfer to MAIN at 127.0.0.1:port with kv [layers, 2, kv_heads, tokens, head_dim] queued
    in chunks of `chunk` tokens; the caller finishes it."""
    transfer = OutgoingTransfer(sender, KVTarget(Role.MAIN, "127.0.0.1", port), rid, queue_chunks=queue_chunks,
                                deadline_s=deadline_s)
    for start in range(0, kv.shape[3], chunk):
        await transfer.put(start, kv[:, :, :, start:start + chunk])
    return transfer
