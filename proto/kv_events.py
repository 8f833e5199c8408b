"""KV events: what a worker's prefix cache stored, removed, tombstoned or revived, per page.

A router mirrors each worker's radix tree from these events (the router's `ExactCacheView`;
`bench/kv_event_mirror.py` is the one-tree reference that tests and `bench/router_sim.py`
check it against) to route requests to the worker that already holds their prefix. A page (P token ids) is named by a hash chained
from its parent page, so equal token prefixes give equal hashes in every process:

    page_hash(parent, tokens) = blake2b-64( tag(parent) ‖ int64-le(tokens) )

`tag(None) = b"\\x00"` for a page at the root, `b"\\x01" ‖ parent as 8 bytes` otherwise. Python's
`hash()` is never used (it is salted per process).

Plain dataclasses, standard library only (no torch): these cross process boundaries.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass


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
