"""The radix cache: token-exact matching and gathering, LRU eviction under both bounds, locks that
release exactly once (even across splits), and events that mirror the tree."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from shared.prefix_hashes import hash_prefix, prefix_hashes
from shared.radix_cache import CacheEvent, PrefixHandle, RadixCache

LAYERS, HEADS, HEAD_DIM = 2, 2, 4
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * HEAD_DIM * 4  # float32
BIG = 1 << 40


def kv_for(ids: list[int]) -> torch.Tensor:
    """KV where token t's values depend only on (t, ids[t]): any two sequences agree on a shared
    prefix, so whichever inserted it first, gather must return exactly this."""
    kv = torch.empty(LAYERS, 2, HEADS, len(ids), HEAD_DIM)
    for t, tok in enumerate(ids):
        kv[:, :, :, t, :] = tok + 1000.0 * t + torch.arange(HEAD_DIM)
    return kv


def gathered(cache: RadixCache, ids: list[int], length: int | None = None) -> tuple[int, torch.Tensor]:
    with cache.lock(ids) as handle:
        return handle.length, cache.gather(handle, length)


class EventLog:
    """What the gateway would keep: the set of (prefix_hash, end) a worker holds."""

    def __init__(self) -> None:
        self.events: list[CacheEvent] = []
        self.held: set[tuple[str, int]] = set()

    def __call__(self, event: CacheEvent) -> None:
        self.events.append(event)
        key = (event.prefix_hash, event.end)
        if event.kind == "stored":
            assert key not in self.held
            self.held.add(key)
        else:
            self.held.remove(key)

    def matches(self, cache: RadixCache) -> bool:
        return self.held == {(e.prefix_hash, e.end) for e in cache.snapshot()}


# --- matching and gathering -------------------------------------------------------------------

def test_gathered_kv_equals_inserted_kv() -> None:
    cache = RadixCache(BIG, BIG)
    ids = list(range(10, 20))
    kv = torch.randn(LAYERS, 2, HEADS, 10, HEAD_DIM)
    assert cache.insert(ids, kv) == 10
    assert cache.tokens == 10 and cache.kv_bytes == 10 * BYTES_PER_TOKEN
    length, back = gathered(cache, ids)
    assert length == 10 and torch.equal(back, kv)
    length, back = gathered(cache, ids[:6] + [99, 98])
    assert length == 6 and torch.equal(back, kv[:, :, :, :6])
    length, back = gathered(cache, ids, length=3)
    assert torch.equal(back, kv[:, :, :, :3])
    assert gathered(cache, [5, 6], length=0)[1].shape == (LAYERS, 2, HEADS, 0, HEAD_DIM)
    cache.check_invariants()


def test_pieces_are_views_that_outlive_splits_and_the_release() -> None:
    """MD's engine copies a locked prefix from its pieces, not from a gathered copy; the cache never
    writes a piece in place, so a later split (or the release) leaves them as they were."""
    cache = RadixCache(BIG, BIG)
    first, second = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]
    cache.insert(first, kv_for(first))
    cache.insert(second, kv_for(second)[:, :, :, 4:], kv_start=4)
    handle = cache.lock(second)
    pieces = cache.pieces(handle)
    assert [p.shape[3] for p in pieces] == [4, 2]
    assert pieces[0].data_ptr() == cache.pieces(handle)[0].data_ptr()  # views: nothing copied
    cache.insert([1, 2, 9], kv_for([1, 2, 9]))  # splits the first piece's node in two
    handle.release()
    cache.check_invariants()
    assert torch.equal(torch.cat(pieces, dim=3), kv_for(second))
    assert [p.shape[3] for p in cache.pieces(cache.lock(second))] == [2, 2, 2]


def test_stored_kv_does_not_alias_the_callers_buffer() -> None:
    cache = RadixCache(BIG, BIG)
    kv = kv_for([1, 2, 3])
    cache.insert([1, 2, 3], kv)
    kv.zero_()
    assert torch.equal(gathered(cache, [1, 2, 3])[1], kv_for([1, 2, 3]))


def test_match_can_end_inside_an_edge_and_lock_splits_there() -> None:
    log = EventLog()
    cache = RadixCache(BIG, BIG, listener=log)
    ids = list(range(1, 11))
    cache.insert(ids, kv_for(ids))
    assert cache.match([1, 2, 3, 99]) == 3
    assert cache.match([7]) == 0 and cache.match([]) == 0
    assert len(cache.snapshot()) == 1, "a plain match does not reshape the tree"
    with cache.lock([1, 2, 3, 99]) as handle:
        assert handle.length == 3
        assert sorted((e.start, e.end) for e in cache.snapshot()) == [(0, 3), (3, 10)]
        assert torch.equal(cache.gather(handle), kv_for(ids)[:, :, :, :3])
    assert torch.equal(gathered(cache, ids)[1], kv_for(ids))
    assert log.matches(cache)
    cache.check_invariants()


def test_branching_prefixes_keep_the_cached_kv_and_store_only_the_new_suffix() -> None:
    cache = RadixCache(BIG, BIG)
    a, b = [1, 2, 3, 4, 5], [1, 2, 3, 7, 8, 9]
    kv_a = torch.randn(LAYERS, 2, HEADS, 5, HEAD_DIM)
    kv_b = torch.randn(LAYERS, 2, HEADS, 6, HEAD_DIM)
    assert cache.insert(a, kv_a) == 5
    assert cache.insert(b, kv_b) == 3
    assert cache.tokens == 8
    length, back = gathered(cache, b)
    assert length == 6
    assert torch.equal(back[:, :, :, :3], kv_a[:, :, :, :3]), "the shared prefix keeps the first insert's KV"
    assert torch.equal(back[:, :, :, 3:], kv_b[:, :, :, 3:])
    assert torch.equal(gathered(cache, a)[1], kv_a)
    assert cache.match([1, 2, 3, 7, 0]) == 4
    cache.check_invariants()


def test_inserting_a_cached_prefix_stores_nothing() -> None:
    log = EventLog()
    cache = RadixCache(BIG, BIG, listener=log)
    ids = list(range(10))
    cache.insert(ids, kv_for(ids))
    events = len(log.events)
    assert cache.insert(ids[:4], kv_for(ids[:4])) == 0
    assert cache.insert(ids, kv_for(ids)) == 0
    assert cache.insert([], kv_for([])) == 0
    assert cache.tokens == 10 and len(log.events) == events
    cache.check_invariants()


def test_insert_takes_kv_for_the_part_after_a_cached_prefix() -> None:
    cache = RadixCache(BIG, BIG)
    first, second = list(range(10)), list(range(10)) + [50, 51, 52, 53]
    cache.insert(first, kv_for(first))
    assert cache.insert(second, kv_for(second)[:, :, :, 6:], kv_start=6) == 4  # only what was missing
    length, kv = gathered(cache, second)
    assert length == len(second) and kv.equal(kv_for(second))
    assert cache.insert(second + [9], kv_for(second + [9])[:, :, :, 14:], kv_start=14) == 1
    assert gathered(cache, second + [9])[1].equal(kv_for(second + [9]))
    with cache.lock(first, query=False) as handle:  # a lock to insert behind counts no query
        assert handle.length == len(first)
    assert cache.query_tokens == 2 * len(second) + 1


def test_insert_refuses_kv_that_would_not_join_the_cached_prefix() -> None:
    cache = RadixCache(BIG, BIG)
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    ids = [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="only 3 tokens"):
        cache.insert(ids, kv_for(ids)[:, :, :, 4:], kv_start=4)  # token 3's KV is neither cached nor given
    with pytest.raises(ValueError, match="outside"):
        cache.insert(ids, kv_for([]), kv_start=7)
    with pytest.raises(ValueError, match="is not"):
        cache.insert(ids, kv_for(ids), kv_start=3)  # six tokens of KV for three
    assert cache.tokens == 3


def test_stats_count_queries_and_hits() -> None:
    cache = RadixCache(BIG, BIG)
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    cache.match([1, 2, 9, 9])
    cache.lock([1, 2, 3]).release()
    assert (cache.queries, cache.query_tokens, cache.hit_tokens) == (2, 7, 5)


def test_bad_kv_and_bad_gathers_are_refused() -> None:
    cache = RadixCache(BIG, BIG)
    with pytest.raises(ValueError, match="not \\[layers"):
        cache.insert([1, 2], kv_for([1, 2, 3]))
    cache.insert([1, 2], kv_for([1, 2]))
    with pytest.raises(ValueError, match="layout"):
        cache.insert([5], kv_for([5]).to(torch.float16))
    handle = cache.lock([1, 2])
    with pytest.raises(ValueError, match="outside"):
        cache.gather(handle, 3)
    handle.release()
    with pytest.raises(ValueError, match="unreleased"):
        cache.gather(handle)
    with pytest.raises(ValueError, match="unreleased"):
        cache.gather(RadixCache(BIG, BIG).lock([1]))
    with pytest.raises(ValueError, match="never stored"):
        fresh = RadixCache(BIG, BIG)
        fresh.gather(fresh.lock([1]))


def test_prefix_hashes_agree_with_hash_prefix() -> None:
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert prefix_hashes(ids, [8, 0, 3]) == {end: hash_prefix(ids[:end]) for end in (0, 3, 8)}
    assert len(hash_prefix(ids)) == 16 and hash_prefix(ids) != hash_prefix(ids[:-1])


# --- eviction ---------------------------------------------------------------------------------

def test_eviction_takes_the_least_recently_used_leaf() -> None:
    cache = RadixCache(capacity_tokens=12, capacity_bytes=BIG)
    a, b, c, d = [1] * 4, [2] * 4, [3] * 4, [4] * 4
    for ids in (a, b, c):
        cache.insert(ids, kv_for(ids))
    cache.match(a)  # a is now the most recent; b is the oldest
    assert cache.insert(d, kv_for(d)) == 4
    assert [cache.match(x) for x in (a, b, c, d)] == [4, 0, 4, 4]
    assert (cache.evictions, cache.evicted_tokens) == (1, 4)
    cache.check_invariants()


def test_byte_capacity_is_respected_as_well_as_tokens() -> None:
    cache = RadixCache(capacity_tokens=100, capacity_bytes=10 * BYTES_PER_TOKEN)
    cache.insert([1] * 6, kv_for([1] * 6))
    assert cache.insert([2] * 6, kv_for([2] * 6)) == 6
    assert cache.match([1] * 6) == 0 and cache.kv_bytes == 6 * BYTES_PER_TOKEN
    cache.check_invariants()


def test_evicting_a_leaf_exposes_its_parent() -> None:
    cache = RadixCache(BIG, BIG)
    for ids in ([1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 6]):
        cache.insert(ids, kv_for(ids))
    assert cache.evict(tokens=BIG) == 6
    assert cache.tokens == 0 and cache.kv_bytes == 0 and cache.evictions == 3
    cache.check_invariants()


def test_locked_path_is_never_evicted_and_insert_stores_only_what_fits() -> None:
    cache = RadixCache(capacity_tokens=10, capacity_bytes=BIG)
    a, b = [1] * 8, [2] * 5
    cache.insert(a, kv_for(a))
    with cache.lock(a) as handle:
        assert cache.evict(tokens=BIG) == 0
        assert cache.insert(b, kv_for(b)) == 2, "only two tokens fit beside the locked eight"
        assert cache.match(b) == 2 and cache.match(a) == 8 and cache.tokens == 10
        assert cache.insert([3] * 4, kv_for([3] * 4)) == 2, "the unlocked [2, 2] was evicted for it"
        assert torch.equal(cache.gather(handle), kv_for(a))
        cache.check_invariants()
    assert cache.insert(b, kv_for(b)) == 5, "after release the old path is evictable"
    assert cache.match(b) == 5 and cache.tokens <= 10
    cache.check_invariants()


def test_insert_into_a_cache_that_is_all_locked_stores_nothing() -> None:
    cache = RadixCache(capacity_tokens=6, capacity_bytes=6 * BYTES_PER_TOKEN)
    cache.insert([1] * 6, kv_for([1] * 6))
    with cache.lock([1] * 6):
        assert cache.insert([2] * 3, kv_for([2] * 3)) == 0
        assert cache.tokens == 6
    cache.check_invariants()


def test_insert_never_evicts_the_prefix_it_extends() -> None:
    cache = RadixCache(capacity_tokens=8, capacity_bytes=BIG)
    ids = list(range(10))
    cache.insert(ids[:6], kv_for(ids[:6]))
    assert cache.insert(ids, kv_for(ids)) == 2
    assert cache.match(ids) == 8
    assert torch.equal(gathered(cache, ids)[1], kv_for(ids[:8]))
    cache.check_invariants()


def test_zero_capacity_stores_nothing() -> None:
    cache = RadixCache(capacity_tokens=0, capacity_bytes=BIG)
    assert cache.insert([1, 2], kv_for([1, 2])) == 0 and cache.match([1, 2]) == 0
    cache.check_invariants()


# --- locks --------------------------------------------------------------------------------------

def test_release_is_idempotent_and_the_context_manager_releases() -> None:
    cache = RadixCache(BIG, BIG)
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    cache.insert([1, 2, 4], kv_for([1, 2, 4]))
    first = cache.lock([1, 2, 3])
    second = cache.lock([1, 2, 4])
    assert cache.locked_nodes == 3
    first.release()
    first.release()
    assert cache.locked_nodes == 2, "a second release must not unlock the shared [1, 2] twice"
    second.release()
    assert cache.locked_nodes == 0
    with pytest.raises(KeyError):
        with cache.lock([1, 2, 3]):
            assert cache.locked_nodes == 2
            raise KeyError("the request failed")
    assert cache.locked_nodes == 0
    cache.check_invariants()


def test_handle_stays_valid_across_splits_of_its_nodes() -> None:
    log = EventLog()
    cache = RadixCache(BIG, BIG, listener=log)
    ids = list(range(1, 11))
    cache.insert(ids, kv_for(ids))
    whole = cache.lock(ids)  # one node [0, 10), ref 1
    assert cache.locked_nodes == 1
    inner = cache.lock(ids[:4] + [99])  # splits it at 4: both halves are on `whole`'s path
    assert cache.locked_nodes == 2
    assert cache.insert(ids[:7] + [50, 51], kv_for(ids[:7] + [50, 51])) == 2  # splits [4, 10) at 7
    assert sorted((e.start, e.end) for e in cache.snapshot()) == [(0, 4), (4, 7), (7, 9), (7, 10)]
    assert cache.locked_nodes == 3
    cache.check_invariants()
    assert cache.evict(tokens=BIG) == 2, "only the unlocked new branch can go"
    assert torch.equal(cache.gather(whole), kv_for(ids))
    whole.release()
    assert cache.locked_nodes == 1, "the split-off upper half keeps the inner lock"
    assert torch.equal(cache.gather(inner), kv_for(ids[:4]))
    inner.release()
    assert cache.locked_nodes == 0
    cache.check_invariants()
    assert cache.evict(tokens=BIG) == 10 and cache.tokens == 0
    assert log.matches(cache) and not log.held


def test_random_lock_release_storm_frees_every_lock_exactly_once() -> None:
    rng = random.Random(1234)
    log = EventLog()
    cache = RadixCache(capacity_tokens=60, capacity_bytes=50 * BYTES_PER_TOKEN, listener=log)
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(1, 12))] for _ in range(8)]
    handles: list[tuple[PrefixHandle, list[int]]] = []
    stored = 0

    def random_ids() -> list[int]:
        return rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(0, 14))]

    for _ in range(4000):
        op = rng.random()
        if op < 0.3:
            ids = random_ids()
            stored += cache.insert(ids, kv_for(ids))
        elif op < 0.55:
            ids = random_ids()
            handles.append((cache.lock(ids), ids))
        elif op < 0.8 and handles:
            handle, ids = handles.pop(rng.randrange(len(handles)))
            assert torch.equal(cache.gather(handle), kv_for(ids[:handle.length]))
            handle.release()
            if rng.random() < 0.3:
                handle.release()
        elif op < 0.9:
            cache.match(random_ids())
        else:
            cache.evict(tokens=rng.randrange(20), kv_bytes=rng.randrange(20 * BYTES_PER_TOKEN))
        cache.check_invariants()
    assert stored > 0 and cache.evictions > 0
    for handle, _ in handles:
        handle.release()
    assert cache.locked_nodes == 0
    cache.check_invariants()
    assert cache.kv_bytes <= 50 * BYTES_PER_TOKEN and cache.tokens <= 60
    assert log.matches(cache)
    assert stored == cache.tokens + cache.evicted_tokens
    assert sum(e.tokens if e.kind == "stored" else -e.tokens for e in log.events) == cache.tokens


class LockMachine(RuleBasedStateMachine):
    """Hypothesis drives inserts, locks, releases (some twice) and evictions on a small cache."""

    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.log = EventLog()
        self.cache = RadixCache(capacity_tokens=24, capacity_bytes=20 * BYTES_PER_TOKEN, listener=self.log)
        self.open: list[PrefixHandle] = []

    @rule(ids=st.lists(st.integers(0, 3), max_size=10))
    def insert(self, ids: list[int]) -> None:
        self.cache.insert(ids, kv_for(ids))

    @rule(target=handles, ids=st.lists(st.integers(0, 3), max_size=10))
    def lock(self, ids: list[int]) -> tuple[PrefixHandle, list[int]]:
        handle = self.cache.lock(ids)
        self.open.append(handle)
        return handle, ids

    @rule(entry=consumes(handles), twice=st.booleans())
    def release(self, entry: tuple[PrefixHandle, list[int]], twice: bool) -> None:
        handle, ids = entry
        if handle.length:
            assert torch.equal(self.cache.gather(handle), kv_for(ids[:handle.length]))
        handle.release()
        if twice:
            handle.release()
        self.open.remove(handle)

    @rule(tokens=st.integers(0, 30))
    def evict(self, tokens: int) -> None:
        self.cache.evict(tokens=tokens)

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        assert self.log.matches(self.cache)
        assert (self.cache.locked_nodes == 0) == (not any(h.length for h in self.open))

    def teardown(self) -> None:
        for handle in self.open:
            handle.release()
        assert self.cache.locked_nodes == 0
        self.cache.check_invariants()


TestLockMachine = LockMachine.TestCase
TestLockMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# --- events -------------------------------------------------------------------------------------

def test_events_name_each_node_by_the_hash_of_its_whole_prefix() -> None:
    log = EventLog()
    cache = RadixCache(capacity_tokens=12, capacity_bytes=BIG, listener=log)
    ids = list(range(1, 11))
    cache.insert(ids, kv_for(ids))
    assert log.events == [CacheEvent("stored", hash_prefix(ids), 0, 10, 10)]
    cache.lock(ids[:4]).release()
    assert log.events[-1] == CacheEvent("stored", hash_prefix(ids[:4]), 0, 4, 0), "a split adds a node end, no KV"
    other = [7, 7, 7, 7, 7]
    cache.insert(other, kv_for(other))  # needs 3 more tokens: evicts the LRU leaf [4, 10)
    assert log.events[-2:] == [CacheEvent("evicted", hash_prefix(ids), 4, 10, 6),
                               CacheEvent("stored", hash_prefix(other), 0, 5, 5)]
    assert log.held == {(hash_prefix(ids[:4]), 4), (hash_prefix(other), 5)}
    assert log.matches(cache)
