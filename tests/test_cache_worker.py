"""Radix-cache work off the event loop: P's prefix cache and MD's DRC run every tree operation on
one worker thread, in call order, and the loop keeps running meanwhile."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from services.decoder.decode_cache import DecodeCache
from shared.cache_worker import CacheWorker
from shared.config import CacheConfig
from shared.radix_cache import RadixCache

LAYERS, HEADS, HEAD_DIM = 2, 2, 4


def kv_for(ids: list[int]) -> torch.Tensor:
    kv = torch.empty(LAYERS, 2, HEADS, len(ids), HEAD_DIM)
    for t, tok in enumerate(ids):
        kv[:, :, :, t, :] = tok + 1000.0 * t
    return kv


def exporting(kv: torch.Tensor, starts: list[int]):
    """An engine's export of a finished request's KV from `start`, recording each start asked for."""
    async def export(start: int) -> torch.Tensor:
        starts.append(start)
        return kv[:, :, :, start:].clone()
    return export


async def test_calls_run_on_the_worker_thread_in_order_and_posts_too() -> None:
    worker = CacheWorker(RadixCache(1 << 20, 1 << 30), "test-cache")
    seen: list[tuple[str, str]] = []

    def record(tag: str) -> str:
        seen.append((tag, threading.current_thread().name))
        return tag

    try:
        worker.post(record, "posted-1")
        assert await worker.call(record, "called") == "called"
        worker.post(record, "posted-2")
        assert await worker.call(record, "last") == "last"
        assert [tag for tag, _ in seen] == ["posted-1", "called", "posted-2", "last"]
        assert all(name.startswith("test-cache") for _, name in seen)
        assert threading.current_thread().name not in {name for _, name in seen}
    finally:
        worker.close()


async def test_an_error_in_a_call_reaches_the_caller_and_the_worker_goes_on() -> None:
    worker = CacheWorker(RadixCache(1 << 20, 1 << 30), "test-cache")
    try:
        with pytest.raises(ValueError):
            await worker.call(worker.tree.insert, [1, 2, 3], kv_for([1, 2]))  # KV for two tokens, three ids
        assert await worker.call(worker.tree.insert, [1, 2, 3], kv_for([1, 2, 3])) == 3
        assert worker.gauges()["cache_tokens"] == 3  # as the last call left the tree
    finally:
        worker.close()


async def test_the_loop_runs_while_the_drc_inserts_and_hands_out_a_prefix() -> None:
    drc = DecodeCache(CacheConfig(tokens=1 << 20, kv_bytes=1 << 34))
    ids = list(range(100, 4100))
    kv = torch.randn(30, 2, 3, len(ids), 64)  # SmolLM2's shape: 4k tokens, ~190 MB in float32
    ticks = 0
    stop = asyncio.Event()

    async def tick() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    try:
        await asyncio.sleep(0)
        before = ticks
        events = await drc.keep("req-0", ids, exporting(kv, []))
        assert ticks > before  # the loop ran while the clone was made
        assert events and events[0]["kind"] == "stored"
        assert await drc.lock("req-1", ids + [7]) == len(ids)
        parts = await drc.prefix("req-1")
        assert torch.equal(torch.cat(parts, dim=3), kv)
        assert parts[0].data_ptr() == drc.cache.pieces(drc._locks["req-1"])[0].data_ptr()  # views: no copy
        assert drc.gauges()["locked_nodes"] > 0  # held until the engine copied it
        drc.unlock("req-1")
        await drc.prefix("probe")  # a call on the worker, after the queued unlock
        assert drc.gauges()["locked_nodes"] == 0
    finally:
        stop.set()
        await ticker
        drc.close()


async def test_the_drc_copies_out_only_what_it_lacks_of_a_finished_request() -> None:
    drc = DecodeCache(CacheConfig(tokens=1 << 20, kv_bytes=1 << 30))
    first = list(range(100, 140))
    second = first + list(range(300, 312))  # the next turn: the first turn's context, then its own
    starts: list[int] = []
    try:
        await drc.keep("turn-1", first, exporting(kv_for(first), starts))
        await drc.keep("turn-2", second, exporting(kv_for(second), starts))
        await drc.keep("turn-2-again", second, exporting(kv_for(second), starts))
        assert starts == [0, len(first), len(second)]  # the cached prefix is never copied out again
        assert drc.cache.tokens == len(second)
        assert await drc.lock("turn-3", second + [7]) == len(second)
        parts = await drc.prefix("turn-3")
        assert len(parts) == 2  # the two inserts' pieces ...
        assert torch.equal(torch.cat(parts, dim=3), kv_for(second))  # ... joined into the whole KV
        drc.unlock("turn-3")
        await drc.prefix("probe")
        assert drc.gauges()["locked_nodes"] == 0
        # keeping counts no lookups: turn-3's lock is the one query, and it hit all it asked
        assert (drc.cache.query_tokens, drc.cache.hit_tokens) == (len(second), len(second))
    finally:
        drc.close()


async def test_a_keep_cancelled_during_its_export_leaves_nothing_locked() -> None:
    drc = DecodeCache(CacheConfig(tokens=1 << 20, kv_bytes=1 << 30))
    ids = list(range(50))
    exporting_now, never = asyncio.Event(), asyncio.Event()

    async def stuck_export(start: int) -> torch.Tensor:
        exporting_now.set()
        await never.wait()
        raise AssertionError("never released")

    try:
        await drc.keep("turn-1", ids[:20], exporting(kv_for(ids[:20]), []))
        keep = asyncio.create_task(drc.keep("turn-2", ids, stuck_export))
        await exporting_now.wait()
        keep.cancel()
        with pytest.raises(asyncio.CancelledError):
            await keep
        await drc.prefix("probe")  # a call on the worker, after the queued unpin
        assert drc.cache.locked_nodes == 0
        assert drc.cache.tokens == 20
    finally:
        drc.close()
