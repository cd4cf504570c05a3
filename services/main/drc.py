"""MD's Decode-side RadixCache (DRC): the prompt prefixes MD already holds and the KV it keeps.

A request's prefix is locked from its assignment until its KV is assembled (the prefix, then
what P sent); a finished request's KV is kept for the session's next turn. The changes become the
events the gateway's cache index follows. Plain: the caller publishes `take_events()`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from shared.config import CacheConfig
from shared.radix_cache import CacheEvent, PrefixHandle, RadixCache

CACHE_EVENT_BLOCK_TOKENS = 16  # granularity of the gateway's view of the DRC


class DecodeCache:
    def __init__(self, config: CacheConfig) -> None:
        self._events: list[CacheEvent] = []
        self.cache = RadixCache(config.tokens, config.kv_bytes, self._events.append,
                                event_block_tokens=CACHE_EVENT_BLOCK_TOKENS)
        self._locks: dict[str, PrefixHandle] = {}

    def lock(self, request_id: str, prompt_ids: Sequence[int]) -> int:
        """Lock the longest cached prefix of the prompt's KV positions; its length in tokens."""
        handle = self.cache.lock(prompt_ids[:-1])
        self._locks[request_id] = handle
        return handle.length

    def assemble(self, request_id: str, received: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The locked prefix's KV (copied, then unlocked) before the received rest."""
        handle = self._locks.pop(request_id, None)
        if handle is None:
            return (received,)
        try:
            return (self.cache.gather(handle), received) if handle.length else (received,)
        finally:
            handle.release()

    def unlock(self, request_id: str) -> None:
        handle = self._locks.pop(request_id, None)
        if handle is not None:
            handle.release()

    def keep(self, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        self.cache.insert(token_ids, kv)

    def take_events(self) -> list[dict]:
        """The changes since the last call, as CacheEvents wants them."""
        events = [{**dataclasses.asdict(event), "block_hashes": [list(b) for b in event.block_hashes]}
                  for event in self._events]
        self._events.clear()
        return events

    def gauges(self) -> dict[str, float]:
        return self.cache.gauges()
