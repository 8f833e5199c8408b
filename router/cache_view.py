"""What each worker's prefix cache holds, as the router sees it: pages marked with the
workers that hold them (a bit per worker).

- `ExactCacheView` (`swaserve.router.exact_view`): rebuilt from KV events
  (`swaserve.proto.kv_events`), so a worker's pages and tombstones equal its radix tree's,
  page for page; columnar arrays, for a fleet's worth of pages.
- `ApproxCacheView` (here): for workers that send no events: the prompts routed to each
  worker, in a trie of page objects with one LRU over all (page, worker) entries under one
  global token cap.

Both answer `match(token_ids, windows, repair_tokens)` with one walk (`match_runs`): per
worker, the tokens its cache would let the request skip under the engine's rule
(`prefix_reuse`). Along one worker's pages of a prompt (P = 2, W = 4; L live, T tombstone), an end is valid with no tombstone before it
or with at least W live tokens right before it, and the plain match is the last valid end
before the first page the worker lacks:

    # pages:       L  L  T  L  L  L  |  (not held)
    # ends:     0  2  4  6  8  10 12
    # valid:    y  y  y  n  n  y  y     -> match 12; cut the prompt at 8 and it is 4

A worker that repairs windows (R > 0) may instead resume at the end of all the pages it holds
in a row, F, recomputing the last R: it skips max(valid, F - R). Cut the prompt above at 8
with R = 2 and it skips 6 instead of 4.

Worker ids here are small ints (bit positions); the router maps its worker ids onto them.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

PageKey = int | bytes
"""A page's tokens: the token itself when P = 1, else its P tokens as little-endian uint32
(4P bytes: a third of a tuple's size, without an int object per token)."""

_KEY_TOKEN_BYTES = 4
_TOKEN_LIMIT = 1 << 32


def page_tokens(token_ids: Sequence[int], page_size: int) -> np.ndarray:
    """The whole pages of `token_ids` as uint32, up to the page of the first token that is not
    an int in [0, 2^32) (no page can hold one)."""
    n = len(token_ids) // page_size * page_size
    try:
        return np.frombuffer(struct.pack(f"<{n}I", *token_ids[:n]), np.uint32)
    except struct.error:
        bad = next(
            i for i, t in enumerate(token_ids) if type(t) is not int or not 0 <= t < _TOKEN_LIMIT
        )
        return page_tokens(token_ids[: bad // page_size * page_size], page_size)


def page_keys(token_ids: Sequence[int], page_size: int) -> Sequence[PageKey]:
    """The keys of the whole pages of `token_ids`, as the trie files them. With P > 1, pages
    from the first token outside [0, 2^32) on have none (no page can hold such a token)."""
    if page_size == 1:
        return token_ids
    data = page_tokens(token_ids, page_size).tobytes()
    step = _KEY_TOKEN_BYTES * page_size
    return [data[i : i + step] for i in range(0, len(data), step)]


class CacheViewCorrupted(AssertionError):
    """`check()` found a broken invariant of a cache view."""


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


def match_runs(
    runs: Iterable[tuple[int, int, int]],
    page_size: int,
    windows: Mapping[int, int],
    repair_tokens: Mapping[int, int] | None = None,
) -> dict[int, int]:
    """Tokens that each worker of `windows` (worker -> its W) would skip, given `runs`: the
    (held, tomb, pages) of a prompt's whole pages from the root, as far as any worker holds
    them, pages in a row with equal masks as one run. `prefix_reuse(runs, W, R).saved_tokens`
    over the pages each worker holds in a row, R = `repair_tokens[worker]` (absent or 0: the
    worker does not repair). `walk_runs` over the workers as columns."""
    members, w, r = worker_columns(windows, repair_tokens)
    best = walk_runs(runs, page_size, members, w, r)
    return {k: int(best[k]) for k in windows}


def worker_columns(
    windows: Mapping[int, int], repair_tokens: Mapping[int, int] | None = None
) -> tuple[int, np.ndarray, np.ndarray]:
    """`walk_runs`' arguments for the workers of `windows`: their mask, W and R by worker."""
    size = max(windows, default=-1) + 1
    w, r = np.zeros(size, np.int64), np.zeros(size, np.int64)
    members = 0
    for k, window in windows.items():
        w[k] = window
        members |= 1 << k
    for k, repair in (repair_tokens or {}).items():
        if k in windows and repair > 0:
            r[k] = repair
    return members, w, r


def walk_runs(
    runs: Iterable[tuple[int, int, int]],
    page_size: int,
    members: int,
    windows: np.ndarray,
    repairs: np.ndarray,
) -> np.ndarray:
    """`match_runs` for the workers of the bit mask `members`, with their W and R (> 0: it
    repairs) in int64 arrays indexed by worker (`members` < 2^len); returns the tokens each
    skips, by worker (0 outside `members`).

    One walk for all workers, with bit masks: `alive` hold every page so far; `ok` are at
    a valid end (no tombstone yet, or >= W live tokens since the last one); `in_tomb` saw
    a tombstone as their previous page. A worker that leaves a run of tombstones at end
    `e` is `ready` again at end `e + W` (`waiting` until then). A worker's valid match is
    the last end at which it was in `ok`, written when it leaves `ok` or `alive`, or when
    the walk stops; where it leaves `alive` (or the walk stops) is its full run F, and a
    repairing worker that is not in `ok` there answers max(valid, F - R). The work is a few
    mask operations per run, plus a few array operations per change of state, however many
    workers change at once.
    """
    p = page_size
    best = np.zeros(len(windows), np.int64)
    alive = members
    tombs_matter = members & bits_mask(windows > 0)  # with W = 0 every end is valid
    repairing = members & bits_mask(repairs > 0)
    ok, in_tomb, waiting = alive, 0, 0
    ready = np.zeros(len(windows), np.int64)  # end at which a waiting worker is ok again
    next_ready = _NEVER  # <= the least `ready` of the waiting workers
    end = 0
    for held, page_tomb, pages in runs:
        if not alive:
            break
        gone = alive & ~held
        if gone:
            if gone & ok:
                best[mask_bits(gone & ok)] = end
            if gone & repairing & ~ok:
                _repair(best, gone & repairing & ~ok, end, repairs)
            alive &= held
            ok &= alive
            in_tomb &= alive
            waiting &= alive
        tomb = page_tomb & tombs_matter & alive
        if tomb & ok:
            best[mask_bits(tomb & ok)] = end
            ok &= ~tomb
        if tomb != in_tomb:
            waiting &= ~tomb
            if leaving := in_tomb & ~tomb:  # their live run starts at this page
                at = mask_bits(leaving)
                ready[at] = end + windows[at]
                next_ready = min(next_ready, int(ready[at].min()))
                waiting |= leaving
            in_tomb = tomb
        end += p * pages  # past the run's first page nothing changes but `ready`
        if waiting and end >= next_ready:
            at = mask_bits(waiting)
            done = ready[at] <= end
            ok |= waiting & bits_mask_at(at[done], len(windows))
            waiting &= ~ok
            next_ready = int(ready[at[~done]].min()) if waiting else _NEVER
    if alive & ok:
        best[mask_bits(alive & ok)] = end
    if alive & repairing & ~ok:
        _repair(best, alive & repairing & ~ok, end, repairs)
    return best


def held_tokens(
    runs: Iterable[tuple[int, int, int]], page_size: int, members: int, size: int
) -> np.ndarray:
    """By worker of the bit mask `members` (an array of `size`), the tokens of the pages of
    `runs` it holds in a row from the root, tombstones or not (its full run F)."""
    out = np.zeros(size, np.int64)
    alive, end = members, 0
    for held, _, pages in runs:
        if gone := alive & ~held:
            out[mask_bits(gone)] = end
            alive &= held
        if not alive:
            return out
        end += page_size * pages
    if alive:
        out[mask_bits(alive)] = end
    return out


_NEVER = 1 << 62


def mask_bits(mask: int) -> np.ndarray:
    """The positions of the set bits of `mask` (>= 0), ascending."""
    if mask & (mask - 1) == 0:
        return np.array([mask.bit_length() - 1] if mask else [], np.intp)
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little"))


def bits_mask(flags: np.ndarray) -> int:
    """The bit mask of a bool array: bit i set where `flags[i]`."""
    return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")


def bits_mask_at(positions: np.ndarray, size: int) -> int:
    """The bit mask with the bits at `positions` (each < `size`) set."""
    flags = np.zeros(size, bool)
    flags[positions] = True
    return bits_mask(flags)


def _repair(best: np.ndarray, mask: int, full_end: int, repairs: np.ndarray) -> None:
    """The workers of `mask` hold a full run to `full_end` without a valid end there: a
    repair of their last R tokens saves `full_end - R` where that beats the valid match
    (`prefix_reuse`)."""
    at = mask_bits(mask)
    best[at] = np.maximum(best[at], full_end - repairs[at])


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
