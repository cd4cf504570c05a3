"""A token-level radix tree of cached KV, shared by Prefill and Main Decode's DRC.

It owns which token prefixes have KV, their LRU order, the ref counts that pin them, and the
events that let the gateway mirror its contents. It knows nothing of NATS, sockets or the model.

Threading: P and MD call it only from their asyncio loop thread (the engine thread is handed
tensors, never the cache), so it takes no locks and must not be shared across threads.

It is one module past 450 lines on purpose: insertion, lookup with locks, LRU eviction and the
event mirror all keep the same node invariants (ref counts, block-aligned hashes), and split apart
they would spread one contract over several files.
"""
from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

import torch

from shared.prefix_hashes import PREFIX_HASH_BYTES, hash_prefix, prefix_hashes, token_bytes

TOKEN_DIM = 3  # KV is [layers, 2 (K,V), kv_heads, tokens, head_dim]

EventKind = Literal["stored", "evicted"]
INDEX_BLOCK_TOKENS = 16  # the granularity of the gateway's view of a cache (CacheEvent.block_hashes)


@dataclass(frozen=True)
class CacheEvent:
    """One change to the tree, for the gateway's index of what a worker holds.

    Replaying events into a set keyed by (prefix_hash, end), adding on "stored" and removing on
    "evicted", gives exactly the tree's nodes (see `snapshot`). A node [start, end) holds the KV
    of tokens start..end-1 and its prefix_hash names tokens[:end]; eviction only takes leaves,
    so the held set is always prefix-closed.

    kind: "stored" when a node appears, "evicted" when one is dropped.
    tokens: KV tokens this event added or removed. A split of an existing node emits "stored"
        for its new upper half with tokens=0: a new node end, but no new KV.
    """

    kind: EventKind
    prefix_hash: str
    start: int
    end: int
    tokens: int
    # (end, hash_prefix(tokens[:end])) at every multiple of the cache's event_block_tokens inside
    # (start, end], so an index can match prefixes that end inside a node, to block granularity
    block_hashes: tuple[tuple[int, str], ...] = ()

    def to_dict(self) -> dict:
        """As the CacheEvents message carries it."""
        return {**dataclasses.asdict(self), "block_hashes": [list(b) for b in self.block_hashes]}


class _Node:
    __slots__ = ("key", "kv", "parent", "children", "start", "prefix_hash", "ref", "last_access", "node_id",
                 "block_hashes")

    def __init__(self, key: tuple[int, ...], kv: torch.Tensor | None, parent: _Node | None, start: int,
                 prefix_hash: str, node_id: int) -> None:
        self.key = key  # the edge's tokens; children are keyed by their key[0]
        self.kv = kv  # [layers, 2, kv_heads, len(key), head_dim], owned (contiguous clone); None at root
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.start = start
        self.prefix_hash = prefix_hash
        self.ref = 0
        self.last_access = 0
        self.node_id = node_id
        self.block_hashes: tuple[tuple[int, str], ...] = ()

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    @property
    def kv_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.nbytes


class PrefixHandle:
    """A locked match: every node from the root to `length` stays cached until `release()`.

    It holds only the deepest node and releases by walking up parent links, so a later split of
    any node on the path (which gives the new upper half the same ref count) is released too.
    """

    def __init__(self, cache: RadixCache, node: _Node, length: int) -> None:
        self._cache = cache
        self._node = node
        self.length = length
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Unpin the path. Idempotent, so every exit path may call it."""
        if not self._released:
            self._released = True
            self._cache._add_ref(self._node, -1)

    def __enter__(self) -> PrefixHandle:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"PrefixHandle(length={self.length}, released={self._released})"


class RadixCache:
    """Cached KV by token prefix, bounded in tokens and bytes, evicting unpinned leaves by LRU."""

    def __init__(self, capacity_tokens: int, capacity_bytes: int,
                 listener: Callable[[CacheEvent], None] | None = None, event_block_tokens: int = 0) -> None:
        """
        Args:
            capacity_tokens: most tokens of KV held at once.
            capacity_bytes: most bytes of KV held at once (sum of the stored tensors' nbytes).
            listener: called synchronously after each node is stored, split or evicted; it must
                not raise or call back into the cache (hand the event to a queue).
            event_block_tokens: if > 0, events also name every prefix ending at a multiple of
                this many tokens (`CacheEvent.block_hashes`).
        """
        if capacity_tokens < 0 or capacity_bytes < 0:
            raise ValueError("capacities must be >= 0")
        self.capacity_tokens = capacity_tokens
        self.capacity_bytes = capacity_bytes
        self.event_block_tokens = event_block_tokens
        self._listener = listener
        self._ids = itertools.count()
        self._clock = itertools.count(1)  # a logical clock, so LRU order is deterministic in tests
        self._root = _Node((), None, None, 0, hash_prefix(()), next(self._ids))
        self._tokens = 0
        self._bytes = 0
        self._locked_nodes = 0
        # Learned from the first insert; every later KV must match so gather can concatenate.
        self._layout: tuple[tuple[int, ...], torch.dtype] | None = None
        self._evictions = 0
        self._evicted_tokens = 0
        self._queries = 0
        self._query_tokens = 0
        self._hit_tokens = 0

    # --- the contract -------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int]) -> int:
        """Longest cached prefix, without pinning it. Refreshes its LRU position.

        Args:
            token_ids: a request's tokens.
        Returns:
            How many leading tokens have cached KV (may end inside an edge).
        """
        ids = _as_ids(token_ids)
        node, pos, child, common = self._walk(ids)
        self._touch(child if common else node)
        self._count_query(len(ids), pos + common)
        return pos + common

    def lock(self, token_ids: Sequence[int], *, query: bool = True) -> PrefixHandle:
        """Match and pin the longest cached prefix until the handle is released.

        A match ending inside an edge splits that node, so the handle's path ends at a node.

        Args:
            token_ids: a request's tokens.
            query: count the match in the hit statistics (a request's lookup); False for a lock
                taken only to insert the rest of the sequence after it.
        Returns:
            A handle with `length` = matched tokens (0 is a valid, empty handle).
        """
        ids = _as_ids(token_ids)
        node, pos, child, common = self._walk(ids)
        if common:
            node = self._split(child, common, ids)
            pos += common
        self._add_ref(node, +1)
        self._touch(node)
        if query:
            self._count_query(len(ids), pos)
        return PrefixHandle(self, node, pos)

    def pieces(self, handle: PrefixHandle, length: int | None = None) -> list[torch.Tensor]:
        """The KV of a locked prefix as views of the cache's own pieces, in order, copying nothing.

        The cache never writes a piece in place (a split clones both halves), so the views stay valid
        and unchanged even after the handle is released; the handle is what keeps their bytes counted
        (and unevicted) while the caller copies them.

        Args:
            handle: an unreleased handle from this cache's `lock`.
            length: the first `length` tokens only; default the whole match.
        Returns:
            [layers, 2, kv_heads, tokens, head_dim] each, their tokens summing to `length`.
        Raises:
            ValueError: a released or foreign handle, or a length outside [0, handle.length].
        """
        if handle._cache is not self or handle.released:
            raise ValueError("pieces need an unreleased handle from this cache")
        n = handle.length if length is None else length
        if not 0 <= n <= handle.length:
            raise ValueError(f"prefix length {n} outside [0, {handle.length}]")
        path = list(self._path(handle._node))
        path.reverse()
        return [node.kv[:, :, :, :n - node.start] for node in path if node.start < n and node.kv is not None]

    def gather(self, handle: PrefixHandle, length: int | None = None) -> torch.Tensor:
        """The KV of a locked prefix, as one new tensor: `pieces`, concatenated.

        Returns:
            [layers, 2, kv_heads, length, head_dim].
        Raises:
            ValueError: as `pieces`, or an empty gather before anything was ever inserted (the KV
                shape is not known yet).
        """
        parts = self.pieces(handle, length)
        if parts:
            return torch.cat(parts, dim=TOKEN_DIM)
        if self._layout is None:
            raise ValueError("the cache has never stored KV, so an empty gather has no shape")
        shape, dtype = self._layout
        return torch.empty(*shape[:TOKEN_DIM], 0, *shape[TOKEN_DIM:], dtype=dtype)

    def insert(self, token_ids: Sequence[int], kv: torch.Tensor, kv_start: int = 0) -> int:
        """Cache a sequence's KV, storing only the suffix not cached yet.

        Evicts LRU unpinned leaves to make room (never the path being extended). If it still
        cannot fit the suffix, it stores the longest leading part of it that fits, maybe none.

        Args:
            token_ids: the whole sequence, from token 0.
            kv: the KV of token_ids[kv_start:], [layers, 2, kv_heads, len(token_ids) - kv_start,
                head_dim]; copied, never aliased.
            kv_start: where kv begins. A caller holding the first kv_start tokens locked (so cached)
                need not copy their KV out to insert what follows.
        Returns:
            Tokens newly stored.
        Raises:
            ValueError: a KV of the wrong shape, or kv_start beyond what the cache holds of the
                sequence (the KV would not join the tree).
        """
        ids = _as_ids(token_ids)
        if not 0 <= kv_start <= len(ids):
            raise ValueError(f"kv_start {kv_start} outside [0, {len(ids)}]")
        self._check_kv(kv, len(ids) - kv_start)
        node, pos, child, common = self._walk(ids)
        guard = child if child is not None and common else node
        self._touch(guard)
        matched = pos + common
        if matched < kv_start:
            raise ValueError(f"the KV starts at token {kv_start} but only {matched} tokens of the "
                             "sequence are cached")
        wanted = len(ids) - matched
        if wanted == 0:
            return 0
        bytes_per_token = kv.nbytes // (len(ids) - kv_start)
        self._add_ref(guard, +1)  # eviction below must not take the path we are extending
        try:
            self.evict(tokens=self._tokens + wanted - self.capacity_tokens,
                       kv_bytes=self._bytes + wanted * bytes_per_token - self.capacity_bytes)
        finally:
            self._add_ref(guard, -1)
        fits = min(wanted, self.capacity_tokens - self._tokens,
                   (self.capacity_bytes - self._bytes) // bytes_per_token)
        if fits <= 0:
            return 0
        if common:
            node = self._split(child, common, ids)
        end = matched + fits
        # A contiguous clone: a view would pin the caller's whole buffer and break the byte bound.
        leaf_kv = kv[:, :, :, matched - kv_start:end - kv_start].clone(memory_format=torch.contiguous_format)
        leaf = _Node(ids[matched:end], leaf_kv, node, matched, hash_prefix(ids[:end]), next(self._ids))
        if self.event_block_tokens:
            block = self.event_block_tokens
            ends = range((matched // block + 1) * block, end + 1, block)
            leaf.block_hashes = tuple(prefix_hashes(ids, ends).items())
        leaf.last_access = next(self._clock)
        node.children[leaf.key[0]] = leaf
        self._tokens += fits
        self._bytes += leaf.kv_bytes
        self._emit("stored", leaf, fits)
        return fits

    def evict(self, tokens: int = 0, kv_bytes: int = 0) -> int:
        """Drop least recently used unpinned leaves until this much is freed, or none are left.

        Whole nodes go, so it may free more than asked. Evicting a leaf can make its parent one.

        Args:
            tokens: tokens to free (<= 0: no token target).
            kv_bytes: bytes to free (<= 0: no byte target).
        Returns:
            Tokens evicted.
        """
        if tokens <= 0 and kv_bytes <= 0:
            return 0
        heap = [(n.last_access, n.node_id, n) for n in self._nodes()
                if not n.children and n.ref == 0 and n is not self._root]
        heapq.heapify(heap)
        freed_tokens = freed_bytes = 0
        while heap and (freed_tokens < tokens or freed_bytes < kv_bytes):
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None  # only non-root nodes enter the heap
            del parent.children[leaf.key[0]]
            freed_tokens += len(leaf.key)
            freed_bytes += leaf.kv_bytes
            self._tokens -= len(leaf.key)
            self._bytes -= leaf.kv_bytes
            self._evictions += 1
            self._evicted_tokens += len(leaf.key)
            self._emit("evicted", leaf, len(leaf.key))
            if parent is not self._root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed_tokens

    def snapshot(self) -> list[CacheEvent]:
        """One "stored" event per node: rebuilds the current tree from empty (for a late index)."""
        return [CacheEvent("stored", n.prefix_hash, n.start, n.end, len(n.key))
                for n in self._nodes() if n is not self._root]

    # --- stats --------------------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def kv_bytes(self) -> int:
        return self._bytes

    @property
    def locked_nodes(self) -> int:
        """Nodes with ref > 0."""
        return self._locked_nodes

    @property
    def evictions(self) -> int:
        """Nodes evicted since start."""
        return self._evictions

    @property
    def evicted_tokens(self) -> int:
        return self._evicted_tokens

    @property
    def queries(self) -> int:
        """Calls to match() and lock()."""
        return self._queries

    @property
    def query_tokens(self) -> int:
        return self._query_tokens

    @property
    def hit_tokens(self) -> int:
        """Matched tokens over all queries; hit rate = hit_tokens / query_tokens."""
        return self._hit_tokens

    def gauges(self) -> dict[str, float]:
        """Current use, for heartbeats and metrics."""
        return {"cache_tokens": self.tokens, "cache_kv_bytes": self.kv_bytes, "locked_nodes": self.locked_nodes,
                "cache_hit_tokens": self.hit_tokens, "cache_query_tokens": self.query_tokens,
                "cache_evicted_tokens": self.evicted_tokens}

    def check_invariants(self) -> None:
        """Walk the whole tree and raise AssertionError on any inconsistency (a test helper)."""
        tokens = kv_bytes = locked = 0
        stack = [(self._root, hashlib.blake2b(digest_size=PREFIX_HASH_BYTES))]
        while stack:
            node, h = stack.pop()
            _require(node.ref >= 0, f"negative ref {node.ref} at [{node.start}, {node.end})")
            if node is not self._root:
                _require(node.ref >= sum(c.ref for c in node.children.values()),
                         f"ref {node.ref} at [{node.start}, {node.end}) below its children's")
                h.update(token_bytes(node.key))
                _require(len(node.key) > 0, f"empty edge at {node.start}")
                _require(node.kv is not None and node.kv.shape[TOKEN_DIM] == len(node.key),
                         f"KV length differs from edge length at [{node.start}, {node.end})")
                _require(node.prefix_hash == h.hexdigest(), f"stale prefix hash at [{node.start}, {node.end})")
                tokens += len(node.key)
                kv_bytes += node.kv_bytes
                locked += node.ref > 0
            for first, child in node.children.items():
                _require(child.parent is node, "child's parent link is wrong")
                _require(len(child.key) > 0 and child.key[0] == first, "child keyed by a token not its first")
                _require(child.start == node.end, "child does not start where its parent ends")
                stack.append((child, h.copy()))
        _require(self._root.ref == 0, "the root is never locked")
        _require(tokens == self._tokens, f"tokens {self._tokens} != sum over nodes {tokens}")
        _require(kv_bytes == self._bytes, f"bytes {self._bytes} != sum over nodes {kv_bytes}")
        _require(locked == self._locked_nodes, f"locked_nodes {self._locked_nodes} != {locked} counted")
        _require(tokens <= self.capacity_tokens, f"{tokens} tokens over capacity {self.capacity_tokens}")
        _require(kv_bytes <= self.capacity_bytes, f"{kv_bytes} bytes over capacity {self.capacity_bytes}")

    # --- internals ----------------------------------------------------------------------------

    def _walk(self, ids: tuple[int, ...]) -> tuple[_Node, int, _Node | None, int]:
        """(deepest fully matched node, its end, the child matched part way or None, tokens into it)."""
        node, pos = self._root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            common = _common_len(child.key, ids, pos)
            if common < len(child.key):
                return node, pos, child, common
            node, pos = child, pos + common
        return node, pos, None, 0

    def _split(self, node: _Node | None, at: int, ids: tuple[int, ...]) -> _Node:
        """Cut `node` after `at` tokens; return the new upper half, which inherits ref and LRU."""
        assert node is not None and node.parent is not None and 0 < at < len(node.key)
        assert node.kv is not None
        end = node.start + at
        upper = _Node(node.key[:at], node.kv[:, :, :, :at].clone(memory_format=torch.contiguous_format),
                      node.parent, node.start, hash_prefix(ids[:end]), next(self._ids))
        # Every handle through `node` also passes through `upper`, and releases by walking up,
        # so copying the count keeps release exact.
        upper.ref = node.ref
        upper.last_access = node.last_access
        upper.block_hashes = tuple(b for b in node.block_hashes if b[0] <= end)
        node.block_hashes = tuple(b for b in node.block_hashes if b[0] > end)
        node.parent.children[upper.key[0]] = upper
        # Clone both halves so each owns exactly its bytes (a view would keep the whole buffer).
        node.kv = node.kv[:, :, :, at:].clone(memory_format=torch.contiguous_format)
        node.key = node.key[at:]
        node.start = end
        node.parent = upper
        upper.children[node.key[0]] = node
        self._locked_nodes += upper.ref > 0
        self._emit("stored", upper, 0)
        return upper

    def _add_ref(self, node: _Node, delta: int) -> None:
        for n in self._path(node):
            if delta > 0 and n.ref == 0:
                self._locked_nodes += 1
            n.ref += delta
            if n.ref < 0:
                raise RuntimeError(f"ref count below zero at [{n.start}, {n.end}): unlocked twice")
            if delta < 0 and n.ref == 0:
                self._locked_nodes -= 1

    def _touch(self, node: _Node | None) -> None:
        now = next(self._clock)
        for n in self._path(node):
            n.last_access = now

    def _path(self, node: _Node | None) -> Iterator[_Node]:
        """From `node` up to, not including, the root."""
        while node is not None and node is not self._root:
            yield node
            node = node.parent

    def _nodes(self) -> Iterator[_Node]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _count_query(self, query_tokens: int, hit_tokens: int) -> None:
        self._queries += 1
        self._query_tokens += query_tokens
        self._hit_tokens += hit_tokens

    def _check_kv(self, kv: torch.Tensor, tokens: int) -> None:
        if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[TOKEN_DIM] != tokens:
            raise ValueError(f"KV shape {tuple(kv.shape)} is not [layers, 2, kv_heads, {tokens}, head_dim]")
        if 0 in kv.shape[:TOKEN_DIM] + kv.shape[TOKEN_DIM + 1:]:
            raise ValueError(f"KV shape {tuple(kv.shape)} has an empty dimension")
        layout = (tuple(kv.shape[:TOKEN_DIM]) + tuple(kv.shape[TOKEN_DIM + 1:]), kv.dtype)
        if self._layout is None:
            self._layout = layout
        elif layout != self._layout:
            raise ValueError(f"KV layout {layout} differs from the cache's {self._layout}")

    def _emit(self, kind: EventKind, node: _Node, tokens: int) -> None:
        if self._listener is not None:
            self._listener(CacheEvent(kind, node.prefix_hash, node.start, node.end, tokens, node.block_hashes))


def _as_ids(token_ids: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    if isinstance(token_ids, torch.Tensor):
        return tuple(token_ids.tolist())
    return tuple(int(t) for t in token_ids)


def _common_len(key: tuple[int, ...], ids: tuple[int, ...], pos: int) -> int:
    if ids[pos:pos + len(key)] == key:  # the common case, compared at C speed
        return len(key)
    n = 0
    for a, b in zip(key, ids[pos:]):
        if a != b:
            break
        n += 1
    return n


def _require(ok: bool, message: str) -> None:
    # Not `assert`: the checks must hold under python -O too.
    if not ok:
        raise AssertionError(message)
