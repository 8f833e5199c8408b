"""The exact view's columns: prefix fingerprints, rows reused after removal, tables rebuilt
under churn, pages shared by several workers, and a `check()` that fails on each kind of
broken link."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router_scenario import P, W, pages_of, stored

from swaserve.proto.kv_events import KVRemoved, KVStored, KVTombstoned, page_hashes
from swaserve.router import CacheViewCorrupted, ExactCacheView
from swaserve.router.cache_view import page_keys
from swaserve.router.exact_view import ROW_BYTES, fingerprints, page_tokens

TOKENS = list(range(1, 13))  # pages [1,2] [3,4] [5,6] [7,8] [9,10] [11,12]


def test_page_keys_are_the_whole_pages_as_uint32_and_stop_before_a_token_out_of_range() -> None:
    assert page_keys([1, 2, 3, 4, 5], 2) == [b"\x01\0\0\0\x02\0\0\0", b"\x03\0\0\0\x04\0\0\0"]
    assert page_keys([1, 2, 3, -1, 5, 6], 2) == [b"\x01\0\0\0\x02\0\0\0"]
    assert page_keys([1, 2, 1 << 32, 4], 2) == [b"\x01\0\0\0\x02\0\0\0"]
    assert page_keys([7, 8, 9], 1) == [7, 8, 9]


def test_page_tokens_stop_at_the_page_of_the_first_token_out_of_range() -> None:
    assert page_tokens([1, 2, 3, 4, 5], 2).tolist() == [1, 2, 3, 4]
    assert page_tokens([1, 2, 3, -1, 5, 6], 2).tolist() == [1, 2]
    assert page_tokens([1, 2, 1 << 32, 4], 2).tolist() == [1, 2]
    assert page_tokens([1, 2, 3, 1 << 70], 2).tolist() == [1, 2]
    assert page_tokens([7, 8, 9], 1).tolist() == [7, 8, 9]


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(
    tokens=st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=160),
    page=st.sampled_from([1, 2, 4]),
    cut=st.integers(0, 40),
)
def test_a_prefix_fingerprint_continues_from_its_parent_and_names_the_whole_prefix(
    tokens: list[int], page: int, cut: int
) -> None:
    """Fingerprints from a parent's equal those of the whole prefix, whichever of the two
    mixing paths (numpy past 16 pages, Python below) each side takes."""
    arr = page_tokens(tokens, page)
    whole = fingerprints(arr, page)
    if cut <= len(whole):
        base = whole[cut - 1] if cut else 0
        assert fingerprints(arr[cut * page :], page, cut * page, base) == whole[cut:]
    assert len(set(whole)) == len(whole)  # each prefix length its own fingerprint
    if not whole:
        return
    changed = [*tokens]
    changed[0] ^= 1
    assert fingerprints(page_tokens(changed, page), page) != whole


def test_a_token_out_of_range_is_never_stored_and_ends_a_match() -> None:
    view = ExactCacheView(P)
    bad = [1, 2, -3, 4]
    event = KVStored(tuple(page_hashes(bad, P)), None, tuple(bad), P)
    assert view.apply(0, [event]) == 1 and view.num_pages(0) == 0
    view.apply(0, [stored(TOKENS)])
    assert view.match([*TOKENS[:6], -1, 8], {0: 0}) == {0: 6}
    assert view.match([*TOKENS[:6], 1 << 80, 8], {0: 0}) == {0: 6}
    view.check()


def test_a_page_several_workers_hold_keeps_masks_until_one_holder_is_left() -> None:
    view = ExactCacheView(P)
    view.apply(0, [stored(TOKENS)])
    view.apply(3, [stored(TOKENS[:4], tombstone=True)])
    first = view._find_hash(pages_of(TOKENS, 0, 1)[0])
    assert view._multi[first] == (0b1001, 0b1000)
    assert view.num_nodes == 6 and view.pages(3) == dict.fromkeys(pages_of(TOKENS, 0, 2), True)
    assert view.match(TOKENS, {0: W, 3: 0}) == {0: 12, 3: 4}
    view.check()
    view.apply(3, [KVRemoved(pages_of(TOKENS, 0, 2))])
    assert view._multi == {} and view._holder[first] == 0
    assert view.pages(0) == dict.fromkeys(pages_of(TOKENS, 0, 6), False)
    view.check()


def test_removed_rows_are_reused_and_churn_keeps_the_tables_small() -> None:
    view = ExactCacheView(P)
    for i in range(3000):  # 3000 sequences of 6 pages through, at most 2 held at a time
        tokens = [1000 + 12 * i + j for j in range(12)]
        assert view.apply(i % 2, [stored(tokens)]) == 0
        if i >= 2:
            old = [1000 + 12 * (i - 2) + j for j in range(12)]
            assert view.apply(i % 2, [KVRemoved(pages_of(old, 0, 6))]) == 0
    assert view.num_nodes == 12 and view._rows <= 1 + 18
    assert view._slots <= 1031  # rebuilt in place, deleted slots dropped, never grown
    view.check()
    assert view.match([1000 + 12 * 2999 + j for j in range(12)], {0: 0, 1: 0}) == {0: 0, 1: 12}


def test_state_per_page_is_a_row_and_two_table_slots() -> None:
    view = ExactCacheView(16)
    rng = np.random.default_rng(0)
    pages = 0
    for _ in range(400):
        tokens = rng.integers(0, 50_000, 16 * 40).tolist()
        view.apply(0, [KVStored(tuple(page_hashes(tokens, 16)), None, tuple(tokens), 16)])
        pages += 40
    assert view.num_pages(0) == view.num_nodes == pages
    per_page = view.memory_bytes() / pages
    assert ROW_BYTES <= per_page <= ROW_BYTES + 8 / 0.25 + 8  # tables at 1/4 to 3/4 load
    view.check()


def test_dropping_a_worker_leaves_the_pages_others_hold_and_unlinks_its_own() -> None:
    view = ExactCacheView(P)
    view.apply(0, [stored(TOKENS), KVTombstoned(pages_of(TOKENS, 3, 4))])
    view.apply(1, [stored(TOKENS[:6]), stored([77, 78], parent=TOKENS[:4])])
    view.apply(2, [stored([5, 5, 6, 6])])
    view.drop(0)
    assert view.num_pages(0) == 0 and view.num_nodes == 4 + 2
    assert view.match(TOKENS, {0: W, 1: W}) == {0: 0, 1: 6}
    assert view.match([*TOKENS[:4], 77, 78], {1: W, 2: W}) == {1: 6, 2: 0}
    view.check()
    view.drop(1)
    view.drop(2)
    assert view.num_nodes == 0 and len(view._free) == view._rows - 1
    view.check()


def _poke_table(view: ExactCacheView) -> None:
    tab = view._tables["fp"]
    tab[np.flatnonzero((tab >= 0) & (tab != _other_row(view)))[0]] = _other_row(view)


def _other_row(view: ExactCacheView) -> int:
    return view._find_hash(pages_of(TOKENS, 1, 2)[0])


@pytest.mark.parametrize(
    ("poke", "message"),
    [
        (lambda v: v._prev.__setitem__(_other_row(v), 0), "sibling links"),
        (lambda v: v._depth.__setitem__(_other_row(v), 7), "one deeper"),
        (lambda v: v._bit(9) and v._holder.__setitem__(_other_row(v), 9), "parent is not"),
        (lambda v: v._num_pages.__setitem__(0, 5), "page counts"),
        (lambda v: v._holder.__setitem__(v._rows - 1, -1), "held by nobody"),
        (lambda v: v._child.__setitem__(_other_row(v), -1), "live rows"),
        (_poke_table, "table does not name"),
        (lambda v: v._multi.__setitem__(1, (1, 0)), "shared masks"),
    ],
)
def test_check_fails_on_each_broken_link(poke: object, message: str) -> None:
    view = ExactCacheView(P)
    view.apply(0, [stored(TOKENS)])
    view.check()
    poke(view)  # type: ignore[operator]
    with pytest.raises(CacheViewCorrupted, match=message):
        view.check()
