"""The router's exact view of every event-reporting worker's prefix cache, in columns.

One page-trie node per distinct page over the fleet, stored as a row of numpy arrays (no
Python object per page, so a fleet's worth of pages costs tens of bytes each and adds
nothing to a garbage-collection pass):

    hash    uint64  the engine's chained page hash (`swaserve.proto.kv_events`)
    fp      uint64  the prefix fingerprint: over the pages up to this one, the sum of
                    mix(sum of token x weight[position]), mix = splitmix64's finalizer,
                    a fixed odd weight per position (all wrapping mod 2^64)
    parent, child, next, prev, depth   int32   the trie: first child, sibling list
    holder  int32   the one worker that holds the page, or MULTI (two or more: their
                    masks in `_multi`), or FREE (a free row)
    tomb    uint8   a tombstone for its one holder

Two open-addressing tables of int32 row numbers (a prime number of slots, double hashing:
slot key mod n, step 1 + (key >> 32) mod (n - 1)) find a row by hash (events name pages by
hash) and by fingerprint (a route computes the fingerprints of its prompt's pages in a few
numpy operations, then looks them up in order, instead of comparing page tokens). A found
row counts only where its parent is the previous page's row, so a prompt's match is a chain
from the root. Fingerprints are 64 bits: two distinct prefixes
share one with odds of about n² / 2^65 over n pages (1 in 3,600 at 10^8 pages), and a page
is taken for a sibling page with odds of at most siblings × 2^(v - 64), 2^v the largest power
of two dividing a difference of their tokens (v < 18 for a vocabulary under 2^18). A prompt
hit by one is routed as if it shared the other's cached prefix; a stored page hit by one is
refused and counted as a mismatch (its hash differs): nothing worse.

Removed rows go to a free stack and are reused; the tables are rebuilt (vectorized) when
their live and deleted slots pass 4/5 of them, to half full. Events and routes touch a few
rows each, through memoryviews (Python ints, no numpy call per page); a worker's drop and a
rebuild are whole-column numpy operations.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from swaserve.proto.kv_events import (
    KVCleared,
    KVEvent,
    KVRemoved,
    KVRevived,
    KVStored,
    KVTombstoned,
)
from swaserve.router.cache_view import CacheViewCorrupted, page_tokens
from swaserve.router.page_tables import (
    _DELETED,
    _EMPTY,
    _FREE,
    _MAX_LOAD,
    _MIN_SLOTS,
    PageTables,
    fingerprints,
)
from swaserve.router.window_walk import match_runs, walk_runs

_MULTI, _ROOT = -2, -3  # holder (besides a worker and _FREE)
_MIN_ROWS = 1024
_HASH_LIMIT = 1 << 64
_COLUMNS = (
    ("hash", np.uint64),
    ("fp", np.uint64),
    ("parent", np.int32),
    ("child", np.int32),
    ("next", np.int32),
    ("prev", np.int32),
    ("depth", np.int32),
    ("holder", np.int32),
    ("tomb", np.uint8),
)
ROW_BYTES = sum(np.dtype(t).itemsize for _, t in _COLUMNS)
"""Bytes of one row of the node columns (the tables add 8 per row at half load)."""


class ExactCacheView(PageTables):
    """Every event-reporting worker's cached pages and tombstones, from its KV events.

    `apply` never raises on an event that contradicts the view (a lost or reordered event):
    it makes the view agree with the event where it can, skips it where it cannot (pages under
    an unknown parent, removal of an unknown page), and counts it. After lost events a view
    may lack pages the worker holds or keep pages it removed; the router then asks the worker
    for a snapshot (`KVCleared` and the whole tree as `KVStored`, parents first), and applying
    it makes the worker's pages equal its tree again.
    """

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._rows = 0  # rows ever used (row 0: the root)
        self._live = 0  # live rows, the root not counted
        self._cols: dict[str, np.ndarray] = {
            name: np.empty(_MIN_ROWS, dtype) for name, dtype in _COLUMNS
        }
        self._free = array("i")  # a stack of free rows
        self._multi: dict[int, tuple[int, int]] = {}  # row -> (held, tomb) masks, 2+ holders
        self._num_pages: dict[int, int] = {}  # worker -> pages it holds
        self._bits: list[int] = []  # 1 << worker, one object per worker
        self._pairs: list[tuple[int, int]] = []  # at 2w + tomb: worker w's (held, tomb)
        self._used = 0  # table slots live or deleted (the same in both tables)
        self._tables = {"hash": np.full(_MIN_SLOTS, _EMPTY, np.int32)}
        self._tables["fp"] = self._tables["hash"].copy()
        self._views()
        root, self._rows = 0, 1
        self._hash[root] = self._fp[root] = 0
        self._parent[root] = self._child[root] = self._next[root] = self._prev[root] = -1
        self._depth[root], self._holder[root], self._tomb[root] = 0, _ROOT, 0

    def _views(self) -> None:
        """Memoryviews over the columns and tables: scalar reads and writes as Python ints,
        several times cheaper than indexing the arrays."""
        c = self._cols
        self._hash, self._fp = c["hash"].data, c["fp"].data
        self._parent, self._child = c["parent"].data, c["child"].data
        self._next, self._prev, self._depth = c["next"].data, c["prev"].data, c["depth"].data
        self._holder, self._tomb = c["holder"].data, c["tomb"].data
        self._slots = self._tables["hash"].size
        self._tab_hash = self._tables["hash"].data
        self._tab_fp = self._tables["fp"].data

    # ---- queries ----------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Distinct pages over all workers (a page several workers hold counts once)."""
        return self._live

    def num_pages(self, worker: int) -> int:
        return self._num_pages.get(worker, 0)

    def memory_bytes(self) -> int:
        """Bytes of the view's state: the rows in use, both tables, the free stack and the
        masks of pages that several workers hold."""
        shared = sum(m[0].__sizeof__() + m[1].__sizeof__() + 72 for m in self._multi.values())
        return (
            self._rows * ROW_BYTES
            + 2 * self._slots * 4
            + self._free.itemsize * len(self._free)
            + shared
            + len(self._multi) * 100  # the dict's slot, key and tuple
        )

    def pages(self, worker: int) -> dict[int, bool]:
        """Page hash -> tombstone, for every page `worker` holds."""
        holder = self._cols["holder"][: self._rows]
        rows = np.flatnonzero(holder == worker)
        out = dict(
            zip(
                self._cols["hash"][rows].tolist(),
                (self._cols["tomb"][rows] != 0).tolist(),
                strict=True,
            )
        )
        for row, (held, tomb) in self._multi.items():
            if held >> worker & 1:
                out[self._hash[row]] = bool(tomb >> worker & 1)
        return out

    def match(
        self,
        token_ids: Sequence[int],
        windows: Mapping[int, int],
        repair_tokens: Mapping[int, int] | None = None,
        chunk_sizes: Mapping[int, int] | None = None,
    ) -> dict[int, int]:
        """Tokens of `token_ids` (whole pages) that each worker of `windows` (worker -> its W)
        would skip: `prefix_reuse(runs, W, R, C).saved_tokens` over the pages it holds in a row
        from the root, R = `repair_tokens[worker]`, C = `chunk_sizes[worker]` (see
        `cache_view.match_runs`). A query: changes nothing."""
        return match_runs(
            self._prompt_runs(token_ids), self.page_size, windows, repair_tokens, chunk_sizes
        )

    def match_columns(
        self,
        token_ids: Sequence[int],
        members: int,
        windows: np.ndarray,
        repairs: np.ndarray,
        keys: list[int] | None = None,
        chunks: np.ndarray | None = None,
    ) -> np.ndarray:
        """`match` for the workers of the bit mask `members`, by worker (`walk_runs`);
        `keys`: `prompt_keys(token_ids)`, when the caller has them already."""
        runs = self.runs(self.prompt_keys(token_ids) if keys is None else keys)
        return walk_runs(runs, self.page_size, members, windows, repairs, chunks=chunks)

    def runs(self, keys: list[int]) -> list[tuple[int, int, int]]:
        """(held, tomb, pages) runs of the pages of fingerprints `keys` (a prompt's whole
        pages, `prompt_keys`) that the view holds in a chain from the root (`walk_runs`)."""
        return self._path(keys) if self._live and keys else []

    def prompt_keys(self, token_ids: Sequence[int]) -> list[int]:
        """The fingerprints of the whole pages of `token_ids`, as the view files them."""
        tokens = page_tokens(token_ids, self.page_size)
        return fingerprints(tokens, self.page_size) if tokens.size else []

    def holds(self, worker: int, key: int) -> bool:
        """Whether `worker` holds the page of fingerprint `key` (a tombstone too)."""
        row = self._find(self._tab_fp, self._fp, key)
        return row > 0 and self._holds(row, worker)

    def _prompt_runs(self, token_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """(held, tomb, pages) runs of the whole pages of `token_ids` the view holds (`_path`)."""
        return self.runs(self.prompt_keys(token_ids)) if self._live else []

    def _path(self, keys: list[int]) -> list[tuple[int, int, int]]:
        """(held, tomb, pages) runs of the pages of fingerprints `keys` from the root, as far as
        the view has them in a chain (`_runs`).

        A page is in the view only under its parent page, so the pages present are a prefix:
        a binary search finds its length k in log2(len) lookups, and the parent links from
        the k-th page's row up give every row of it. Should those rows not be the chain of
        `keys` (a fingerprint collision), the pages are looked up one by one instead."""
        tab, column = self._tab_fp, self._fp
        lo, hi = 0, len(keys)  # pages before lo are present, pages from hi on are not
        while lo < hi:
            mid = (lo + hi) // 2
            if self._find(tab, column, keys[mid]) >= 0:
                lo = mid + 1
            else:
                hi = mid
        if not lo:
            return []
        rows = [0] * lo
        row, parents = self._find(tab, column, keys[lo - 1]), self._parent
        for i in range(lo - 1, -1, -1):
            rows[i] = row
            row = parents[row]
        at = np.array(rows)
        if row != 0 or self._cols["fp"][at].tolist() != keys[:lo]:
            at = self._chain(keys)
        codes = (2 * self._cols["holder"][at] + self._cols["tomb"][at]).tolist()
        return self._runs(codes, at.tolist())

    def _runs(self, codes: list[int], rows: list[int]) -> list[tuple[int, int, int]]:
        """(held, tomb, pages) runs of pages with equal masks: `codes` 2 x holder + tomb (a
        shared page's is negative: its masks are in `_multi`)."""
        pairs, multi = self._pairs, self._multi
        runs, last, n = [], pairs[codes[0]] if codes[0] >= 0 else multi[rows[0]], 0
        for c, r in zip(codes, rows, strict=True):
            masks = pairs[c] if c >= 0 else multi[r]
            if masks is last or masks == last:
                n += 1
                continue
            runs.append((*last, n))
            last, n = masks, 1
        runs.append((*last, n))
        return runs

    def _chain(self, keys: list[int]) -> np.ndarray:
        """The rows of fingerprints `keys` from the root, each under the one before, looked up
        one by one."""
        rows, before = [], 0
        for key in keys:
            row = self._find(self._tab_fp, self._fp, key)
            if row < 0 or self._parent[row] != before:
                break
            rows.append(row)
            before = row
        return np.array(rows, np.int64)

    # ---- events -------------------------------------------------------------------------
    def apply(self, worker: int, events: Iterable[KVEvent]) -> int:
        """Apply `worker`'s events in order; returns how many did not fit the view."""
        self._bit(worker)
        mismatches = 0
        for event in events:
            if isinstance(event, KVStored):
                mismatches += self._store(worker, event)
            elif isinstance(event, KVRemoved):
                mismatches += self._remove(worker, event.page_hashes)
            elif isinstance(event, KVTombstoned | KVRevived):
                mismatches += self._mark(worker, event.page_hashes, isinstance(event, KVTombstoned))
            elif isinstance(event, KVCleared):
                self.drop(worker)
            else:
                raise TypeError(f"not a KV event: {event!r}")
        return mismatches

    def drop(self, worker: int) -> None:
        """Forget everything `worker` holds (restart, cache clear, lost events)."""
        holder = self._cols["holder"]
        for row, masks in list(self._multi.items()):
            if masks[0] >> worker & 1:
                self._release_shared(row, worker)
        rows = np.flatnonzero(holder[: self._rows] == worker)
        self._num_pages.pop(worker, None)
        if not rows.size:
            return
        # Pages only `worker` holds: their pages below are only its too, so they go as
        # subtrees; only the top of each is unlinked from a surviving parent.
        tops = rows[holder[self._cols["parent"][rows]] != worker]
        for row in tops.tolist():
            self._unlink(row)
        for name in ("hash", "fp"):
            self._table_delete(name, rows)
        holder[rows] = _FREE
        self._free.frombytes(rows.astype(np.int32).tobytes())
        self._live -= rows.size

    def _store(self, worker: int, event: KVStored) -> int:
        p, hashes = self.page_size, event.page_hashes
        if event.page_size != p or len(event.token_ids) < len(hashes) * p:
            return 1
        parent = 0 if event.parent_hash is None else self._find_hash(event.parent_hash)
        if parent < 0 or (parent > 0 and not self._holds(parent, worker)):
            return 1
        if not hashes:
            return 0
        tokens = page_tokens(event.token_ids[: len(hashes) * p], p)
        if tokens.size < len(hashes) * p:  # a token outside [0, 2^32)
            return 1
        if set(map(type, hashes)) != {int} or min(hashes) < 0 or max(hashes) >= _HASH_LIMIT:
            return 1
        fps = fingerprints(tokens, p, self._depth[parent] * p, self._fp[parent])
        mismatch, tomb = 0, event.swa_tombstone
        for i, fp in enumerate(fps):
            row = self._find(self._tab_fp, self._fp, fp)
            if row < 0:
                return mismatch | self._create(worker, parent, hashes[i:], fps[i:], tomb)
            if self._hash[row] != hashes[i] or self._parent[row] != parent:
                return 1  # other tokens under this hash, or a fingerprint collision
            if not self._hold(row, worker, tomb):
                mismatch = 1  # stored twice: taken as the new state
            parent = row
        return mismatch

    def _create(
        self, worker: int, parent: int, hashes: Sequence[int], fps: Sequence[int], tomb: bool
    ) -> int:
        """New rows for `hashes`, a chain under `parent`, held by `worker`; at the first hash
        or fingerprint already in the view (a repeat, or another chain's page) it stops and
        returns 1, the pages before it stored."""
        k = len(hashes)
        if self._used + k > _MAX_LOAD * self._slots:
            self._rebuild(self._live + k)
        fresh = k - len(self._free)
        if fresh > 0 and self._rows + fresh > self._cols["hash"].size:
            self._grow(self._rows + fresh)
        free, slot = self._free, self._free_slot
        tab_hash, tab_fp, hash_col, fp_col = self._tab_hash, self._tab_fp, self._hash, self._fp
        child, prev, nxt = self._child, self._prev, self._next
        depth = self._depth[parent] + 1
        made = 0
        for h, fp in zip(hashes, fps, strict=True):
            i, j = slot(tab_hash, hash_col, h), slot(tab_fp, fp_col, fp)
            if i < 0 or j < 0:
                break
            if free:
                row = free.pop()
            else:
                row, self._rows = self._rows, self._rows + 1
            tab_hash[i] = tab_fp[j] = row
            hash_col[row], fp_col[row], self._parent[row] = h, fp, parent
            child[row], prev[row], self._depth[row] = -1, -1, depth
            self._holder[row], self._tomb[row] = worker, tomb
            if made:
                nxt[row] = -1
            else:  # the chain's first page: at the head of its parent's children
                head = child[parent]
                nxt[row] = head
                if head >= 0:
                    prev[head] = row
            child[parent] = row
            parent, depth, made = row, depth + 1, made + 1
        self._used += made
        self._live += made
        self._num_pages[worker] = self._num_pages.get(worker, 0) + made
        return int(made < k)

    def _remove(self, worker: int, hashes: Sequence[int]) -> int:
        """Release pages (children first). A page that still has pages of `worker` below it
        takes them along, so a page is never held without its parent."""
        mismatch = 0
        for h in reversed(hashes):
            row = self._find_hash(h)
            if row <= 0 or not self._holds(row, worker):
                mismatch = 1
                continue
            if self._child[row] < 0:
                self._release(row, worker)
                continue
            below = self._held_subtree(row, worker)
            mismatch |= len(below) > 1
            for x in reversed(below):
                self._release(x, worker)
        return mismatch

    def _mark(self, worker: int, hashes: Sequence[int], tombstone: bool) -> int:
        mismatch = 0
        for h in hashes:
            row = self._find_hash(h)
            holder = self._holder[row] if row > 0 else _FREE
            if holder == worker:
                if bool(self._tomb[row]) == tombstone:
                    mismatch = 1
                else:
                    self._tomb[row] = tombstone
            elif holder == _MULTI and self._multi[row][0] >> worker & 1:
                held, tomb = self._multi[row]
                if bool(tomb >> worker & 1) == tombstone:
                    mismatch = 1
                else:
                    self._multi[row] = held, tomb ^ self._bits[worker]
            else:
                mismatch = 1
        return mismatch

    # ---- holders -------------------------------------------------------------------------
    def _bit(self, worker: int) -> int:
        if worker < 0:
            raise ValueError(f"worker bits are >= 0, got {worker}")
        while len(self._bits) <= worker:
            bit = 1 << len(self._bits)
            self._bits.append(bit)
            self._pairs += [(bit, 0), (bit, bit)]
        return self._bits[worker]

    def _holds(self, row: int, worker: int) -> bool:
        holder = self._holder[row]
        return holder == worker or (holder == _MULTI and bool(self._multi[row][0] >> worker & 1))

    def _hold(self, row: int, worker: int, tomb: bool) -> bool:
        """`worker` holds `row` (a tombstone or not); False if it already held it."""
        holder, bit = self._holder[row], self._bits[worker]
        if holder == worker:
            self._tomb[row] = tomb
            return False
        if holder >= 0:
            other = self._bits[holder]
            self._multi[row] = other | bit, (other if self._tomb[row] else 0) | (bit if tomb else 0)
            self._holder[row], self._tomb[row] = _MULTI, 0
        else:
            held, tombs = self._multi[row]
            self._multi[row] = held | bit, tombs | bit if tomb else tombs & ~bit
            if held & bit:
                return False
        self._num_pages[worker] = self._num_pages.get(worker, 0) + 1
        return True

    def _release(self, row: int, worker: int) -> None:
        """`worker` no longer holds `row` (it did; no page of its is left below)."""
        if self._holder[row] == worker:
            self._num_pages[worker] -= 1
            self._delete(row)
        else:
            self._release_shared(row, worker)

    def _release_shared(self, row: int, worker: int) -> None:
        self._num_pages[worker] -= 1
        bit = self._bits[worker]
        held, tomb = self._multi[row]
        held, tomb = held & ~bit, tomb & ~bit
        if held & (held - 1):
            self._multi[row] = held, tomb
            return
        del self._multi[row]
        self._holder[row] = held.bit_length() - 1
        self._tomb[row] = bool(tomb)

    def _held_subtree(self, row: int, worker: int) -> list[int]:
        """`row` and the pages below it that `worker` holds, parents before children."""
        out, stack = [], [row]
        while stack:
            x = stack.pop()
            out.append(x)
            child = self._child[x]
            while child >= 0:
                if self._holds(child, worker):
                    stack.append(child)
                child = self._next[child]
        return out

    # ---- rows ---------------------------------------------------------------------------
    def _grow(self, need: int) -> None:
        size = max(need, 2 * self._cols["hash"].size)
        for name, column in self._cols.items():
            grown = np.empty(size, column.dtype)  # untouched past the copy: not resident
            grown[: self._rows] = column[: self._rows]
            self._cols[name] = grown
        self._views()

    def _delete(self, row: int) -> None:
        """A row held by nobody, with no child, leaves the view."""
        self._unlink(row)
        slots = self._slots
        for tab, key in ((self._tab_hash, self._hash[row]), (self._tab_fp, self._fp[row])):
            i, step = key % slots, 1 + (key >> 32) % (slots - 1)
            while tab[i] != row:
                i += step
                if i >= slots:
                    i -= slots
            tab[i] = _DELETED
        self._holder[row] = _FREE
        self._free.append(row)
        self._live -= 1

    def _unlink(self, row: int) -> None:
        before, after = self._prev[row], self._next[row]
        if before >= 0:
            self._next[before] = after
        else:
            self._child[self._parent[row]] = after
        if after >= 0:
            self._prev[after] = before

    # ---- invariants -----------------------------------------------------------------------
    def check(self) -> None:
        """Raise `CacheViewCorrupted` on a broken invariant: the trie's links (each live row
        reached once from the root, parent, sibling and depth links agreeing), holders (a
        page held by someone, only where its parent is, tombstones only where held, shared
        masks of two or more), per-worker page counts, the free rows, and both tables naming
        each live row once, under its own key."""
        c = {name: column[: self._rows] for name, column in self._cols.items()}
        if c["holder"][0] != _ROOT or c["parent"][0] != -1 or c["depth"][0] != 0:
            raise CacheViewCorrupted("row 0 is not the root")
        seen = np.zeros(self._rows, bool)
        counts: dict[int, int] = {}
        stack = [0]
        while stack:
            parent = stack.pop()
            child, before = self._child[parent], -1
            while child >= 0:
                if child >= self._rows or seen[child]:
                    raise CacheViewCorrupted(f"row {child} is reached twice or is not a row")
                seen[child] = True
                if self._parent[child] != parent or self._prev[child] != before:
                    raise CacheViewCorrupted(f"row {child}'s parent or sibling links disagree")
                if self._depth[child] != self._depth[parent] + 1:
                    raise CacheViewCorrupted(f"row {child} is not one deeper than its parent")
                held, tomb = self._masks_of(child)
                if not held or tomb & ~held:
                    raise CacheViewCorrupted(f"row {child} is held by nobody or a tombstone unheld")
                if parent and held & ~self._masks_of(parent)[0]:
                    raise CacheViewCorrupted(f"row {child} is held where its parent is not")
                for w in range(held.bit_length()):
                    if held >> w & 1:
                        counts[w] = counts.get(w, 0) + 1
                stack.append(child)
                before, child = child, self._next[child]
        live = np.flatnonzero(c["holder"] != _FREE)[1:]
        if not seen[live].all() or seen.sum() != live.size or live.size != self._live:
            raise CacheViewCorrupted(f"{self._live} live rows counted, {seen.sum()} reached")
        if set(self._multi) != set(np.flatnonzero(c["holder"] == _MULTI).tolist()):
            raise CacheViewCorrupted("shared masks are kept for rows that are not shared")
        if {w: n for w, n in self._num_pages.items() if n} != counts:
            raise CacheViewCorrupted(f"page counts {self._num_pages} differ from the rows {counts}")
        free = np.frombuffer(self._free, np.int32) if self._free else np.empty(0, np.int32)
        if free.size + live.size + 1 != self._rows or (c["holder"][free] != _FREE).any():
            raise CacheViewCorrupted("the free stack does not name each free row once")
        for name, tab in self._tables.items():
            named = np.sort(tab[tab >= 0])
            if named.size != live.size or (named != live).any():
                raise CacheViewCorrupted(f"the {name} table does not name each live row once")
            if (tab != _EMPTY).sum() != self._used:
                raise CacheViewCorrupted(f"the {name} table's used slots are miscounted")
            if live.size and (self._lookup(name, c[name][live]) != live).any():
                raise CacheViewCorrupted(f"a row is not found under its own {name}")

    def _masks_of(self, row: int) -> tuple[int, int]:
        holder = self._holder[row]
        if holder >= 0:
            bit = 1 << holder
            return bit, bit if self._tomb[row] else 0
        if holder == _MULTI:
            held, tomb = self._multi[row]
            if held & (held - 1) == 0:
                raise CacheViewCorrupted(f"row {row} keeps shared masks for one holder")
            return held, tomb
        return 0, 0
