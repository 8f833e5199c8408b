"""The SWA radix tree's nodes and their bookkeeping (`RadixNode`, `RadixTree`), the records it
hands out (`LockHandle`, `MatchResult`, `PrefixLock`) and its integrity check (`check_tree`).

The cache policy on top (match rule, insert, eviction, locks) is `SWARadixCache`."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from swaserve.proto.kv_events import KVCleared, KVEvent, KVRemoved, KVStored, page_hashes
from swaserve.worker.kv.allocator import SWATokenAllocator
from swaserve.worker.kv.errors import KVError

ChildKey = int | tuple[int, ...]
"""A child's first token (P = 1) or first page of tokens (P > 1)."""

_node_ids = itertools.count(1)


class RadixNode:
    """One edge of the tree: a page-aligned run of tokens and their full slot ids.

    `tombstone`: the SWA KV of the run was freed, its full KV stays. `hollow` (pure-SWA cache
    only): a tombstone that gave its full slots back too; `value` then holds padding slot 0.
    `checkpoint`: a live run inside the window before a resume point (a prompt's end, a
    sequence's end, a branch point), kept when the rest is tombstoned and evicted last.
    `full_lock` counts the locks that pass through the node (they run to the root); `swa_lock`
    those whose SWA window covers it, so `full_lock >= swa_lock`. `lock_id` names the topmost
    node of SWA locks that stop here (see `LockHandle`).
    """

    __slots__ = (
        "checkpoint",
        "children",
        "full_lock",
        "hollow",
        "id",
        "key",
        "lock_id",
        "page_hashes",
        "parent",
        "swa_lock",
        "tombstone",
        "value",
    )

    def __init__(
        self,
        key: list[int],
        value: torch.Tensor,
        parent: RadixNode | None,
        *,
        tombstone: bool = False,
        page_hashes: list[int] | None = None,
    ) -> None:
        self.id = next(_node_ids)
        self.key = key
        self.value = value  # [len(key)] int64 full slot ids
        self.parent: RadixNode | None = parent  # None: the root, or a removed node
        self.children: dict[ChildKey, RadixNode] = {}
        self.tombstone = tombstone
        self.hollow = False
        self.checkpoint = False
        self.full_lock = 0
        self.swa_lock = 0
        self.lock_id: int | None = None
        self.page_hashes = page_hashes if page_hashes is not None else []

    @property
    def full_slots(self) -> int:
        """Full slots this node holds (0 when hollow)."""
        return 0 if self.hollow else len(self.key)

    @property
    def swa_slots(self) -> int:
        """SWA slots this node holds (0 when a tombstone)."""
        return 0 if self.tombstone else len(self.key)

    def __repr__(self) -> str:
        flags = "T" if self.tombstone else "L"
        flags += "H" if self.hollow else ""
        flags += "C" if self.checkpoint else ""
        return (
            f"RadixNode(id={self.id}, key={self.key[:8]}{'...' if len(self.key) > 8 else ''}, "
            f"{flags}, full_lock={self.full_lock}, swa_lock={self.swa_lock})"
        )


@dataclass(frozen=True, slots=True)
class LockHandle:
    """What `inc_lock_ref` hands back and `dec_lock_ref` needs.

    `holds_swa`: the lock took SWA locks at all. `swa_lock_id`: `lock_id` of the topmost
    SWA-locked node, or None when the SWA part runs up to the root. An id (not a node) because
    a split moves the top of a lock to the new upper node.
    """

    holds_swa: bool
    swa_lock_id: int | None


@dataclass(frozen=True, slots=True)
class MatchResult:
    """`indices`: full slot ids of the reused prefix ([n] int64, tombstones included);
    `last_node`: the node that ends it (the root when nothing matched). The indices stay
    valid while `last_node` is locked (`inc_lock_ref`). `repair_len` > 0: a window repair —
    the last `repair_len` positions have full KV but their SWA KV must be recomputed
    (architecture §6), so the match saves `saved_tokens` = n - repair_len."""

    indices: torch.Tensor
    last_node: RadixNode
    repair_len: int = 0

    @property
    def saved_tokens(self) -> int:
        return self.indices.numel() - self.repair_len


@dataclass(slots=True)
class PrefixLock:
    """A running request's hold on the tree: the node its cached prefix ends at, the lock
    handle, and whether the SWA part was already released (`release_request_swa`)."""

    node: RadixNode
    handle: LockHandle
    swa_released: bool = False


class RadixTree:
    """Nodes and their bookkeeping: LRUs (full: every node, oldest first; SWA: live nodes, the
    checkpoints in an LRU of their own so that eviction takes them last),
    size counters, page hashes and events, and frees batched until `_flush`. The cache policy
    (matching, insert, eviction, locks) is `SWARadixCache`.
    """

    hollow_tombstones = False
    """Pure-SWA variant only: unlocked tombstones give their full slots back too."""

    def __init__(
        self, allocator: SWATokenAllocator, page_size: int, *, enable_kv_events: bool = True
    ) -> None:
        if page_size != allocator.page_size:
            raise ValueError(
                f"page_size={page_size} differs from the allocator's {allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.enable_kv_events = enable_kv_events
        self._events: list[KVEvent] = []
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = RadixNode([], torch.empty(0, dtype=torch.int64), None)  # [0] int64
        self._full_lru: OrderedDict[RadixNode, None] = OrderedDict()  # oldest first
        self._swa_lru: OrderedDict[RadixNode, None] = OrderedDict()  # live, not checkpoints
        self._ckpt_lru: OrderedDict[RadixNode, None] = OrderedDict()  # live checkpoints
        self._full_evictable = self._full_protected = 0
        self._swa_evictable = self._swa_protected = 0
        self._pending_full: list[torch.Tensor] = []  # freed (full + SWA) at the end of the call
        self._pending_swa: list[torch.Tensor] = []  # SWA only

    def full_evictable_size(self) -> int:
        return self._full_evictable

    def swa_evictable_size(self) -> int:
        return self._swa_evictable

    def full_protected_size(self) -> int:
        return self._full_protected

    def swa_protected_size(self) -> int:
        return self._swa_protected

    def total_size(self) -> tuple[int, int]:
        """(full slots, SWA slots) the tree holds."""
        return (
            self._full_evictable + self._full_protected,
            self._swa_evictable + self._swa_protected,
        )

    def cached_indices(self) -> torch.Tensor:
        """Every full slot the tree holds ([n] int64), for `allocator.check(owned=...)`."""
        return self._values([n for n in self._nodes() if not n.hollow])

    def take_events(self) -> list[KVEvent]:
        """KV events since the last call, oldest first (empty when events are disabled)."""
        events, self._events = self._events, []
        return events

    def snapshot_events(self) -> list[KVEvent]:
        """The whole tree as events, for a router that lost track: `KVCleared`, then one
        `KVStored` per node, parents before children (`swa_tombstone` for a tombstone). On any
        view they build what every event so far built: the same pages, page hashes and
        tombstones (a split is invisible in events). A query: the events not yet taken stay
        (the caller drops them, see `Engine.kv_snapshot_events`). Empty when events are
        disabled."""
        if not self.enable_kv_events:
            return []
        events: list[KVEvent] = [KVCleared()]
        for node in self._nodes():
            assert node.parent is not None  # nodes in the tree hang under a parent
            parent_hash = node.parent.page_hashes[-1] if node.parent.page_hashes else None
            events.append(
                KVStored(
                    tuple(node.page_hashes),
                    parent_hash,
                    tuple(node.key),
                    self.page_size,
                    node.tombstone,
                )
            )
        return events

    def check(self) -> None:
        """Raise `RadixCacheCorrupted` on a broken invariant (architecture §6): structure, page
        alignment, lock counts, tombstone leaves, LRU membership, size counters, page hashes,
        and agreement with the allocator (slots owned once, live ⇔ mapped to an SWA slot)."""
        check_tree(self)

    def _child_key(self, key: list[int], start: int) -> ChildKey:
        return key[start] if self.page_size == 1 else tuple(key[start : start + self.page_size])

    def _common_len(self, node_key: list[int], key: list[int], start: int, end: int) -> int:
        """Length of the common prefix of `node_key` and `key[start:end]`, floored to pages."""
        n = min(len(node_key), end - start)
        if node_key[:n] != key[start : start + n]:
            n = next(i for i in range(n) if node_key[i] != key[start + i])
        return n // self.page_size * self.page_size

    def _values(self, nodes: list[RadixNode]) -> torch.Tensor:
        if not nodes:
            return torch.empty(0, dtype=torch.int64)  # [0] int64
        return torch.cat([x.value for x in nodes])  # [sum len] int64

    def _nodes(self) -> list[RadixNode]:
        """Every node but the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _live_lru(self, node: RadixNode) -> OrderedDict[RadixNode, None]:
        """The SWA LRU a live node sits in."""
        return self._ckpt_lru if node.checkpoint else self._swa_lru

    def _touch_one(self, node: RadixNode) -> None:
        self._full_lru.move_to_end(node)
        if not node.tombstone:
            self._live_lru(node).move_to_end(node)

    def _touch(self, node: RadixNode) -> None:
        """Make `node` and its ancestors most recent, children more recent than parents."""
        for x in reversed(list(self._up(node))):
            self._touch_one(x)

    @staticmethod
    def _up(node: RadixNode) -> Iterator[RadixNode]:
        """`node` and its ancestors below the root, bottom-up."""
        while node.parent is not None:
            yield node
            node = node.parent

    def _split(self, node: RadixNode, length: int) -> RadixNode:
        """Cut `node` after `length` tokens; returns the new upper part (locks and flags are
        copied, the lock id moves up); `node` keeps the rest and its children."""
        parent = node.parent
        assert parent is not None, "the root is never split"
        pages = length // self.page_size
        upper = RadixNode(
            node.key[:length],
            node.value[:length].clone(),
            parent,
            tombstone=node.tombstone,
            page_hashes=node.page_hashes[:pages],
        )
        upper.hollow, upper.full_lock, upper.swa_lock = node.hollow, node.full_lock, node.swa_lock
        upper.checkpoint = node.checkpoint
        upper.lock_id, node.lock_id = node.lock_id, None
        node.key, node.value = node.key[length:], node.value[length:].clone()
        node.page_hashes = node.page_hashes[pages:]
        parent.children[self._child_key(upper.key, 0)] = upper
        upper.children[self._child_key(node.key, 0)] = node
        node.parent = upper
        self._full_lru[upper] = None
        self._full_lru.move_to_end(node)
        if not node.tombstone:
            lru = self._live_lru(node)
            lru[upper] = None
            lru.move_to_end(node)
        return upper

    def _add_child(
        self, parent: RadixNode, key: list[int], value: torch.Tensor, tombstone: bool
    ) -> RadixNode:
        hashes: list[int] = []
        parent_hash = parent.page_hashes[-1] if parent.page_hashes else None
        if self.enable_kv_events:
            hashes = page_hashes(key, self.page_size, parent_hash)
        node = RadixNode(key, value.clone(), parent, tombstone=tombstone, page_hashes=hashes)
        parent.children[self._child_key(key, 0)] = node
        self._full_lru[node] = None
        self._full_evictable += len(key)
        if not tombstone:
            self._swa_lru[node] = None
            self._swa_evictable += len(key)
        self._emit(KVStored(tuple(hashes), parent_hash, tuple(key), self.page_size, tombstone))
        return node

    def _remove_leaf(self, leaf: RadixNode) -> tuple[int, int]:
        """Remove an unlocked leaf and then every tombstone parent left an unlocked leaf;
        returns (full, SWA) slots freed."""
        full = swa = 0
        node = leaf
        while True:
            parent = node.parent
            assert parent is not None and node.full_lock == 0 and not node.children
            full, swa = full + node.full_slots, swa + node.swa_slots
            del parent.children[self._child_key(node.key, 0)]
            del self._full_lru[node]
            self._full_evictable -= node.full_slots
            if not node.tombstone:
                del self._live_lru(node)[node]
                self._swa_evictable -= len(node.key)
            if not node.hollow:
                self._pending_full.append(node.value)
            node.parent = None
            self._emit(KVRemoved(tuple(node.page_hashes)))
            if parent is self.root or parent.children or not parent.tombstone or parent.full_lock:
                return full, swa
            node = parent

    def _account_full(self, node: RadixNode, delta: int) -> None:
        if node.full_lock:
            self._full_protected += delta
        else:
            self._full_evictable += delta

    def _flush(self) -> None:
        if self._pending_swa:
            self.allocator.free_swa(torch.cat(self._pending_swa))
            self._pending_swa.clear()
        if self._pending_full:
            self.allocator.free(torch.cat(self._pending_full))
            self._pending_full.clear()

    def _emit(self, event: KVEvent) -> None:
        if self.enable_kv_events:
            self._events.append(event)


class RadixCacheCorrupted(KVError, AssertionError):
    """`SWARadixCache.check()` found a broken tree invariant."""


def check_tree(cache: RadixTree) -> None:
    """Raise `RadixCacheCorrupted` on the first broken invariant of `cache` (see its `check`)."""
    root = cache.root
    if (
        root.key
        or root.parent is not None
        or root in cache._full_lru
        or root in cache._swa_lru
        or root in cache._ckpt_lru
    ):
        raise RadixCacheCorrupted("the root has a key or a parent, or sits in an LRU")
    sizes = [0, 0, 0, 0]  # full evictable, full protected, SWA evictable, SWA protected
    live: list[torch.Tensor] = []
    tombstones: list[torch.Tensor] = []
    num_nodes = num_live = 0
    stack = [root]
    while stack:
        parent = stack.pop()
        for child_key, node in parent.children.items():
            _check_node(cache, parent, child_key, node)
            stack.append(node)
            num_nodes += 1
            sizes[0 if node.full_lock == 0 else 1] += node.full_slots
            if not node.tombstone:
                num_live += 1
                sizes[2 if node.swa_lock == 0 else 3] += len(node.key)
                live.append(node.value)
            elif not node.hollow:
                tombstones.append(node.value)
    num_swa_lru = len(cache._swa_lru) + len(cache._ckpt_lru)
    if len(cache._full_lru) != num_nodes or num_swa_lru != num_live:
        raise RadixCacheCorrupted(
            f"LRUs hold {len(cache._full_lru)} / {num_swa_lru} nodes, the tree has "
            f"{num_nodes} nodes / {num_live} live ones"
        )
    counters = [
        cache._full_evictable,
        cache._full_protected,
        cache._swa_evictable,
        cache._swa_protected,
    ]
    if counters != sizes:
        raise RadixCacheCorrupted(
            f"size counters (full evictable, full protected, SWA evictable, SWA protected) are "
            f"{counters}, the tree holds {sizes}"
        )
    _check_slots(cache, live, tombstones)


def _check_node(cache: RadixTree, parent: RadixNode, child_key: ChildKey, node: RadixNode) -> None:
    def fail(what: str) -> None:
        raise RadixCacheCorrupted(f"{node!r}: {what}")

    p = cache.page_size
    if node.parent is not parent:
        fail("parent pointer does not match the tree")
    if not node.key or len(node.key) % p:
        fail(f"key length {len(node.key)} is not a positive multiple of P={p}")
    if child_key != cache._child_key(node.key, 0):
        fail(f"filed under child key {child_key!r}")
    if node.value.dtype != torch.int64 or tuple(node.value.shape) != (len(node.key),):
        fail(f"value {tuple(node.value.shape)} {node.value.dtype} does not fit the key")
    if not 0 <= node.swa_lock <= node.full_lock:
        fail("lock counts break 0 <= swa_lock <= full_lock")
    if node.full_lock < sum(c.full_lock for c in node.children.values()):
        fail("full lock below the sum of its children's (locks run to the root)")
    if node.tombstone and node.swa_lock:
        fail("a tombstone holds an SWA lock")
    if node.tombstone and not node.children and not node.full_lock:
        fail("a tombstone leaf without full lock")
    if node.hollow and (not node.tombstone or bool(node.value.any())):
        fail("hollow but live, or holding slot ids")
    if cache.hollow_tombstones and node.tombstone and not node.full_lock and not node.hollow:
        fail("an unlocked tombstone of the pure-SWA cache still holds full slots")
    if node.tombstone and node.checkpoint:
        fail("a tombstone is marked as a checkpoint")
    in_swa, in_ckpt = node in cache._swa_lru, node in cache._ckpt_lru
    if (
        node not in cache._full_lru
        or in_swa + in_ckpt != (not node.tombstone)
        or in_ckpt != node.checkpoint
    ):
        fail(
            "LRU membership does not match (full: every node; SWA: live nodes, checkpoints "
            "in their own)"
        )
    if cache.enable_kv_events:
        parent_hash = parent.page_hashes[-1] if parent.page_hashes else None
        if node.page_hashes != page_hashes(node.key, p, parent_hash):
            fail("page hashes do not chain from the parent")


def _check_slots(
    cache: RadixTree, live: list[torch.Tensor], tombstones: list[torch.Tensor]
) -> None:
    """Tree slots are distinct whole pages, allocated, and mapped to SWA exactly when live."""
    allocator = cache.allocator
    p = allocator.page_size
    held = torch.cat(live + tombstones) if live or tombstones else torch.empty(0, dtype=torch.int64)
    if not held.numel():
        return
    if int(held.min()) < p or int(held.max()) >= allocator.full_size + p:
        raise RadixCacheCorrupted("the tree holds slot ids outside the full pool")
    if torch.unique(held).numel() != held.numel():
        raise RadixCacheCorrupted("a full slot is held by two tree positions")
    if bool(allocator.full.is_free(held).any()):
        raise RadixCacheCorrupted("the tree holds a full slot that the allocator has free")
    pages = held.reshape(-1, p)  # [num_pages, P] int64
    if bool((pages[:, 0] % p).any()) or not torch.equal(
        pages - pages[:, :1], torch.arange(p).expand_as(pages)
    ):
        raise RadixCacheCorrupted("tree values are not whole pages in order")
    if live and bool((allocator.translate(torch.cat(live)) <= 0).any()):
        raise RadixCacheCorrupted("a live node has a token without SWA slot")
    if tombstones and bool(allocator.translate(torch.cat(tombstones)).any()):
        raise RadixCacheCorrupted("a tombstone still maps a token to an SWA slot")
