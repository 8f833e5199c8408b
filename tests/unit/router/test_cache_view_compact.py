"""The exact view's compact page state: uint32 page keys, a chain's child held without a dict,
and one int object per worker bit."""

from __future__ import annotations

from router_scenario import P, W, pages_of, stored

from swaserve.proto.kv_events import KVRemoved, KVStored, page_hashes
from swaserve.router import ExactCacheView
from swaserve.router.cache_view import page_keys

TOKENS = list(range(1, 13))  # pages [1,2] [3,4] [5,6] [7,8] [9,10] [11,12]


def test_page_keys_are_the_whole_pages_as_uint32_and_stop_before_a_token_out_of_range() -> None:
    assert page_keys([1, 2, 3, 4, 5], 2) == [b"\x01\0\0\0\x02\0\0\0", b"\x03\0\0\0\x04\0\0\0"]
    assert page_keys([1, 2, 3, -1, 5, 6], 2) == [b"\x01\0\0\0\x02\0\0\0"]
    assert page_keys([1, 2, 1 << 32, 4], 2) == [b"\x01\0\0\0\x02\0\0\0"]
    assert page_keys([7, 8, 9], 1) == [7, 8, 9]


def test_a_token_out_of_range_is_never_stored_and_ends_a_match() -> None:
    view = ExactCacheView(P)
    bad = [1, 2, -3, 4]
    event = KVStored(tuple(page_hashes(bad, P)), None, tuple(bad), P)
    assert view.apply(0, [event]) == 1 and view.num_pages(0) == 0
    view.apply(0, [stored(TOKENS)])
    assert view.match([*TOKENS[:6], -1, 8], {0: 0}) == {0: 6}
    view.check()


def test_a_chain_keeps_its_child_without_a_dict_and_a_branch_folds_back() -> None:
    view = ExactCacheView(P)
    view.apply(0, [stored(TOKENS)])
    first = view.root.children[page_keys([1, 2], P)[0]]
    assert not isinstance(first.children, dict) and first.children is not None
    branch = [1, 2, 99, 98]
    view.apply(1, [stored(branch)])  # [1,2] then [99,98]: [1,2] now has two children
    assert isinstance(first.children, dict) and len(first.children) == 2
    assert view.match(branch, {0: W, 1: W}) == {0: 2, 1: 4}
    view.check()
    view.apply(1, [KVRemoved(pages_of(branch, 1, 2))])
    assert not isinstance(first.children, dict) and first.children.key == page_keys(TOKENS, P)[1]
    assert view.match(TOKENS, {0: W, 1: W}) == {0: 12, 1: 2}
    view.check()


def test_pages_one_worker_holds_share_one_bit_object() -> None:
    view = ExactCacheView(P)
    view.apply(40, [stored(TOKENS)])
    nodes = list(view.by_hash.values())
    assert len(nodes) == 6 and all(x.held is nodes[0].held for x in nodes)
    assert nodes[0].held == 1 << 40
