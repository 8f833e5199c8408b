"""Page hashes, KV event records and the mirror a router rebuilds from them."""

from __future__ import annotations

import pytest
from kv_event_mirror import KVEventMirror, KVEventMismatch

from swaserve.proto.kv_events import (
    KVCleared,
    KVRemoved,
    KVRevived,
    KVStored,
    KVTombstoned,
    page_hash,
    page_hashes,
)
from swaserve.worker.kv import SWATokenAllocator
from swaserve.worker.kv.radix_cache import SWARadixCache

H12 = 0xED569FD3C7FBBEC1  # page_hash(None, [1, 2]): fixed forever, in every process
H1234 = 0xC8B0D6F4D9BAD787  # page_hash(H12, [3, 4])


def test_page_hash_is_a_fixed_blake2b_chain() -> None:
    assert page_hash(None, [1, 2]) == H12
    assert page_hash(H12, [3, 4]) == H1234
    assert page_hashes([1, 2, 3, 4, 5], 2) == [H12, H1234]  # the partial page [5] is left out
    assert page_hashes([3, 4], 2, parent_hash=H12) == [H1234]
    assert page_hash(None, [3, 4]) != H1234  # the parent is part of the name
    assert page_hash(None, [1, 2]) != page_hash(None, [2, 1])


def test_mirror_replays_stored_tombstoned_revived_removed_cleared() -> None:
    mirror = KVEventMirror()
    mirror.apply([KVStored((H12, H1234), None, (1, 2, 3, 4), 2)])
    assert mirror.pages == {H12: False, H1234: False}
    mirror.apply([KVTombstoned((H12,))])
    assert mirror.pages == {H12: True, H1234: False}
    mirror.apply([KVRevived((H12,)), KVRemoved((H1234,))])
    assert mirror.pages == {H12: False}
    mirror.apply([KVCleared()])
    assert mirror.pages == {}


@pytest.mark.parametrize(
    "event",
    [
        KVStored((H1234,), 12345, (3, 4), 2),  # unknown parent
        KVStored((H12,), None, (1, 2), 2),  # already cached
        KVRemoved((H1234,)),  # unknown page
        KVRevived((H12,)),  # not a tombstone
    ],
)
def test_mirror_rejects_events_that_do_not_fit(event: KVStored | KVRemoved | KVRevived) -> None:
    mirror = KVEventMirror()
    mirror.apply([KVStored((H12,), None, (1, 2), 2)])
    with pytest.raises(KVEventMismatch):
        mirror.apply([event])
    assert mirror.pages == {H12: False}


def test_mirror_match_length_applies_the_window_rule() -> None:
    hashes = page_hashes(list(range(1, 9)), 2)  # pages [1,2] [3,4] [5,6] [7,8]
    mirror = KVEventMirror()
    mirror.apply([KVStored(tuple(hashes), None, tuple(range(1, 9)), 2)])
    assert mirror.match_length(list(range(1, 10)), 2, 3) == 8
    mirror.apply([KVTombstoned((hashes[1],))])
    # [1,2] live, [3,4] tombstone, [5..8] live: an end needs 3 live tokens before it.
    assert mirror.match_length(list(range(1, 9)), 2, 3) == 8
    assert mirror.match_length(list(range(1, 7)), 2, 3) == 2  # 2 live tokens after the tombstone
    assert mirror.match_length(list(range(1, 7)), 2, 2) == 6
    assert mirror.match_length([9, 9], 2, 1) == 0


def test_mirror_match_length_with_window_repair_answers_the_saved_tokens() -> None:
    hashes = page_hashes(list(range(1, 9)), 2)  # pages [1,2] [3,4] [5,6] [7,8]
    mirror = KVEventMirror()
    mirror.apply([KVStored(tuple(hashes), None, tuple(range(1, 9)), 2)])
    mirror.apply([KVTombstoned(hashes[1:3])])  # [3..6] tombstone: only 2 live tokens before 8
    assert mirror.match_length(list(range(1, 9)), 2, 4) == 2  # the plain window rule
    assert mirror.match_length(list(range(1, 9)), 2, 4, repair_tokens=2) == 6  # 8 - R
    assert mirror.match_length(list(range(1, 9)), 2, 4, repair_tokens=6) == 2  # 8 - 6: no gain
    assert mirror.match_length(list(range(1, 9)), 2, 2, repair_tokens=2) == 8  # a live window


def test_cache_events_mirror_the_reference_scenario() -> None:
    allocator = SWATokenAllocator(128, 64)
    cache = SWARadixCache(allocator, sliding_window_size=4)
    for key in ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [10, 11, 12], [1, 2, 3, 4, 5, 60, 70]):
        cache.insert(key, allocator.alloc(len(key)))
    cache.evict(1, 0)
    cache.evict(0, 5)  # leaves [6, 7] and [60, 70], then the branch checkpoint [1, 2, 3]
    events = cache.take_events()
    assert [type(e).__name__ for e in events] == [
        "KVStored", "KVStored", "KVStored", "KVStored", "KVRemoved", "KVRemoved", "KVRemoved",
        "KVTombstoned",
    ]  # fmt: skip
    h = page_hashes([1, 2, 3, 4, 5, 60, 70], 1)
    assert events[3] == KVStored((h[5], h[6]), h[4], (60, 70), 1)  # under the split of [4..7]
    assert events[7] == KVTombstoned(tuple(h[:3]))
    mirror = KVEventMirror()
    mirror.apply(events)
    assert mirror.pages == {**dict.fromkeys(h[:3], True), **dict.fromkeys(h[3:5], False)}  # fmt: skip
    assert cache.take_events() == []
    cache.reset()
    assert cache.take_events() == [KVCleared()]


def test_events_can_be_disabled() -> None:
    allocator = SWATokenAllocator(16, 16)
    cache = SWARadixCache(allocator, sliding_window_size=2, enable_kv_events=False)
    cache.insert([1, 2, 3], allocator.alloc(3))
    cache.evict(3, 3)
    assert cache.take_events() == []
    cache.check()
