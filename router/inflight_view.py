"""Prompts routed to event-sending workers that their reports do not show cached yet.

A worker caches a prompt's whole pages when its prefill ends, and the router learns of it
from the KV events of a later report. Until then a second request with the same prefix (a
fan-out sibling, a retried prompt) would see a cold worker in the exact view and go anywhere,
although the worker that is computing the prefix now will hold it by the time it admits the
sibling (it admits in order, after the prefill before it). `InflightPrompts` holds those
prompts, by worker bit, as the page fingerprints of the exact view (`fingerprints`), and the
router counts their pages as hits on that worker next to the exact view's. A hit here has all
of its SWA KV: the prompt is fresh in the tree when the sibling is admitted.

A record leaves when the exact view holds its last page for that worker (the events arrived:
the view knows better now, tombstones included), when its request ends without having run
(cancelled), or `expiry_s` after its request finished (its prompt was cached and evicted
before a report showed it, or was never cached: the record must not claim it forever).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from swaserve.router.cache_view import CacheViewCorrupted
from swaserve.router.window_walk import mask_bits


@dataclass(slots=True)
class _Record:
    worker: int
    keys: list[int]  # the fingerprints of the prompt's whole pages, from the first
    finished_s: float | None = None  # when its request ended on the worker


class InflightPrompts:
    """Prompts in flight per worker bit (see the module docstring)."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._records: dict[str, _Record] = {}  # request id -> record
        self._by_worker: dict[int, dict[str, _Record]] = {}
        self._mask: dict[int, int] = {}  # fingerprint -> bits of the workers holding it
        # (fingerprint, worker) -> records past the first, for pages several records of one
        # worker hold (a page one record holds is only its bit in `_mask`)
        self._extra: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def add(self, request_id: str, worker: int, keys: list[int]) -> None:
        """`worker` will cache the pages of fingerprints `keys` (a prompt's whole pages)."""
        if request_id in self._records:
            raise ValueError(f"request {request_id!r} already has a prompt in flight")
        if not keys:
            return
        record = _Record(worker, keys)
        self._records[request_id] = record
        self._by_worker.setdefault(worker, {})[request_id] = record
        bit, mask, extra = 1 << worker, self._mask, self._extra
        for key in keys:
            m = mask.get(key, 0)
            if m & bit:
                extra[key, worker] = extra.get((key, worker), 0) + 1
            else:
                mask[key] = m | bit

    def remove(self, request_id: str) -> None:
        """Forget `request_id`'s prompt (no-op if it has none)."""
        record = self._records.pop(request_id, None)
        if record is None:
            return
        mine = self._by_worker[record.worker]
        del mine[request_id]
        if not mine:
            del self._by_worker[record.worker]
        worker, clear, masks, extra = record.worker, ~(1 << record.worker), self._mask, self._extra
        for key in record.keys:
            n = extra.pop((key, worker), 0) if extra else 0
            if n > 1:
                extra[key, worker] = n - 1
            elif n:
                continue
            elif mask := masks[key] & clear:
                masks[key] = mask
            else:
                del masks[key]

    def finished(self, request_id: str, now_s: float) -> None:
        """`request_id` ended on its worker after running: its record expires from now."""
        record = self._records.get(request_id)
        if record is not None:
            record.finished_s = now_s

    def settle(
        self, worker: int, cached: Callable[[int], bool], now_s: float, expiry_s: float
    ) -> None:
        """After a report of `worker`: drop its records whose last page `cached(fingerprint)`
        says the exact view holds for it, and those finished `expiry_s` or more ago."""
        mine = self._by_worker.get(worker)
        if not mine:
            return
        done = [
            rid
            for rid, r in mine.items()
            if cached(r.keys[-1]) or (r.finished_s is not None and now_s - r.finished_s >= expiry_s)
        ]
        for rid in done:
            self.remove(rid)

    def drop(self, worker: int) -> None:
        """Forget every record of `worker` (it left, or restarted with an empty cache)."""
        for rid in list(self._by_worker.get(worker, ())):
            self.remove(rid)

    def match_columns(self, keys: Sequence[int], members: int, capacity: int) -> np.ndarray:
        """By worker bit (of the mask `members`), the tokens of the pages of fingerprints
        `keys` (a prompt's whole pages, from the first) that the worker's records hold in a
        row from the first page. One walk for all workers, as bit masks: the workers still
        holding every page so far narrow at each page, and a worker's run ends where it
        leaves them."""
        hits = np.zeros(capacity, np.int64)
        if not keys or not self._mask:
            return hits
        get, p = self._mask.get, self.page_size
        alive = members
        for i, key in enumerate(keys):
            held = get(key, 0) & alive
            if held != alive:
                if gone := alive & ~held:
                    hits[mask_bits(gone)] = i * p
                alive = held
                if not alive:
                    return hits
        hits[mask_bits(alive)] = len(keys) * p
        return hits

    def check(self, owner: Callable[[str], int | None]) -> None:
        """Raise `CacheViewCorrupted` when the masks and counts are not those of the records,
        or a record of a request that has not finished is not on its worker (`owner(request
        id)`: the bit of the worker the router has it in flight on, None if none)."""
        count: dict[tuple[int, int], int] = {}
        for rid, r in self._records.items():
            if self._by_worker.get(r.worker, {}).get(rid) is not r:
                raise CacheViewCorrupted(f"record {rid!r} is not listed under its worker")
            if r.finished_s is None and owner(rid) != r.worker:
                raise CacheViewCorrupted(f"request {rid!r} is in flight elsewhere or not at all")
            for key in r.keys:
                count[key, r.worker] = count.get((key, r.worker), 0) + 1
        if sum(map(len, self._by_worker.values())) != len(self._records) or any(
            not m for m in self._by_worker.values()
        ):
            raise CacheViewCorrupted("the per-worker lists differ from the records")
        mask: dict[int, int] = {}
        for key, worker in count:
            mask[key] = mask.get(key, 0) | 1 << worker
        extra = {kw: n - 1 for kw, n in count.items() if n > 1}
        if extra != self._extra or mask != self._mask:
            raise CacheViewCorrupted("page masks or counts differ from the records")
