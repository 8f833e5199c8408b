"""KV events: what a worker's prefix cache stored, removed, tombstoned or revived, per page.

A router mirrors each worker's radix tree from these events (the router's `ExactCacheView`;
`KVEventMirror` here is the one-tree reference that tests and `bench/router_sim.py` check it
against) to route requests to the worker that already holds their prefix. A page (P token ids) is named by a hash chained
from its parent page, so equal token prefixes give equal hashes in every process:

    page_hash(parent, tokens) = blake2b-64( tag(parent) ‖ int64-le(tokens) )

`tag(None) = b"\\x00"` for a page at the root, `b"\\x01" ‖ parent as 8 bytes` otherwise. Python's
`hash()` is never used (it is salted per process).

Plain dataclasses, standard library only (no torch): these cross process boundaries.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from swaserve.proto.kv_rules import prefix_reuse


def page_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """64-bit hash of one page of `token_ids` whose parent page hashes to `parent_hash`
    (None for the first page of a sequence)."""
    return _digest(parent_hash, struct.pack(f"<{len(token_ids)}q", *token_ids))


def page_hashes(
    token_ids: Sequence[int], page_size: int, parent_hash: int | None = None
) -> list[int]:
    """Chained hashes of the whole pages of `token_ids` (a trailing partial page is ignored)."""
    num_tokens = len(token_ids) // page_size * page_size
    data = struct.pack(f"<{num_tokens}q", *token_ids[:num_tokens])
    step = 8 * page_size
    hashes = []
    for start in range(0, len(data), step):
        parent_hash = _digest(parent_hash, data[start : start + step])
        hashes.append(parent_hash)
    return hashes


def _digest(parent_hash: int | None, page: bytes) -> int:
    tag = b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(tag + page, digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class KVStored:
    """New pages, a chain under `parent_hash` (None: under the root). `swa_tombstone`: stored
    with full KV only (their SWA KV was already freed)."""

    page_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    page_size: int
    swa_tombstone: bool = False


@dataclass(frozen=True, slots=True)
class KVRemoved:
    """Pages whose full (and SWA) KV was freed; they left the cache."""

    page_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVTombstoned:
    """Pages whose SWA KV was freed; their full KV stays cached."""

    page_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVRevived:
    """Tombstoned pages that hold SWA KV again."""

    page_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVCleared:
    """The whole cache was dropped."""


KVEvent = KVStored | KVRemoved | KVTombstoned | KVRevived | KVCleared


class KVEventMismatch(ValueError):
    """An event does not fit the mirrored state (lost or reordered events)."""


class KVEventMirror:
    """The set of cached pages of one worker, rebuilt from its events.

    `pages[h]` is True when page `h` is a tombstone (full KV only). `apply` raises
    `KVEventMismatch` on an event that contradicts the state; the state is then unchanged.
    """

    def __init__(self) -> None:
        self.pages: dict[int, bool] = {}

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply_one(event)

    def apply_one(self, event: KVEvent) -> None:
        if isinstance(event, KVCleared):
            self.pages.clear()
        elif isinstance(event, KVStored):
            self._expect(event.page_hashes, present=False, what="stored")
            if event.parent_hash is not None and event.parent_hash not in self.pages:
                raise KVEventMismatch(f"stored pages under unknown parent {event.parent_hash:#x}")
            for h in event.page_hashes:
                self.pages[h] = event.swa_tombstone
        elif isinstance(event, KVRemoved):
            self._expect(event.page_hashes, present=True, what="removed")
            for h in event.page_hashes:
                del self.pages[h]
        else:
            tombstone = isinstance(event, KVTombstoned)
            self._expect(event.page_hashes, present=True, what=type(event).__name__)
            if any(self.pages[h] == tombstone for h in event.page_hashes):
                raise KVEventMismatch(f"{type(event).__name__}: a page is already in that state")
            for h in event.page_hashes:
                self.pages[h] = tombstone

    def match_length(
        self,
        token_ids: Sequence[int],
        page_size: int,
        sliding_window_size: int,
        repair_tokens: int = 0,
    ) -> int:
        """Tokens of `token_ids` a worker would skip (`prefix_reuse(...).saved_tokens`): the
        longest cached run of whole pages, cut back to the last end that has
        `sliding_window_size` live tokens before it (or no tombstone at all before it); with
        `repair_tokens` R > 0, the whole run less R where that saves more."""
        runs = []
        for h in page_hashes(token_ids, page_size):
            tombstone = self.pages.get(h)
            if tombstone is None:
                break
            runs.append((page_size, tombstone))
        return prefix_reuse(runs, sliding_window_size, repair_tokens).saved_tokens

    def _expect(self, hashes: Sequence[int], *, present: bool, what: str) -> None:
        for h in hashes:
            if (h in self.pages) != present:
                state = "unknown" if present else "already cached"
                raise KVEventMismatch(f"{what}: page {h:#x} is {state}")
