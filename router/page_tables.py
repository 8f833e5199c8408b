"""The exact view's two open-addressing tables and its page fingerprints (`ExactCacheView`,
`exact_view.py`, keeps the trie's rows; this is how a row is found).

Both tables hold int32 row numbers in a prime number of slots, probed by double hashing: slot
key mod n, step 1 + (key >> 32) mod (n - 1). One files rows by page hash (events name pages
by hash), the other by prefix fingerprint (`fingerprints`: a route computes its prompt's in a
few numpy operations). Deleted slots are marked; both tables are rebuilt, vectorized, to half
load when live and deleted slots pass 4/5.
"""

from __future__ import annotations

import numpy as np

from swaserve.router.cache_view import CacheViewCorrupted

_EMPTY, _DELETED = -1, -2  # table slots
_FREE = -1  # the holder of a free row (`exact_view`)
_MAX_LOAD, _REBUILD_LOAD = 0.8, 0.5
_MIN_SLOTS = 1031
_U = np.uint64


def _is_prime(n: int) -> bool:
    """Miller-Rabin with the first 12 primes as bases: exact below 3.3 * 10^24."""
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n < 2:
        return False
    for b in bases:
        if n % b == 0:
            return n == b
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for b in bases:
        x = pow(b, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _prime_at_least(n: int) -> int:
    n |= 1
    while not _is_prime(n):
        n += 2
    return n


_GOLDEN, _M1, _M2 = _U(0x9E3779B97F4A7C15), _U(0xBF58476D1CE4E5B9), _U(0x94D049BB133111EB)
_S30, _S27, _S31, _ONE = _U(30), _U(27), _U(31), _U(1)
_MASK = (1 << 64) - 1
_NUMPY_PAGES = 16  # fingerprints of more pages than this are mixed in numpy


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise and in place on uint64 (a bijection; wraps)."""
    x += _GOLDEN
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


_weights = np.zeros(0, np.uint64)  # one odd 64-bit weight per token position


def fingerprints(tokens: np.ndarray, page_size: int, start: int = 0, base: int = 0) -> list[int]:
    """The prefix fingerprint of each whole page of `tokens` (`page_tokens`), the first
    token at position `start` under a parent of fingerprint `base`: `base` plus, per page so
    far, mix(sum of token x weight[position]) (uint64, wrapping). Past the per-page sums,
    a few pages (an event's) are mixed in Python: cheaper than numpy's per-call cost."""
    global _weights
    end = start + tokens.size
    if end > _weights.size:
        _weights = _mix(np.arange(max(end, 2 * _weights.size, 4096), dtype=np.uint64)) | _ONE
    x = tokens.astype(np.uint64)
    x *= _weights[start:end]
    sums = x.reshape(-1, page_size).sum(axis=1, dtype=np.uint64)
    if sums.size > _NUMPY_PAGES:
        fps = _mix(sums).cumsum()
        if base:
            fps += _U(base)
        return fps.tolist()
    out, acc = [], base
    for v in sums.tolist():
        v = (v + 0x9E3779B97F4A7C15) & _MASK
        v = ((v ^ v >> 30) * 0xBF58476D1CE4E5B9) & _MASK
        v = ((v ^ v >> 27) * 0x94D049BB133111EB) & _MASK
        acc = (acc + (v ^ v >> 31)) & _MASK
        out.append(acc)
    return out


class PageTables:
    """Finding a row by page hash or fingerprint. The subclass owns the state these methods
    read: `_tables` (name -> int32 slots), `_cols` (name -> column), `_slots`, `_rows`,
    `_used`, the memoryviews `_tab_hash` / `_hash`, and `_views()` (which refreshes them)."""

    _tables: dict[str, np.ndarray]
    _cols: dict[str, np.ndarray]
    _slots: int
    _rows: int
    _used: int
    _tab_hash: memoryview
    _hash: memoryview

    def _views(self) -> None:
        raise NotImplementedError

    def _find_hash(self, key: int) -> int:
        """The row of page hash `key`, or -1."""
        return self._find(self._tab_hash, self._hash, key)

    def _find(self, tab: memoryview, keys: memoryview, key: int) -> int:
        """The row filed under `key` in table `tab` (`keys`: its column), or -1."""
        slots = self._slots
        i = key % slots
        row = tab[i]
        if row == _EMPTY or (row >= 0 and keys[row] == key):
            return row
        step = 1 + (key >> 32) % (slots - 1)
        while True:
            i += step
            if i >= slots:
                i -= slots
            row = tab[i]
            if row == _EMPTY or (row >= 0 and keys[row] == key):
                return row

    def _free_slot(self, tab: memoryview, keys: memoryview, key: int) -> int:
        """The first empty slot of `key`'s probe sequence in `tab`, or -1 if `key` is filed
        there already (`keys`: the table's column)."""
        slots = self._slots
        i = key % slots
        row = tab[i]
        if row == _EMPTY:
            return i
        step = 1 + (key >> 32) % (slots - 1)
        while True:
            if row >= 0 and keys[row] == key:
                return -1
            i += step
            if i >= slots:
                i -= slots
            row = tab[i]
            if row == _EMPTY:
                return i

    @staticmethod
    def _probes(keys: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
        """Each key's first slot and step."""
        n = _U(slots)
        return (keys % n).astype(np.int64), (_U(1) + (keys >> _U(32)) % (n - _U(1))).astype(
            np.int64
        )

    def _lookup(self, name: str, keys: np.ndarray) -> np.ndarray:
        """The row of each key in table `name` (-1 where absent), all keys at once."""
        tab, column, slots = self._tables[name], self._cols[name], self._slots
        out = np.full(keys.size, -1, np.int64)
        todo = np.arange(keys.size)
        at, step = self._probes(keys, slots)
        while todo.size:
            rows = tab[at]
            hit = rows >= 0
            hit[hit] = column[rows[hit]] == keys[todo[hit]]
            out[todo[hit]] = rows[hit]
            more = (rows != _EMPTY) & ~hit
            todo, step = todo[more], step[more]
            at = (at[more] + step) % slots
        return out

    def _table_place(self, tab: np.ndarray, keys: np.ndarray, rows: np.ndarray) -> None:
        """File `rows` (absent from `tab`) under `keys`, each in the first empty slot of its
        probe sequence; rows that aim at one slot in the same round take turns."""
        slots = tab.size
        at, step = self._probes(keys, slots)
        while rows.size:
            empty = tab[at] == _EMPTY
            tab[at[empty]] = rows[empty]
            placed = np.zeros(rows.size, bool)
            placed[empty] = tab[at[empty]] == rows[empty]
            rows, step = rows[~placed], step[~placed]
            at = (at[~placed] + step) % slots

    def _table_delete(self, name: str, rows: np.ndarray) -> None:
        tab, slots = self._tables[name], self._slots
        at, step = self._probes(self._cols[name][rows], slots)
        while rows.size:
            seen = tab[at]
            if (seen == _EMPTY).any():
                raise CacheViewCorrupted(f"a live row is missing from the {name} table")
            hit = seen == rows
            tab[at[hit]] = _DELETED
            rows, step = rows[~hit], step[~hit]
            at = (at[~hit] + step) % slots

    def _rebuild(self, live: int) -> None:
        """Both tables anew, sized for `live` rows at half load, deleted slots gone."""
        slots = _prime_at_least(max(_MIN_SLOTS, int(live / _REBUILD_LOAD)))
        rows = np.flatnonzero(self._cols["holder"][1 : self._rows] != _FREE) + 1
        for name in ("hash", "fp"):
            tab = np.full(slots, _EMPTY, np.int32)
            self._table_place(tab, self._cols[name][rows], rows)
            self._tables[name] = tab
        self._used = rows.size
        self._views()
