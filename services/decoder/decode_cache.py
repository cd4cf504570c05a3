"""A decoder's prefix cache: MD's Decode-side RadixCache (DRC), and RLD's own.

The prompt prefixes a decoder already holds and the KV it keeps. A request's prefix is locked from
its assignment until the engine has copied it (at once, while P computes and sends the rest); a
finished request's KV (MD), or a handed-off one's (RLD: the prompt and its eager tokens), is kept
for the session's next turn, so P sends that decoder only what it lacks. The changes become the
events the gateway's cache index follows. `CachingRole` is what both roles share of it.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import torch

from services.decoder.request import DecodeRequest
from services.decoder.role import DecoderIO
from shared import subjects
from shared.cache_worker import CacheWorker
from shared.config import CacheConfig
from shared.messages import CacheEvents, DecodeAssign
from shared.radix_cache import INDEX_BLOCK_TOKENS, CacheEvent, PrefixHandle, RadixCache

log = logging.getLogger(__name__)


class DecodeCache:
    """Every tree operation runs on the cache's own worker thread (shared/cache_worker.py), off MD's loop."""

    def __init__(self, config: CacheConfig) -> None:
        self._events: list[CacheEvent] = []
        self.cache = RadixCache(config.tokens, config.kv_bytes, self._events.append,
                                event_block_tokens=INDEX_BLOCK_TOKENS)
        self._worker = CacheWorker(self.cache, "drc")
        self._locks: dict[str, PrefixHandle] = {}  # touched on the worker only
        self._pins: dict[str, PrefixHandle] = {}  # prefixes held while a finished request's rest is kept

    async def lock(self, request_id: str, prompt_ids: Sequence[int]) -> int:
        """Lock the longest cached prefix of the prompt's KV positions; its length in tokens."""
        return await self._worker.call(self._lock, request_id, prompt_ids)

    async def prefix(self, request_id: str) -> tuple[torch.Tensor, ...]:
        """The locked prefix's KV, as views of the cache's pieces (copying nothing): valid for as long
        as the caller likes, counted in the cache until `unlock`."""
        return await self._worker.call(self._prefix, request_id)

    def unlock(self, request_id: str) -> None:
        """Release the request's prefix, if still locked (in order after anything asked before)."""
        self._worker.post(self._unlock, request_id)

    async def keep(self, request_id: str, token_ids: Sequence[int],
                   export: Callable[[int], Awaitable[torch.Tensor]]) -> list[dict]:
        """Insert a finished request's KV; the cache's changes since the last keep, as CacheEvents wants them.

        The cached prefix of the tokens is locked first, so `export(start)` copies out only the KV of
        token_ids[start:], the part the cache lacks (on a session's turn, the new suffix and the
        answer, not the whole context again).
        """
        try:
            start = await self._worker.call(self._pin, request_id, token_ids)
            kv = await export(start)
            return await self._worker.call(self._keep, token_ids, kv, start)
        finally:  # queued behind the pin on the one worker thread, so it runs even if we were cancelled
            self._worker.post(self._unpin, request_id)

    def gauges(self) -> dict[str, float]:
        return self._worker.gauges()

    def close(self) -> None:
        self._worker.close()

    def _lock(self, request_id: str, prompt_ids: Sequence[int]) -> int:
        handle = self.cache.lock(prompt_ids[:-1])
        self._locks[request_id] = handle
        return handle.length

    def _prefix(self, request_id: str) -> tuple[torch.Tensor, ...]:
        handle = self._locks.get(request_id)
        return tuple(self.cache.pieces(handle)) if handle is not None and handle.length else ()

    def _unlock(self, request_id: str) -> None:
        handle = self._locks.pop(request_id, None)
        if handle is not None:
            handle.release()

    def _pin(self, request_id: str, token_ids: Sequence[int]) -> int:
        handle = self.cache.lock(token_ids, query=False)
        self._pins[request_id] = handle
        return handle.length

    def _unpin(self, request_id: str) -> None:
        handle = self._pins.pop(request_id, None)
        if handle is not None:
            handle.release()

    def _keep(self, token_ids: Sequence[int], kv: torch.Tensor, kv_start: int) -> list[dict]:
        self.cache.insert(token_ids, kv, kv_start)
        events = [event.to_dict() for event in self._events]
        self._events.clear()
        return events


class CachingRole:
    """The part of a decoder role that keeps a `DecodeCache` (none when its capacity is 0)."""

    def __init__(self, cache: CacheConfig) -> None:
        self.cache = DecodeCache(cache) if cache.enabled else None

    def stats(self) -> dict[str, float]:
        return self.cache.gauges() if self.cache is not None else {}

    async def hold_prefix(self, assign: DecodeAssign) -> int:
        return await self.cache.lock(assign.request_id, assign.prompt_ids) if self.cache is not None else 0

    async def prefix_kv(self, request: DecodeRequest) -> tuple[torch.Tensor, ...]:
        return await self.cache.prefix(request.request_id) if self.cache is not None else ()

    def unlock_prefix(self, request: DecodeRequest) -> None:
        if self.cache is not None:
            self.cache.unlock(request.request_id)

    def release(self, request: DecodeRequest) -> None:
        self.unlock_prefix(request)

    async def keep(self, request: DecodeRequest, io: DecoderIO) -> None:
        """Keep the KV the engine holds of the request (its prompt, then the output tokens fed so
        far) in the cache, and tell the gateway's index what changed."""
        if self.cache is None:
            return
        seq = request.sequence
        assert seq.kv is not None  # admitted: the engine gave it its KV
        cached = seq.kv.length
        events = await self.cache.keep(request.request_id, (seq.prompt_ids + seq.output_ids)[:cached],
                                       lambda start: io.export(request, start, cached))
        if not events:
            return
        try:
            await io.publish(subjects.cache_events(io.instance_id), CacheEvents(io.instance_id, events))
        except Exception as exc:  # the index catches up from the next batch
            log.warning("cache events not published: %s", exc)
