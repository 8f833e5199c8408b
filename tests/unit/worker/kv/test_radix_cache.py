"""SWARadixCache scenarios with exact slot ids, sizes and eviction counts."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import sys
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from swaserve.proto.kv_events import KVRevived
from swaserve.worker.kv import SWAFreeState, SWATokenAllocator, free_swa_out_of_window_slots
from swaserve.worker.kv.radix_cache import PureSWARadixCache, SWARadixCache
from swaserve.worker.kv.radix_node import PrefixLock, RadixCacheCorrupted, RadixNode

ROOT = Path(__file__).resolve().parents[4]


def make(
    full: int = 128, swa: int = 64, window: int = 4, page_size: int = 1, pure: bool = False
) -> tuple[SWATokenAllocator, SWARadixCache]:
    allocator = SWATokenAllocator(full, swa, page_size=page_size)
    cls = PureSWARadixCache if pure else SWARadixCache
    return allocator, cls(allocator, sliding_window_size=window, page_size=page_size)


def checked(allocator: SWATokenAllocator, cache: SWARadixCache, *held: torch.Tensor) -> None:
    """Both integrity checks; `held`: slots the test itself still owns."""
    cache.check()
    allocator.check(owned=torch.cat([cache.cached_indices(), *held]))


def sizes(cache: SWARadixCache) -> tuple[int, int, int, int]:
    return (
        cache.full_evictable_size(),
        cache.full_protected_size(),
        cache.swa_evictable_size(),
        cache.swa_protected_size(),
    )


def node_at(cache: SWARadixCache, *first_tokens: int) -> RadixNode:
    node = cache.root
    for token in first_tokens:
        node = node.children[token]
    return node


def insert_fresh(
    allocator: SWATokenAllocator, cache: SWARadixCache, key: list[int], swa_evicted: int = 0
) -> int:
    """Insert `key` with new slots, of which `[0, swa_evicted)` already lost their SWA KV; the
    slots of a trailing partial page go back, as a finished request's would."""
    p = allocator.page_size
    value = allocator.alloc(-(-len(key) // p) * p)
    assert value is not None
    allocator.free_swa(value[:swa_evicted])
    cached = cache.insert(key, value[: len(key)], swa_evicted_seqlen=swa_evicted)
    allocator.free(value[len(key) // p * p :])
    return cached


# ---- the reference scenario (SGLang's test_swa_radix_cache_1) ---------------------------------


def test_reference_scenario() -> None:
    allocator, cache = make()
    keys = [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [10, 11, 12], [1, 2, 3, 4, 5, 60, 70]]
    assert [cache.insert(k, allocator.alloc(len(k))) for k in keys] == [0, 3, 0, 5]
    # Slots 4..6 and 14..18 were duplicates and went back; the tree holds 12 tokens.
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (116, 52)
    checked(allocator, cache)

    assert cache.evict(1, 0) == (3, 3)  # LRU leaf [10, 11, 12]
    # [1, 2, 3] [4, 5] are the window checkpoint of the branch point after 5 (C = W + P = 5):
    # SWA eviction takes every other live node first.
    assert [node_at(cache, 1).checkpoint, node_at(cache, 1, 4).checkpoint] == [True, True]
    assert not node_at(cache, 1, 4, 6).checkpoint
    assert cache.evict(0, 1) == (2, 2)  # the LRU leaf [6, 7] goes whole
    assert cache.match_prefix([1, 2, 3, 4, 5, 60, 70]).indices.numel() == 7
    assert cache.evict(0, 3) == (2, 5)  # leaf [60, 70], then the LRU checkpoint [1, 2, 3]
    assert node_at(cache, 1).tombstone and node_at(cache, 1).key == [1, 2, 3]
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (123, 62)
    checked(allocator, cache)

    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.numel() == 0  # 2 live tokens < W
    result = cache.match_prefix([1, 2, 3, 4, 5, 6], allow_repair=False)
    assert result.indices.numel() == 0 and result.repair_len == 0
    assert cache.total_size() == (5, 2)
    checked(allocator, cache)


# ---- locks ------------------------------------------------------------------------------------


def test_lock_lifecycle_with_early_swa_release() -> None:
    allocator, cache = make()
    insert_fresh(allocator, cache, list(range(1, 9)))
    leaf = cache.match_prefix(list(range(1, 9))).last_node
    handle = cache.inc_lock_ref(leaf)
    assert sizes(cache) == (0, 8, 0, 8)
    assert cache.evict(100, 100) == (0, 0)

    cache.dec_swa_lock_only(leaf, handle)
    # The last C = W + P = 5 tokens stay live as a window checkpoint; the interior goes.
    assert [(n.key, n.tombstone, n.checkpoint) for n in cache._nodes()] == [
        ([1, 2, 3], True, False),
        ([4, 5, 6, 7, 8], False, True),
    ]
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (120, 59)
    assert sizes(cache) == (0, 8, 5, 0)
    checked(allocator, cache)

    cache.dec_lock_ref(leaf, handle, skip_swa=True)
    assert sizes(cache) == (8, 0, 5, 0)
    # The checkpoint keeps both resume points valid: the end and one page before it.
    assert cache.match_prefix(list(range(1, 9))).indices.numel() == 8
    assert cache.match_prefix(list(range(1, 8))).indices.numel() == 7
    assert cache.match_prefix(list(range(1, 7))).indices.numel() == 0  # 3 live tokens < W
    checked(allocator, cache)
    # The matches split the checkpoint; its leaves go, then the tombstone parent with them.
    assert cache.evict(0, 100) == (8, 5)
    assert cache.total_size() == (0, 0) and allocator.full_available_size() == 128
    checked(allocator, cache)


@pytest.mark.parametrize(("window", "swa_protected"), [(4, 4), (5, 6), (11, 10)])
def test_swa_lock_stops_once_the_window_is_covered(window: int, swa_protected: int) -> None:
    allocator, cache = make(window=window)
    for n in (4, 6, 10):  # nodes [1..4] [5, 6] [7..10]
        insert_fresh(allocator, cache, list(range(1, n + 1)))
    leaf = cache.match_prefix(list(range(1, 11))).last_node
    handle = cache.inc_lock_ref(leaf)
    assert sizes(cache) == (0, 10, 10 - swa_protected, swa_protected)
    # SWA eviction can only tombstone what the lock leaves out; the match survives it.
    assert cache.evict(0, 100) == (0, 10 - swa_protected)
    assert cache.match_prefix(list(range(1, 11))).indices.numel() == 10
    cache.dec_lock_ref(leaf, handle)
    assert sizes(cache) == (10, 0, swa_protected, 0)
    checked(allocator, cache)


def test_split_moves_the_top_of_an_swa_lock_up() -> None:
    allocator, cache = make(window=5)
    for n in (4, 6, 10):  # nodes [1..4] [5, 6] [7..10]
        insert_fresh(allocator, cache, list(range(1, n + 1)))
    leaf = cache.match_prefix(list(range(1, 11))).last_node
    handle = cache.inc_lock_ref(leaf)  # SWA lock covers [7..10] and [5, 6]
    cache.match_prefix([1, 2, 3, 4, 5])  # splits [5, 6] into [5] and [6]
    assert node_at(cache, 1, 5).key == [5] and node_at(cache, 1, 5).swa_lock == 1
    cache.dec_lock_ref(leaf, handle)
    assert sizes(cache) == (10, 0, 10, 0)
    checked(allocator, cache)


def test_dec_lock_ref_of_an_unlocked_node_raises() -> None:
    allocator, cache = make()
    insert_fresh(allocator, cache, [1, 2])
    leaf = node_at(cache, 1)
    handle = cache.inc_lock_ref(leaf)
    cache.dec_lock_ref(leaf, handle)
    with pytest.raises(ValueError, match="not held"):
        cache.dec_lock_ref(leaf, handle)


# ---- insert -----------------------------------------------------------------------------------


def test_insert_frees_duplicates_only_past_prev_prefix_len() -> None:
    allocator, cache = make()
    insert_fresh(allocator, cache, [1, 2, 3, 4])  # slots 1..4
    match = cache.match_prefix([1, 2, 3, 4, 5, 6])
    handle = cache.inc_lock_ref(match.last_node)
    own = allocator.alloc(2)  # slots 5, 6 for tokens 5, 6
    value = torch.cat((match.indices, own))
    assert cache.insert([1, 2, 3, 4, 5, 6], value, prev_prefix_len=4) == 4
    cache.dec_lock_ref(match.last_node, handle)
    assert allocator.full_available_size() == 122 and cache.total_size() == (6, 6)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == [1, 2, 3, 4, 5, 6]
    checked(allocator, cache)


def test_insert_with_swa_evicted_prefix_makes_a_tombstone_then_a_live_leaf() -> None:
    allocator, cache = make()
    assert insert_fresh(allocator, cache, list(range(1, 9)), swa_evicted=4) == 0
    assert node_at(cache, 1).tombstone and node_at(cache, 1).key == [1, 2, 3, 4]
    assert not node_at(cache, 1, 5).tombstone
    assert cache.total_size() == (8, 4) and allocator.swa_available_size() == 60
    assert cache.match_prefix(list(range(1, 9))).indices.tolist() == list(range(1, 9))
    assert cache.match_prefix(list(range(1, 8))).indices.numel() == 0  # 3 live < W = 4
    checked(allocator, cache)


def test_insert_whose_new_part_has_no_swa_left_caches_nothing() -> None:
    allocator, cache = make()
    assert insert_fresh(allocator, cache, [1, 2, 3, 4], swa_evicted=4) == 0
    assert cache.total_size() == (0, 0) and allocator.full_available_size() == 128
    checked(allocator, cache)


@pytest.mark.parametrize(
    ("swa_evicted", "tombstone_keys", "swa_cached"),
    [
        (0, [], 8),  # whole tombstone revived; its old slots 1..4 go back
        (2, [[1, 2]], 6),  # only [3, 4] has SWA: split, revive the suffix
        (4, [[1, 2, 3, 4]], 4),  # no SWA there: tombstone stays, incoming slots freed
    ],
)
def test_insert_over_a_tombstone_revives_what_has_swa(
    swa_evicted: int, tombstone_keys: list[list[int]], swa_cached: int
) -> None:
    allocator, cache = make()
    insert_fresh(allocator, cache, list(range(1, 9)), swa_evicted=4)  # slots 1..8
    cache.take_events()
    assert insert_fresh(allocator, cache, list(range(1, 9)), swa_evicted=swa_evicted) == 8
    tombstones = [n.key for n in cache._nodes() if n.tombstone]
    assert tombstones == tombstone_keys
    assert cache.total_size() == (8, swa_cached)  # every other slot went back
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (
        120,
        64 - swa_cached,
    )
    revived = [e for e in cache.take_events() if isinstance(e, KVRevived)]
    assert len(revived) == (1 if swa_evicted < 4 else 0)
    assert cache.match_prefix(list(range(1, 9))).indices.numel() == 8
    checked(allocator, cache)


def test_insert_over_a_locked_tombstone_keeps_its_full_slots_and_adopts_swa() -> None:
    allocator, cache = make()
    insert_fresh(allocator, cache, list(range(1, 9)), swa_evicted=4)  # tombstone slots 1..4
    leaf = cache.match_prefix(list(range(1, 9))).last_node
    handle = cache.inc_lock_ref(leaf)  # full lock runs through the tombstone
    value = allocator.alloc(8)  # slots 9..16, SWA slots 5..12
    assert cache.insert(list(range(1, 9)), value) == 8
    tomb = node_at(cache, 1)
    assert not tomb.tombstone and tomb.value.tolist() == [1, 2, 3, 4]  # the request reads these
    assert allocator.translate(tomb.value).tolist() == [9, 10, 11, 12]  # the incoming SWA
    assert allocator.full_available_size() == 120 and allocator.swa_available_size() == 56
    cache.dec_lock_ref(leaf, handle)
    checked(allocator, cache)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prev_prefix_len": 3}, "prev_prefix_len=3"),
        ({"swa_evicted_seqlen": -4}, "swa_evicted_seqlen=-4"),
    ],
)
def test_insert_rejects_unaligned_lengths(kwargs: dict[str, int], message: str) -> None:
    allocator, cache = make(page_size=4)
    with pytest.raises(ValueError, match=message):
        cache.insert(list(range(8)), allocator.alloc(8), **kwargs)


@pytest.mark.parametrize(("window", "matched"), [(1, 7), (2, 4), (3, 0)])
def test_match_falls_back_to_the_last_end_with_a_full_window(window: int, matched: int) -> None:
    allocator, cache = make(window=window)
    insert_fresh(allocator, cache, [1, 2, 3, 4], swa_evicted=2)  # [1, 2] T, [3, 4]
    insert_fresh(allocator, cache, list(range(1, 8)), swa_evicted=6)  # then [5, 6] T, [7]
    result = cache.match_prefix(list(range(1, 8)))
    assert result.indices.tolist() == [1, 2, 3, 4, 9, 10, 11][:matched]
    assert result.last_node.key == {7: [7], 4: [3, 4], 0: []}[matched]
    checked(allocator, cache)


# ---- eviction order ---------------------------------------------------------------------------


def test_full_eviction_takes_lru_leaves_and_the_tombstone_parents_they_leave() -> None:
    allocator, cache = make()
    insert_fresh(allocator, cache, [1, 2, 3, 4, 5, 6], swa_evicted=4)  # [1..4] T, [5, 6]
    insert_fresh(allocator, cache, [7, 8])
    insert_fresh(allocator, cache, [9, 10])
    cache.match_prefix([7, 8])  # [9, 10] is now the LRU leaf after [5, 6]
    assert cache.evict(1) == (6, 2)  # [5, 6] and its tombstone parent [1..4]
    assert cache.evict(1) == (2, 2)  # [9, 10]
    assert [n.key for n in cache._nodes()] == [[7, 8]]
    checked(allocator, cache)


def test_swa_eviction_tombstones_ancestors_before_children() -> None:
    allocator, cache = make()
    for n in (4, 8, 12):  # a chain [1..4] [5..8] [9..12]
        insert_fresh(allocator, cache, list(range(1, n + 1)))
    assert cache.evict(0, 1) == (0, 4)
    assert [n.tombstone for n in cache._nodes()] == [True, False, False]
    # [5..8] is tombstoned (4 < 5), then the leaf [9..12] goes with both tombstones above it.
    assert cache.evict(0, 5) == (12, 8)
    assert cache.total_size() == (0, 0)
    checked(allocator, cache)


# ---- pages ------------------------------------------------------------------------------------


def pages_of(page_size: int, *symbols: int) -> list[int]:
    return [100 * s + j for s in symbols for j in range(page_size)]


@pytest.mark.parametrize("page_size", [2, 4, 8])
@pytest.mark.parametrize("window_kind", ["below", "just_above", "two_pages_above"])
def test_pages(page_size: int, window_kind: str) -> None:
    p = page_size
    window = {"below": max(1, p // 2), "just_above": p + 1, "two_pages_above": 3 * p}[window_kind]
    allocator, cache = make(64 * p, 32 * p, window=window, page_size=p)
    a, b, c = pages_of(p, 1, 2, 3, 4), pages_of(p, 1, 2, 3, 4, 5, 6), pages_of(p, 1, 2, 7, 8)
    assert insert_fresh(allocator, cache, [*a, 9]) == 0  # the partial page is not cached
    assert insert_fresh(allocator, cache, b) == 4 * p
    assert insert_fresh(allocator, cache, c) == 2 * p
    assert cache.total_size() == (8 * p, 8 * p)
    assert cache.match_prefix([*c, 9]).indices.numel() == 4 * p  # cut to whole pages
    checked(allocator, cache)

    # [1, 2] ends at the branch point: it is a window checkpoint (C = ceil_P(W) + P >= 2P).
    assert cache.root.children[tuple(c[:p])].checkpoint
    # LRU order of the other live nodes (oldest first): [5, 6] leaf, [3, 4], [7, 8].
    assert cache.evict(0, 1) == (2 * p, 2 * p)  # the leaf [5, 6] goes whole
    assert cache.evict(0, 1) == (2 * p, 2 * p)  # so does [3, 4], a leaf now
    assert cache.evict(0, 1) == (2 * p, 2 * p)  # and [7, 8]; the checkpoint is taken last
    assert cache.match_prefix([*c, 9]).indices.numel() == 2 * p
    assert cache.evict(10**6, 10**6) == (2 * p, 2 * p)
    checked(allocator, cache)

    # Pages [1, 2] lost their SWA KV, [3, 4] keep it: an end needs W <= 2P (or 1P after one page).
    assert insert_fresh(allocator, cache, a, swa_evicted=2 * p) == 0
    assert [n.tombstone for n in cache._nodes()] == [True, False]
    assert cache.match_prefix(a).indices.numel() == (4 * p if window <= 2 * p else 0)
    assert cache.match_prefix(a[: 3 * p]).indices.numel() == (3 * p if window <= p else 0)
    checked(allocator, cache)

    leaf = cache._walk(a)[0][-1]  # [4]: the match above split [3, 4]
    handle = cache.inc_lock_ref(leaf)
    # The SWA lock covers [4], then [3] while W is not covered; the tombstone stops it.
    assert cache.swa_protected_size() == (p if window <= p else 2 * p)
    cache.dec_lock_ref(leaf, handle)
    assert cache.evict(10**6, 10**6) == (4 * p, 2 * p)
    assert allocator.full_available_size() == 64 * p and allocator.swa_available_size() == 32 * p
    checked(allocator, cache)


# ---- request helpers --------------------------------------------------------------------------


def start_request(
    allocator: SWATokenAllocator, cache: SWARadixCache, tokens: list[int]
) -> tuple[torch.Tensor, PrefixLock, SWAFreeState]:
    """Match, lock, and give the rest of `tokens` new slots (whole pages)."""
    match = cache.match_prefix(tokens)
    lock = PrefixLock(match.last_node, cache.inc_lock_ref(match.last_node))
    p = allocator.page_size
    m = match.indices.numel()
    own = allocator.alloc(-(-(len(tokens) - m) // p) * p)
    assert own is not None
    kv = torch.cat((match.indices, own[: len(tokens) - m]))
    return kv, lock, SWAFreeState(cache_protected_len=m)


def test_finished_request_caches_its_pages_and_frees_the_tail() -> None:
    allocator, cache = make(64, 64, window=4, page_size=4)
    tokens = list(range(1, 11))
    kv, lock, state = start_request(allocator, cache, tokens)  # slots 4..15
    freed = free_swa_out_of_window_slots(
        allocator, state, kv, len(tokens), sliding_window_size=4, radix_cache=True
    )
    assert freed == 4 and state.swa_evicted_seqlen == 4  # floor_4(10 - 4)
    cache.cache_finished_request(tokens, kv, lock, state)
    assert [(n.key, n.tombstone) for n in cache._nodes()] == [
        ([1, 2, 3, 4], True),
        ([5, 6, 7, 8], False),
    ]
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (56, 60)
    assert sizes(cache) == (8, 0, 4, 0)
    checked(allocator, cache)


def test_unfinished_request_swaps_in_tree_slots_and_moves_its_lock() -> None:
    allocator, cache = make(64, 64, window=2, page_size=2)
    insert_fresh(allocator, cache, [1, 2, 3, 4])  # slots 2..5, owned by the tree
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    lock, state = PrefixLock(cache.root, cache.inc_lock_ref(cache.root)), SWAFreeState()
    kv = allocator.alloc(6)[:5]  # the first chunk, computed from scratch: slots 6..10
    new_kv, lock = cache.cache_unfinished_request(tokens[:5], kv, lock, state)
    assert new_kv.tolist() == [2, 3, 4, 5, 10]  # tree slots for the 4 cached tokens
    assert state.cache_protected_len == 4 and lock.node.key == [1, 2, 3, 4]
    assert sizes(cache) == (0, 4, 0, 4)
    checked(allocator, cache, new_kv[4:])

    rest = allocator.alloc(4)  # second chunk: token 5 continues slot 10's page
    kv = torch.cat((new_kv, torch.tensor([11]), rest[:3]))  # tokens 6..9
    cache.cache_finished_request(tokens, kv, lock, state)
    assert cache.total_size() == (8, 8) and sizes(cache)[1::2] == (0, 0)
    assert cache.match_prefix(tokens).indices.tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    checked(allocator, cache)


def test_released_swa_lock_then_finish() -> None:
    allocator, cache = make()
    insert_fresh(allocator, cache, list(range(1, 9)))
    tokens = list(range(1, 13))
    kv, lock, state = start_request(allocator, cache, tokens)
    cache.release_request_swa(lock)
    cache.release_request_swa(lock)  # once only
    # The locked leaf lost the SWA KV of its interior; its last C = 5 tokens are a checkpoint.
    assert lock.swa_released and node_at(cache, 1).tombstone
    cache.cache_finished_request(tokens, kv, lock, state)
    assert [(n.key, n.tombstone, n.checkpoint) for n in cache._nodes()] == [
        ([1, 2, 3], True, False),
        ([4, 5, 6, 7, 8], False, True),
        ([9, 10, 11, 12], False, True),  # the window before the sequence's end
    ]
    assert sizes(cache) == (12, 0, 9, 0)
    checked(allocator, cache)


# ---- pure SWA ---------------------------------------------------------------------------------


def test_pure_swa_tombstones_give_their_full_slots_back() -> None:
    allocator, cache = make(pure=True)
    insert_fresh(allocator, cache, list(range(1, 9)), swa_evicted=4)
    assert node_at(cache, 1).hollow and cache.total_size() == (4, 4)
    assert allocator.full_available_size() == 124
    assert cache.match_prefix(list(range(1, 9))).indices.tolist() == [0, 0, 0, 0, 5, 6, 7, 8]
    checked(allocator, cache)

    insert_fresh(allocator, cache, list(range(1, 13)))  # slots 9..20: [1..4] revived with 9..12
    assert not node_at(cache, 1).hollow and cache.total_size() == (12, 12)
    leaf = cache.match_prefix(list(range(1, 13))).last_node
    handle = cache.inc_lock_ref(leaf)
    assert cache.evict(0, 100) == (0, 8)  # tombstones under a full lock keep their slots
    assert cache.full_protected_size() == 12
    cache.dec_lock_ref(leaf, handle)  # ... until the lock goes
    assert cache.total_size() == (4, 4) and allocator.full_available_size() == 124
    assert cache.evict(0, 100) == (4, 4)
    assert allocator.full_available_size() == 128 and allocator.swa_available_size() == 64
    checked(allocator, cache)


# ---- reset and check --------------------------------------------------------------------------


def test_reset_gives_everything_back() -> None:
    allocator, cache = make()
    insert_fresh(allocator, cache, [1, 2, 3, 4, 5, 6], swa_evicted=2)
    leaf = node_at(cache, 1, 3)
    handle = cache.inc_lock_ref(leaf)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(leaf, handle)
    cache.reset()
    assert cache.total_size() == (0, 0) and allocator.full_available_size() == 128
    checked(allocator, cache)


def _tree(allocator: SWATokenAllocator, cache: SWARadixCache) -> None:
    insert_fresh(allocator, cache, [1, 2, 3, 4, 5, 6], swa_evicted=2)  # [1, 2] T, [3..6]
    insert_fresh(allocator, cache, [1, 2, 7, 8])


CORRUPTIONS: dict[str, tuple[Callable[[SWATokenAllocator, SWARadixCache], object], str]] = {
    "size counter": (lambda a, c: setattr(c, "_full_evictable", 7), "size counters"),
    "tombstone leaf": (lambda a, c: setattr(node_at(c, 1, 7), "tombstone", True), "tombstone leaf"),
    "lru": (lambda a, c: c._full_lru.pop(node_at(c, 1, 7)), "LRU membership"),
    "child key": (lambda a, c: node_at(c, 1, 7).key.__setitem__(0, 9), "child key"),
    "lock counts": (lambda a, c: setattr(node_at(c, 1, 3), "swa_lock", 1), "swa_lock <= full_lock"),
    "parent lock": (lambda a, c: setattr(node_at(c, 1, 3), "full_lock", 1), "sum of its children"),
    "freed slot": (lambda a, c: a.full.free(node_at(c, 1, 7).value), "allocator has free"),
    "lost swa": (lambda a, c: a.free_swa(node_at(c, 1, 7).value), "without SWA slot"),
    "two owners": (lambda a, c: setattr(node_at(c, 1, 7), "value", node_at(c, 1, 3).value[:2]), "two tree"),
    "page hash": (lambda a, c: node_at(c, 1, 7).page_hashes.reverse(), "page hashes"),
    "parent pointer": (lambda a, c: setattr(node_at(c, 1, 7), "parent", c.root), "parent pointer"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_check_fails_on_a_corrupted_tree(name: str) -> None:
    allocator, cache = make()
    _tree(allocator, cache)
    checked(allocator, cache)
    corrupt, message = CORRUPTIONS[name]
    corrupt(allocator, cache)
    with pytest.raises(RadixCacheCorrupted, match=re.escape(message)):
        cache.check()


# ---- benchmark ----------------------------------------------------------------------------------


def test_bench_quick_runs_and_reports_json(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("radix_ops", ROOT / "bench" / "radix_ops.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "radix_ops", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = io.StringIO()
    with redirect_stdout(out):
        bench.main(["--quick", "--json"])
    report = json.loads(out.getvalue().strip().splitlines()[-1])
    assert set(report["scales"]) == {"100", "1000"}
    assert all(report["scales"][s]["insert_ops_s"] > 0 for s in report["scales"])


# ---- window checkpoints and window repair -----------------------------------------------------


def test_a_match_without_a_live_window_is_repaired_where_that_saves_more() -> None:
    allocator = SWATokenAllocator(128, 64)
    cache = SWARadixCache(allocator, sliding_window_size=4, window_repair_tokens=8)
    key = list(range(1, 21))
    insert_fresh(allocator, cache, key, swa_evicted=18)  # [1..18] tombstone, [19, 20] live
    plain = cache.match_prefix(key)
    assert (plain.indices.numel(), plain.repair_len) == (0, 0)  # 2 live tokens < W
    repaired = cache.match_prefix(key, allow_repair=True)
    assert (repaired.indices.numel(), repaired.repair_len, repaired.saved_tokens) == (20, 8, 12)
    assert repaired.last_node.key == [19, 20]
    assert cache.match_prefix(key[:10], allow_repair=True).saved_tokens == 2  # 10 - 8
    # A live window wins over a repair that saves less.
    insert_fresh(allocator, cache, [*key, 21, 22, 23, 24], swa_evicted=20)
    full = cache.match_prefix([*key, 21, 22, 23, 24], allow_repair=True)
    assert (full.indices.numel(), full.repair_len) == (24, 0)
    assert cache.match_prefix([*key, 21], allow_repair=True).saved_tokens == 13  # 3 live < W
    checked(allocator, cache)
    with pytest.raises(ValueError, match="window_repair_tokens"):
        SWARadixCache(SWATokenAllocator(16, 16, page_size=4), 4, 4, window_repair_tokens=6)


def test_the_pure_swa_cache_never_repairs() -> None:
    allocator = SWATokenAllocator(128, 64)
    cache = PureSWARadixCache(allocator, sliding_window_size=4, window_repair_tokens=8)
    insert_fresh(allocator, cache, list(range(1, 21)), swa_evicted=18)
    # Its tombstones have no full KV to read the prefix from.
    assert cache.window_repair_tokens == 0
    assert cache.match_prefix(list(range(1, 21)), allow_repair=True).repair_len == 0
    checked(allocator, cache)


def test_checkpoints_are_evicted_last_and_lru_among_themselves() -> None:
    allocator, cache = make()
    for stem in (10, 20):  # two prompts whose decodes left their windows: two checkpoints
        tokens = [stem + i for i in range(8)]
        insert_fresh(allocator, cache, tokens)
        leaf = cache.match_prefix(tokens).last_node
        handle = cache.inc_lock_ref(leaf)
        cache.dec_swa_lock_only(leaf, handle)
        cache.dec_lock_ref(leaf, handle, skip_swa=True)
    insert_fresh(allocator, cache, [30, 31, 32])  # a plain live leaf, the newest node
    assert [(n.key[0], n.tombstone, n.checkpoint) for n in cache._nodes()] == [
        (30, False, False),
        (20, True, False),
        (23, False, True),
        (10, True, False),
        (13, False, True),
    ]
    assert sizes(cache) == (19, 0, 13, 0)
    cache.match_prefix(list(range(10, 18)))  # the first checkpoint is now the more recent
    assert cache.evict(0, 1) == (3, 3)  # the plain leaf goes first, though it is the newest
    assert cache.evict(0, 1) == (8, 5)  # then the LRU checkpoint [23..27], with its tombstone
    assert [n.key[0] for n in cache._nodes()] == [10, 13]
    checked(allocator, cache)


# ---- the chunk rule (Llama 4) -----------------------------------------------------------------


def make_chunked(chunk: int = 4, page_size: int = 1, slack: int = 0):
    allocator = SWATokenAllocator(128, 64, page_size=page_size)
    cache = SWARadixCache(
        allocator,
        sliding_window_size=chunk - 1,
        page_size=page_size,
        attention_chunk_size=chunk,
        checkpoint_slack_tokens=slack,
        window_repair_tokens=8,  # ignored: a chunk boundary is always as good as a repair
    )
    return allocator, cache


def test_chunk_rule_matches_to_a_boundary_inside_a_tombstone() -> None:
    allocator, cache = make_chunked(chunk=4)
    insert_fresh(allocator, cache, list(range(1, 11)), swa_evicted=7)  # [tomb 7][live 3]
    assert cache.window_repair_tokens == 0
    # End 10 needs [8, 10) live: yes. End 6 lies in the tombstone: back to the boundary 4,
    # which splits the tombstone there.
    assert cache.match_prefix(list(range(1, 11))).indices.numel() == 10
    match = cache.match_prefix([*range(1, 7), 99], allow_repair=True)
    assert match.indices.numel() == 4 and match.repair_len == 0
    assert match.last_node.key == [1, 2, 3, 4] and match.last_node.tombstone
    checked(allocator, cache)
    # A window of 3 would find no end at all before 8: the boundary is what the chunk buys.
    windowed_allocator, windowed = make(window=3)
    insert_fresh(windowed_allocator, windowed, list(range(1, 11)), swa_evicted=7)
    assert windowed.match_prefix([*range(1, 7), 99]).indices.numel() == 0


def test_chunk_lock_holds_swa_back_to_the_chunk_start_only() -> None:
    allocator, cache = make_chunked(chunk=4)
    for n in (3, 6, 9):  # nodes [1..3] [4..6] [7..9]
        insert_fresh(allocator, cache, list(range(1, n + 1)))
    leaf = cache.match_prefix(list(range(1, 10))).last_node
    handle = cache.inc_lock_ref(leaf)  # end 9 reads [8, 9): the node [7..9] only
    assert sizes(cache) == (0, 9, 6, 3)
    assert cache.evict(0, 100) == (0, 6)  # everything the lock leaves out is tombstoned
    assert cache.match_prefix(list(range(1, 10))).indices.numel() == 9
    cache.dec_lock_ref(leaf, handle)
    checked(allocator, cache)
    # At a boundary nothing is needed: the lock takes no SWA at all.
    boundary_allocator, boundary = make_chunked(chunk=3)
    insert_fresh(boundary_allocator, boundary, list(range(1, 7)))
    node = boundary.match_prefix(list(range(1, 7))).last_node
    held = boundary.inc_lock_ref(node)
    assert not held.holds_swa and boundary.swa_protected_size() == 0
    boundary.dec_lock_ref(node, held)
    boundary.check()


@pytest.mark.parametrize(("slack", "kept"), [(0, [9]), (2, [5, 6, 7, 8, 9])])
def test_a_released_chunk_lock_keeps_what_resumes_near_the_prompt_end_read(
    slack: int, kept: list[int]
) -> None:
    """Prompt [1..9] (positions 0..8) cached, decode moved on: the checkpoint keeps positions
    [floor((9 - S - P) / C)·C, 9) (S = 0: the resumes at 9 and at the boundary 8 read only
    position 8; S = 2: those down to 6 read from 4), the rest of the leaf's run is tombstoned."""
    allocator, cache = make_chunked(chunk=4, slack=slack)
    insert_fresh(allocator, cache, list(range(1, 10)))
    tokens = list(range(1, 14))
    kv, lock, state = start_request(allocator, cache, tokens)
    cache.release_request_swa(lock)
    live = [t for n in cache._nodes() if not n.tombstone for t in n.key if t <= 9]
    assert sorted(live) == kept
    cache.cache_finished_request(tokens, kv, lock, state)
    checked(allocator, cache)


def test_a_chunk_lock_ending_on_a_boundary_still_keeps_a_checkpoint() -> None:
    """Prompt [1..8] (C = 4) ends on a boundary: its lock holds no SWA (the next query reads
    nothing before 8), yet resumes up to S + P before the end read [4, 8); releasing the lock
    keeps them as a checkpoint and tombstones the rest."""
    allocator, cache = make_chunked(chunk=4, slack=2)
    insert_fresh(allocator, cache, list(range(1, 9)))
    tokens = list(range(1, 13))
    kv, lock, state = start_request(allocator, cache, tokens)
    assert not lock.handle.holds_swa and kv.numel() == 12
    cache.release_request_swa(lock)
    assert [(n.key, n.tombstone, n.checkpoint) for n in cache._nodes()] == [
        ([1, 2, 3, 4], True, False),
        ([5, 6, 7, 8], False, True),
    ]
    cache.cache_finished_request(tokens, kv, lock, state)
    checked(allocator, cache)
