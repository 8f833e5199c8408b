"""`ApproxCacheView`: the router's view of workers that send no KV events (`Router.add_worker(...,
kv_events=False)`, e.g. an engine other than swaserve's): the prompts routed to each, as if it
cached them all, in a trie of page objects with one LRU over all (page, worker) entries under
one global token cap (`RouterConfig.approx_max_tokens`). Its matches follow the window rule
(`window_walk.match_runs`) with no tombstones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from swaserve.router.cache_view import _KEY_TOKEN_BYTES, CacheViewCorrupted, PageKey, page_keys
from swaserve.router.window_walk import match_runs, walk_runs


class _Node:
    """One page under its parent. `held`: bit w set when worker w caches the page; `tomb`:
    bit w set when it is a tombstone there (`tomb` ⊆ `held`).

    `children` is None (a leaf), the one child itself (a chain: most pages), or a dict by key
    (two or more; the root's is always a dict): a 1-entry dict costs more than the page's
    other state. Read them through `_PageTrie._find` / `_kids`."""

    __slots__ = ("children", "held", "key", "parent", "tomb")

    def __init__(self, key: PageKey, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: _Node | dict[PageKey, _Node] | None = None
        self.held = 0
        self.tomb = 0


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class _PageTrie:
    """The shared trie and the match walk; subclasses add pages."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.root = _Node(b"", None)
        self.root.children = {}
        self._num_pages: dict[int, int] = {}  # worker -> pages it holds
        # One int object per worker bit, shared by every page only that worker holds (an int
        # of 2^30 and up is a 32-60-byte object of its own each time it is computed).
        self._bits: dict[int, int] = {}

    def num_pages(self, worker: int) -> int:
        return self._num_pages.get(worker, 0)

    def match(
        self,
        token_ids: Sequence[int],
        windows: Mapping[int, int],
        repair_tokens: Mapping[int, int] | None = None,
    ) -> dict[int, int]:
        """Tokens of `token_ids` that each worker of `windows` would skip (`match_runs`)."""
        return match_runs(self._path(token_ids), self.page_size, windows, repair_tokens)

    def match_columns(
        self, token_ids: Sequence[int], members: int, windows: np.ndarray, repairs: np.ndarray
    ) -> np.ndarray:
        """`match` for the workers of the bit mask `members`, by worker (`walk_runs`)."""
        return walk_runs(self._path(token_ids), self.page_size, members, windows, repairs)

    def _path(self, token_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
        """(held, tomb, 1) of each page of `token_ids` in the trie, from the root, while there."""
        node = self.root
        for key in page_keys(token_ids, self.page_size):
            kids = node.children
            if kids is None:
                return
            if isinstance(kids, dict):
                child = kids.get(key)
                if child is None:
                    return
            elif kids.key == key:
                child = kids
            else:
                return
            yield child.held, child.tomb, 1
            node = child

    def _bit(self, worker: int) -> int:
        """`1 << worker`, one object per worker."""
        bit = self._bits.get(worker)
        if bit is None:
            bit = self._bits[worker] = 1 << worker
        return bit

    @staticmethod
    def _find(parent: _Node, key: PageKey) -> _Node | None:
        """`parent`'s child of `key`, or None."""
        kids = parent.children
        if kids is None:
            return None
        if isinstance(kids, dict):
            return kids.get(key)
        return kids if kids.key == key else None

    @staticmethod
    def _kids(node: _Node) -> Iterable[_Node]:
        kids = node.children
        if kids is None:
            return ()
        return kids.values() if isinstance(kids, dict) else (kids,)

    def _child(self, parent: _Node, key: PageKey) -> _Node:
        """`parent`'s child of `key`, created (held by nobody) if it is missing."""
        node = self._find(parent, key)
        if node is not None:
            return node
        node = _Node(key, parent)
        kids = parent.children
        if kids is None:
            parent.children = node
        elif isinstance(kids, dict):
            kids[key] = node
        else:
            parent.children = {kids.key: kids, key: node}
        return node

    @staticmethod
    def _unlink(parent: _Node, node: _Node) -> None:
        kids = parent.children
        if isinstance(kids, dict):
            del kids[node.key]
            if len(kids) == 1 and parent.parent is not None:  # the root keeps its dict
                parent.children = next(iter(kids.values()))
        else:
            parent.children = None

    def _hold(self, node: _Node, worker: int, tombstone: bool) -> bool:
        """`worker` holds `node` (a tombstone or not); False if it already held it."""
        bit = self._bit(worker)
        new = not node.held & bit
        if new:
            node.held = node.held | bit if node.held else bit
            self._num_pages[worker] = self._num_pages.get(worker, 0) + 1
        if tombstone:
            node.tomb = node.tomb | bit if node.tomb else bit
        elif node.tomb & bit:
            node.tomb &= ~bit
        return new

    def _release(self, node: _Node, worker: int) -> None:
        """Worker `worker` no longer holds `node` (it did)."""
        node.held &= ~(1 << worker)
        node.tomb &= ~(1 << worker)
        self._num_pages[worker] -= 1

    def _prune(self, node: _Node) -> None:
        """Remove `node` and then each ancestor while it is held by nobody and has no child."""
        while node.parent is not None and not node.held and node.children is None:
            parent, node.parent = node.parent, None
            self._unlink(parent, node)
            node = parent

    def _subtree(self, node: _Node) -> list[_Node]:
        """`node` and its descendants, children before parents."""
        out, stack = [], [node]
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(self._kids(x))
        return out[::-1]

    def _check_trie(self) -> list[_Node]:
        """Structure checks; returns every node but the root."""
        nodes = [x for x in self._subtree(self.root) if x is not self.root]
        counts: dict[int, int] = {}
        for x in nodes:
            parent = x.parent
            if parent is None or self._find(parent, x.key) is not x:
                raise CacheViewCorrupted(f"page {x.key!r} is not filed under its parent")
            size = 1 if isinstance(x.key, int) else len(x.key) // _KEY_TOKEN_BYTES
            if size != self.page_size or (self.page_size == 1) != isinstance(x.key, int):
                raise CacheViewCorrupted(f"page key {x.key!r} does not fit P={self.page_size}")
            if isinstance(x.children, dict) and len(x.children) < 2:
                raise CacheViewCorrupted(f"page {x.key!r} keeps a dict for {len(x.children)} child")
            if not x.held and x.children is None:
                raise CacheViewCorrupted(f"page {x.key!r} is held by nobody and has no child")
            if x.tomb & ~x.held:
                raise CacheViewCorrupted(f"page {x.key!r} is a tombstone where it is not held")
            if parent is not self.root and x.held & ~parent.held:
                raise CacheViewCorrupted(f"page {x.key!r} is held where its parent is not")
            for w in _bits(x.held):
                counts[w] = counts.get(w, 0) + 1
        if {w: c for w, c in self._num_pages.items() if c} != counts:
            raise CacheViewCorrupted(f"page counts {self._num_pages} differ from the trie {counts}")
        return nodes


class ApproxCacheView(_PageTrie):
    """Prompts routed to workers that send no KV events, as if each worker cached them all,
    with one LRU of (page, worker) entries over all workers under `max_tokens` (pages × P).

    The LRU keeps a page newer than every page below it for the same worker (a record
    refreshes its path from the leaf up), so eviction always takes a worker's leaf pages first
    and a page is never held without its parent. It knows nothing of tombstones: its match is
    the longest recorded prefix.
    """

    def __init__(self, page_size: int, max_tokens: int) -> None:
        super().__init__(page_size)
        self.max_tokens = max_tokens
        self._lru: OrderedDict[tuple[_Node, int], None] = OrderedDict()  # oldest first

    @property
    def num_tokens(self) -> int:
        """Tokens held over all workers (pages × P)."""
        return len(self._lru) * self.page_size

    def record(self, worker: int, token_ids: Sequence[int]) -> None:
        """`worker` now caches the whole pages of `token_ids`; evicts LRU pages past the cap."""
        node, path = self.root, []
        for key in page_keys(token_ids, self.page_size):
            node = self._child(node, key)
            path.append(node)
        bit = 1 << worker
        for node in reversed(path):
            if node.held & bit:
                self._lru.move_to_end((node, worker))
            else:
                self._hold(node, worker, False)
                self._lru[node, worker] = None
        while self.num_tokens > self.max_tokens:
            (node, w), _ = self._lru.popitem(last=False)
            self._release(node, w)
            self._prune(node)

    def drop(self, worker: int) -> None:
        """Forget every page recorded for `worker`."""
        for node in self._subtree(self.root):
            if node.held >> worker & 1:
                self._release(node, worker)
                del self._lru[node, worker]
            if node is not self.root:
                self._prune(node)
        self._num_pages.pop(worker, None)

    def check(self) -> None:
        """Raise `CacheViewCorrupted` on a broken invariant: trie structure, no tombstones,
        the LRU holding exactly the (page, worker) entries, and the token cap."""
        nodes = self._check_trie()
        entries = {(x, w) for x in nodes for w in _bits(x.held)}
        if any(x.tomb for x in nodes) or entries != set(self._lru):
            raise CacheViewCorrupted("LRU entries differ from the held pages, or a tombstone")
        if self.num_tokens > self.max_tokens:
            raise CacheViewCorrupted(f"{self.num_tokens} tokens over the cap {self.max_tokens}")
