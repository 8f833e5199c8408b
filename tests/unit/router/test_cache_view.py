"""Exact (event-fed) and approximate (routed prompts) cache views: exact matched lengths,
tombstones, window repair, tolerance of events that do not fit, and the approximate view's
global cap."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_event_mirror import KVEventMirror
from router_scenario import P, W, pages_of, stored

from swaserve.proto.kv_events import (
    KVCleared,
    KVRemoved,
    KVRevived,
    KVStored,
    KVTombstoned,
    page_hashes,
)
from swaserve.router import ApproxCacheView, CacheViewCorrupted, ExactCacheView
from swaserve.worker.kv import SWATokenAllocator
from swaserve.worker.kv.radix_cache import SWARadixCache

TOKENS = list(range(1, 13))  # pages [1,2] [3,4] [5,6] [7,8] [9,10] [11,12]


# ---- rule: tombstone-aware match ---------------------------------------------------------------


def test_match_ends_only_where_w_live_tokens_precede_the_end() -> None:
    view = ExactCacheView(P)
    view.apply(0, [stored(TOKENS), KVTombstoned(pages_of(TOKENS, 2, 3))])  # [5,6] tombstone
    view.apply(1, [stored(TOKENS)])  # all live
    windows = {0: W, 1: W}
    # worker 0: ends 2, 4 valid (no tombstone yet); 6, 8 have 0, 2 live tokens before them.
    assert view.match(TOKENS[:8], windows) == {0: 4, 1: 8}
    assert view.match(TOKENS[:9], windows) == {0: 4, 1: 8}  # a partial page never matches
    assert view.match(TOKENS[:10], windows) == {0: 10, 1: 10}  # [7..10]: 4 live tokens
    assert view.match(TOKENS, windows) == {0: 12, 1: 12}  # the module docstring's picture
    assert view.match([*TOKENS[:10], 99, 99], windows) == {0: 10, 1: 10}
    assert view.match(TOKENS[:8], {0: 0}) == {0: 8}  # W = 0 ignores tombstones
    view.apply(0, [KVRevived(pages_of(TOKENS, 2, 3))])
    assert view.match(TOKENS[:8], windows) == {0: 8, 1: 8}


def test_match_falls_back_to_zero_when_a_tombstone_opens_the_path() -> None:
    view = ExactCacheView(P)
    view.apply(0, [stored(TOKENS[:6], tombstone=True), stored(TOKENS[6:], parent=TOKENS[:6])])
    assert view.match(TOKENS, {0: W}) == {0: 12}  # [7..12]: 6 live tokens
    assert view.match(TOKENS[:8], {0: W}) == {0: 0}  # only 2 live tokens before 8
    assert view.match(TOKENS[:8], {0: 2}) == {0: 8}


def test_repairing_worker_skips_its_whole_run_less_r_where_that_saves_more() -> None:
    view = ExactCacheView(P)
    view.apply(0, [stored(TOKENS), KVTombstoned(pages_of(TOKENS, 2, 3))])  # [5,6] tombstone
    view.apply(1, [stored(TOKENS[:8]), KVTombstoned(pages_of(TOKENS, 0, 3))])  # [1..6]
    windows = {0: W, 1: W}
    assert view.match(TOKENS[:8], windows) == {0: 4, 1: 0}
    # The module docstring's picture cut at 8, R = 2: worker 0 skips 8 - 2 = 6 instead of 4.
    assert view.match(TOKENS[:8], windows, {0: 2, 1: 2}) == {0: 6, 1: 6}
    assert view.match(TOKENS[:8], windows, {0: 4, 1: 4}) == {0: 4, 1: 4}  # 8 - 4: a tie
    assert view.match(TOKENS[:8], windows, {1: 6}) == {0: 4, 1: 2}  # only worker 1 repairs
    assert view.match(TOKENS, windows, {0: 2, 1: 2}) == {0: 12, 1: 6}  # 12: a valid end
    assert view.match(TOKENS[:4], windows, {0: 2, 1: 2}) == {0: 4, 1: 2}  # 4 - 2 beats 0


def test_exact_view_equals_the_real_cache_on_a_tombstoned_node() -> None:
    """A real SWARadixCache: [1..6] inserted, then [1..12]; SWA eviction tombstones the older
    node [1..6]. The view then predicts what match_prefix returns, not the cached length."""
    allocator = SWATokenAllocator(64, 64, page_size=P)
    cache = SWARadixCache(allocator, sliding_window_size=W, page_size=P)
    for key in (TOKENS[:6], TOKENS):
        prefix = cache.match_prefix(key).indices
        cache.insert(key, torch.cat((prefix, allocator.alloc(len(key) - prefix.numel()))))
    assert cache.evict(0, 6) == (0, 6)
    view = ExactCacheView(P)
    assert view.apply(0, cache.take_events()) == 0
    for n in range(0, 13):
        assert view.match(TOKENS[:n], {0: W})[0] == cache.match_prefix(TOKENS[:n]).indices.numel()
    assert [view.match(TOKENS[:n], {0: W})[0] for n in (6, 8, 10, 12)] == [0, 0, 10, 12]
    view.check()


# ---- exact view bookkeeping -----------------------------------------------------------------------


def test_workers_share_pages_and_removal_prunes_only_unheld_pages() -> None:
    view = ExactCacheView(P)
    view.apply(0, [stored(TOKENS)])
    view.apply(1, [stored(TOKENS[:4])])
    assert (view.num_pages(0), view.num_pages(1), view.num_nodes) == (6, 2, 6)
    view.apply(0, [KVRemoved(pages_of(TOKENS, 1, 6))])  # a leaf node of 5 pages leaves
    assert view.match(TOKENS, {0: W, 1: W}) == {0: 2, 1: 4}
    assert view.num_nodes == 2  # [3,4] stays: worker 1 holds it
    view.apply(1, [KVCleared()])
    assert (view.num_pages(0), view.num_pages(1), view.num_nodes) == (1, 0, 1)
    view.drop(0)
    assert view.num_nodes == 0 and view.match(TOKENS, {0: 0, 1: 0}) == {0: 0, 1: 0}
    view.check()


@pytest.mark.parametrize(
    ("event", "pages_after"),
    [
        (stored([7, 8], parent=[5, 6]), 2),  # under a page the worker does not hold: skipped
        (KVRemoved(pages_of([9, 9], 0, 1)), 2),  # unknown page: skipped
        (KVRevived(pages_of(TOKENS, 1, 2)), 2),  # not a tombstone: skipped
        (KVTombstoned(pages_of(TOKENS, 0, 1)), 2),  # already a tombstone: skipped
        (stored(TOKENS[:2]), 2),  # stored twice: taken as the new state
        (KVRemoved(pages_of(TOKENS, 0, 1)), 0),  # removes a page with a child: both go
    ],
)
def test_events_that_do_not_fit_are_counted_and_never_leave_an_orphan(
    event: object, pages_after: int
) -> None:
    view = ExactCacheView(P)
    view.apply(0, [stored(TOKENS[:4]), KVTombstoned(pages_of(TOKENS, 0, 1))])
    assert view.apply(0, [event]) == 1  # type: ignore[list-item]
    assert view.num_pages(0) == pages_after
    view.check()


def test_exact_view_check_catches_an_orphan_page() -> None:
    view = ExactCacheView(P)
    view.apply(0, [stored(TOKENS[:4])])
    first = view._find_hash(pages_of(TOKENS, 0, 1)[0])
    view._holder[first] = 5  # the parent page forgets worker 0
    with pytest.raises(CacheViewCorrupted, match="held where its parent is not"):
        view.check()


# ---- rule: approximate mode under its memory cap --------------------------------------------------


def test_approximate_view_evicts_lru_leaf_pages_under_one_global_cap() -> None:
    view = ApproxCacheView(P, max_tokens=10)  # 5 (page, worker) entries over all workers
    a, b = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 8]
    view.record(0, a)  # 3 pages (the partial page [7] is not cached)
    view.record(1, b)  # 3 pages: 6 in all, over the cap by one
    # The oldest entry is worker 0's leaf [5,6]; its parents stay.
    assert (view.num_pages(0), view.num_pages(1), view.num_tokens) == (2, 3, 10)
    assert view.match(a, {0: 0, 1: 0}) == {0: 4, 1: 4}
    assert view.match(b, {0: 0, 1: 0}) == {0: 4, 1: 6}
    view.record(0, [1, 2, 9, 9])  # refreshes [1,2] for worker 0, adds [9,9]: evicts [3,4] of w0
    assert view.match(a, {0: 0, 1: 0}) == {0: 2, 1: 4}
    assert (view.num_pages(0), view.num_pages(1), view.num_tokens) == (2, 3, 10)
    view.check()
    view.drop(1)
    assert view.match(b, {0: 0, 1: 0}) == {0: 2, 1: 0} and view.num_tokens == 4
    view.check()


def test_approximate_view_with_a_cap_below_one_page_holds_nothing() -> None:
    view = ApproxCacheView(P, max_tokens=1)
    view.record(0, TOKENS)
    assert view.num_tokens == 0 and view.root.children == {}
    view.check()


# ---- the shared walk equals one mirror per worker ---------------------------------------------------


@pytest.mark.parametrize("bits", [(0, 1, 2), (9, 70, 200)])
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    paths=st.lists(
        st.tuples(
            st.integers(0, 2),  # worker
            st.lists(st.integers(0, 2), min_size=1, max_size=8),  # pages, by symbol
            st.lists(st.booleans(), min_size=8, max_size=8),  # tombstone flags
        ),
        max_size=8,
    ),
    windows=st.tuples(*[st.sampled_from([0, 1, 2, 4, 6]) for _ in range(3)]),
    repairs=st.tuples(*[st.sampled_from([0, 2, 4, 8]) for _ in range(3)]),
    probe=st.lists(st.integers(0, 2), max_size=9),
)
def test_shared_walk_equals_each_workers_mirror(
    bits: tuple[int, ...],
    paths: list[tuple[int, list[int], list[bool]]],
    windows: tuple[int, ...],
    repairs: tuple[int, ...],
    probe: list[int],
) -> None:
    """Each worker caches prefixes of a few paths over a 3-page alphabet, some pages
    tombstoned; one walk answers for all workers what each worker's own mirror answers, with
    and without each worker's window repair R. The workers sit at `bits` in the view: low
    ones, and ones past a machine word (masks of several bytes)."""
    view, mirrors = ExactCacheView(P), [KVEventMirror() for _ in windows]
    for worker, symbols, tombstones in paths:
        tokens = [10 * s + j for s in symbols for j in range(P)]
        hashes = page_hashes(tokens, P)
        new = next((i for i, h in enumerate(hashes) if h not in mirrors[worker].pages), None)
        if new is None:
            continue
        parent = hashes[new - 1] if new else None
        events = [KVStored(tuple(hashes[new:]), parent, tuple(tokens[new * P :]), P)]
        marked = tuple(h for h, t in zip(hashes, tombstones, strict=False) if t)
        flip = [h for h in marked if not mirrors[worker].pages.get(h, False)]
        events += [KVTombstoned(tuple(flip))] if flip else []
        mirrors[worker].apply(events)
        assert view.apply(bits[worker], events) == 0
    view.check()
    tokens = [10 * s + j for s in probe for j in range(P)]
    at = dict(enumerate(bits))
    expected = {at[w]: m.match_length(tokens, P, windows[w]) for w, m in enumerate(mirrors)}
    assert view.match(tokens, {at[w]: x for w, x in enumerate(windows)}) == expected
    expected = {
        at[w]: m.match_length(tokens, P, windows[w], repairs[w]) for w, m in enumerate(mirrors)
    }
    assert (
        view.match(
            tokens,
            {at[w]: x for w, x in enumerate(windows)},
            {at[w]: x for w, x in enumerate(repairs)},
        )
        == expected
    )
