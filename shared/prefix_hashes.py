"""The names of token prefixes: the hashes a cache's events carry and the gateway's index probes
with. Plain hashing, no tensors, so the gateway imports it without the caches' torch."""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

PREFIX_HASH_BYTES = 8


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """What a prefix's hash is computed over: the ids as little-endian int64."""
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def hash_prefix(token_ids: Sequence[int]) -> str:
    """The name of a token prefix in events: blake2b-64 over the ids as little-endian int64, hex.

    Args:
        token_ids: the whole prefix, from token 0.
    Returns:
        16 hex characters. Hashing is streaming, so `prefix_hashes` gives the same values.
    """
    return hashlib.blake2b(token_bytes(token_ids), digest_size=PREFIX_HASH_BYTES).hexdigest()


def prefix_hashes(token_ids: Sequence[int], ends: Iterable[int]) -> dict[int, str]:
    """`hash_prefix(token_ids[:end])` for many ends in one pass (for an index probing a request).

    Args:
        token_ids: a request's tokens.
        ends: prefix lengths, each in [0, len(token_ids)].
    Returns:
        end -> prefix hash.
    """
    h = hashlib.blake2b(digest_size=PREFIX_HASH_BYTES)
    out: dict[int, str] = {}
    pos = 0
    for end in sorted(set(ends)):
        if not 0 <= end <= len(token_ids):
            raise ValueError(f"prefix end {end} outside [0, {len(token_ids)}]")
        h.update(token_bytes(token_ids[pos:end]))
        pos = end
        out[end] = h.copy().hexdigest()
    return out
