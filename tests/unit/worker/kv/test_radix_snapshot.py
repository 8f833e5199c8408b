"""`snapshot_events()`: the whole tree as KV events. Applied to a view (fresh, or holding
anything), they leave the worker's pages exactly as the full event stream so far built them:
same page hashes, same tombstones; other workers' pages stay as they were."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_event_mirror import KVEventMirror

from swaserve.proto.kv_events import KVCleared, KVStored, page_hashes
from swaserve.router.exact_view import ExactCacheView
from swaserve.worker.kv import SWATokenAllocator
from swaserve.worker.kv.radix_cache import PureSWARadixCache, SWARadixCache
from swaserve.worker.kv.radix_node import PrefixLock

ME, OTHER = 0, 1  # view bits


def make(
    page_size: int, window: int, pure: bool = False
) -> tuple[SWATokenAllocator, SWARadixCache]:
    allocator = SWATokenAllocator(32 * page_size, 16 * page_size, page_size=page_size)
    cls = PureSWARadixCache if pure else SWARadixCache
    return allocator, cls(allocator, sliding_window_size=window, page_size=page_size)


def insert(allocator: SWATokenAllocator, cache: SWARadixCache, key: list[int], tomb: int) -> None:
    """Cache `key` (whole pages) with new slots; `[0, tomb)` already lost their SWA KV."""
    p = allocator.page_size
    n = len(key) // p * p
    cache.evict(n - allocator.full_available_size(), n - allocator.swa_available_size())
    value = allocator.alloc(n)
    if value is None:
        return
    tomb = min(tomb // p * p, max(0, n - p))
    allocator.free_swa(value[:tomb])
    cache.insert(key, value, swa_evicted_seqlen=tomb)


def stream_and_snapshot(cache: SWARadixCache, stream: ExactCacheView) -> ExactCacheView:
    """Apply the pending events to `stream`; return a view that saw only a snapshot, on top
    of stale pages of its own and another worker's pages."""
    stream.apply(ME, cache.take_events())
    p = cache.page_size
    stale = list(range(900, 900 + 3 * p))
    fresh = ExactCacheView(p)
    for bit in (ME, OTHER):
        hashes = page_hashes(stale, p)
        fresh.apply(bit, [KVStored(tuple(hashes), None, tuple(stale), p)])
    fresh.apply(ME, cache.snapshot_events())
    return fresh


def test_snapshot_equals_the_event_stream_after_tombstones_removals_and_a_reset() -> None:
    allocator, cache = make(page_size=2, window=4)
    stream = ExactCacheView(2)
    insert(allocator, cache, [1, 2, 3, 4, 5, 6, 7, 8], tomb=4)  # T[1..4] -> L[5..8]
    insert(allocator, cache, [1, 2, 3, 4, 9, 9], tomb=4)  # a branch under the tombstone
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    handle = cache.inc_lock_ref(match.last_node)  # a running request holds [5..8]
    insert(allocator, cache, [5, 5, 6, 6], tomb=0)
    insert(allocator, cache, [5, 5, 6, 6, 7, 7], tomb=0)  # L[5,5,6,6] -> L[7,7]
    # SWA LRU: [9,9] is an unlocked leaf (removed), [5,5,6,6] an inner node (tombstoned).
    assert cache.evict(0, 4) == (2, 6)
    events = cache.snapshot_events()
    assert events[0] == KVCleared() and len(events) == 5  # then one KVStored per node
    seen: set[int | None] = {None}  # parents before children
    for e in events[1:]:
        assert isinstance(e, KVStored) and e.parent_hash in seen
        seen.update(e.page_hashes)
    assert len(cache._events) == 7  # a query: the pending events stay
    view = stream_and_snapshot(cache, stream)
    tomb = {h: True for h in page_hashes([1, 2, 3, 4], 2) + page_hashes([5, 5, 6, 6], 2)}
    live = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)[2:] + page_hashes([5, 5, 6, 6, 7, 7], 2)[2:]
    assert view.pages(ME) == stream.pages(ME) == tomb | dict.fromkeys(live, False)
    assert view.pages(OTHER) == dict.fromkeys(page_hashes(list(range(900, 906)), 2), False)
    view.check()
    mirror = KVEventMirror()  # the strict mirror takes the snapshot without a mismatch
    mirror.apply(events)
    assert mirror.pages == stream.pages(ME)
    cache.dec_lock_ref(match.last_node, handle)
    cache.reset()
    view = stream_and_snapshot(cache, stream)
    assert view.pages(ME) == stream.pages(ME) == {}
    assert view.num_pages(OTHER) == 3


def test_snapshot_of_a_locked_tree_keeps_a_tombstone_leaf_a_running_request_holds() -> None:
    allocator, cache = make(page_size=1, window=2)
    stream = ExactCacheView(1)
    insert(allocator, cache, [1, 2, 3, 4, 5, 6], tomb=0)
    match = cache.match_prefix([1, 2, 3, 4, 5, 6])
    lock = PrefixLock(match.last_node, cache.inc_lock_ref(match.last_node))
    cache.release_request_swa(lock)
    cache.evict(0, 6)  # everything but the window checkpoint loses its SWA KV
    view = stream_and_snapshot(cache, stream)
    assert view.pages(ME) == stream.pages(ME) and any(stream.pages(ME).values())
    cache.dec_lock_ref(lock.node, lock.handle, skip_swa=True)
    assert stream_and_snapshot(cache, stream).pages(ME) == stream.pages(ME)


def test_snapshot_is_empty_when_events_are_off() -> None:
    allocator = SWATokenAllocator(16, 16)
    cache = SWARadixCache(allocator, sliding_window_size=2, enable_kv_events=False)
    insert(allocator, cache, [1, 2, 3], tomb=0)
    assert cache.snapshot_events() == []


op = st.one_of(
    st.tuples(
        st.just("insert"),
        st.lists(st.integers(0, 2), min_size=1, max_size=6),
        st.integers(0, 8),
    ),
    st.tuples(st.just("evict"), st.integers(0, 12), st.integers(0, 12)),
    st.tuples(st.just("lock"), st.lists(st.integers(0, 2), min_size=1, max_size=6)),
    st.tuples(st.just("unlock"), st.booleans()),
    st.tuples(st.just("reset")),
    st.tuples(st.just("snapshot")),
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    page_size=st.sampled_from([1, 2]),
    window=st.sampled_from([1, 2, 4]),
    pure=st.booleans(),
    ops=st.lists(op, max_size=30),
)
def test_snapshot_equals_the_event_stream_after_random_operations(
    page_size: int, window: int, pure: bool, ops: list[tuple]
) -> None:
    allocator, cache = make(page_size, window, pure)
    stream = ExactCacheView(page_size)
    locks: list[PrefixLock] = []
    for name, *args in ops:
        if name == "insert":
            symbols, tomb = args
            key = [10 * s + j for s in symbols for j in range(page_size)]
            insert(allocator, cache, key, tomb)
        elif name == "evict":
            cache.evict(*args)
        elif name == "lock":
            key = [10 * s + j for s in args[0] for j in range(page_size)]
            node = cache.match_prefix(key).last_node
            locks.append(PrefixLock(node, cache.inc_lock_ref(node)))
        elif name == "unlock" and locks:
            lock = locks.pop(0)
            if args[0]:
                cache.release_request_swa(lock)
            cache.dec_lock_ref(lock.node, lock.handle, skip_swa=lock.swa_released)
        elif name == "reset" and not locks:
            cache.reset()
        elif name == "snapshot":
            view = stream_and_snapshot(cache, stream)
            assert view.pages(ME) == stream.pages(ME)
            view.check()
        cache.check()
    view = stream_and_snapshot(cache, stream)
    assert view.pages(ME) == stream.pages(ME)
    assert view.num_pages(OTHER) == 3
    stream.check()
    view.check()
    allocator.check(owned=cache.cached_indices())
