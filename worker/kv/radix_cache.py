"""SWA-aware radix prefix cache (architecture §5 worker.kv, §6); SGLang's SWARadixCache is the model.

Each node holds a page-aligned run of tokens and their full slot ids. A tombstone node's SWA KV
was freed while its full KV stays, so a match may run through it but may only end where the
SWA layers can continue: at least W live tokens right before the end (or no tombstone on the
path at all). Along one matched path:

    # [0, t)          ... tombstone ...   full KV only
    # [t, end - W)    live                 not needed by the SWA layers of the next token
    # [end - W, end)  live                 must hold SWA KV: the window of token `end`

Two LRUs order eviction: full eviction removes unlocked leaves (and the tombstone parents they
leave as leaves) and frees full + SWA KV; SWA eviction frees only SWA KV and tombstones the node
(an unlocked leaf is removed instead). Parents are touched before children, so both evict
nodes near the root first. A lock protects full KV up to the root and SWA KV only up to the
node that completes W tokens.

Window checkpoints. When a decode leaves the window of its cached prompt, the prompt's last
C = ceil_P(W + S) + P tokens keep their SWA KV (S: `checkpoint_slack_tokens`; a resume at the
prompt's end, or up to S tokens and a page before it, stays valid: a chat template that renders
a finished turn without the generation prompt's last tokens, MiMo's `<think></think>`, resumes
there) and only the interior is tombstoned; the window before every branch point and
before a finished sequence's end is kept the same way. Checkpoints are cache: unlocked, counted
as evictable, and SWA eviction takes them only after every other live node (an LRU of their own):

    # prompt [0, 320), W = 32, S = 0, P = 1, decode left the window:
    # [0, 287) tombstone (interior)   [287, 320) live checkpoint

Window repair (`match_prefix(key, allow_repair=True)`, R = `window_repair_tokens`): a path whose
full KV is cached but that has no live window before its end may be resumed by recomputing the
SWA KV of its last R tokens, where that saves more than the plain match (`prefix_reuse`).

Chunked attention (`attention_chunk_size` C, Llama 4): a match of length L needs the live KV of
[floor(L / C)·C, L) only, so a chunk boundary is a valid end even inside a tombstone (the walk
splits the node there); a lock holds SWA KV back to the chunk start of its end; a checkpoint
keeps what the resumes within S + P tokens of its end read (at most C + S + P); repair is off
(a chunk boundary is always as good, `prefix_reuse`).

Frees are batched: every public mutating method gives slots back to the allocator once, at
its end.
"""

from __future__ import annotations

import itertools

import torch

from swaserve.proto.kv_events import KVCleared, KVRevived, KVTombstoned
from swaserve.proto.kv_rules import (
    check_span_rule,
    needed_before,
    page_ceil,
    prefix_reuse,
    read_start,
)
from swaserve.worker.kv.allocator import SWATokenAllocator
from swaserve.worker.kv.radix_node import LockHandle, MatchResult, PrefixLock, RadixNode, RadixTree
from swaserve.worker.kv.swa_freeing import SWAFreeState


class SWARadixCache(RadixTree):
    """Prefix cache over full slot ids with SWA tombstones, two LRUs and window-bounded locks.

    Sizes, `total_size`, `cached_indices`, `take_events`, `snapshot_events` and `check` come
    from `RadixTree`.
    `window_repair_tokens` (R, 0 = off) is what `match_prefix(..., allow_repair=True)` may
    recompute; the engine passes `window_repair_tokens(L_swa, W, P)`. `checkpoint_slack_tokens`
    (S) widens every window checkpoint; the engine passes its `window_checkpoint_slack_tokens`.
    """

    def __init__(
        self,
        allocator: SWATokenAllocator,
        sliding_window_size: int,
        page_size: int = 1,
        *,
        enable_kv_events: bool = True,
        window_repair_tokens: int = 0,
        checkpoint_slack_tokens: int = 0,
        attention_chunk_size: int | None = None,
    ) -> None:
        if not isinstance(sliding_window_size, int) or sliding_window_size < 1:
            raise ValueError(
                f"sliding_window_size must be a positive int, got {sliding_window_size!r}"
            )
        if window_repair_tokens < 0 or window_repair_tokens % page_size:
            raise ValueError(
                f"window_repair_tokens={window_repair_tokens} is not a non-negative multiple "
                f"of P={page_size}"
            )
        check_span_rule(sliding_window_size, attention_chunk_size, page_size)
        super().__init__(allocator, page_size, enable_kv_events=enable_kv_events)
        self.sliding_window_size = sliding_window_size
        self.attention_chunk_size = attention_chunk_size
        self.window_repair_tokens = (
            0 if self.hollow_tombstones or attention_chunk_size else window_repair_tokens
        )
        if checkpoint_slack_tokens < 0:
            raise ValueError(f"checkpoint_slack_tokens={checkpoint_slack_tokens} is negative")
        self.checkpoint_slack_tokens = checkpoint_slack_tokens
        self.checkpoint_tokens = (
            page_ceil(sliding_window_size + checkpoint_slack_tokens, page_size) + page_size
        )
        self._lock_ids = itertools.count(1)

    # ---- queries -------------------------------------------------------------------------
    def match_prefix(self, key: list[int], *, allow_repair: bool = False) -> MatchResult:
        """Longest reusable prefix of `key` (cut to whole pages) under the window rule; with
        `allow_repair`, the whole cached path instead when repairing its window saves more
        (then `repair_len` = R and only `saved_tokens` are skipped).

        Mutates only the LRU order and may split the node where the match ends. Indices are
        valid while `last_node` is locked; lock it before the next evict.
        """
        path, num_used, repair_len = self._walk(key, allow_repair)
        last = path[num_used - 1] if num_used else self.root
        self._touch(last)
        return MatchResult(self._values(path[:num_used]), last, repair_len)

    # ---- commands ------------------------------------------------------------------------
    def insert(
        self,
        key: list[int],
        value: torch.Tensor,
        prev_prefix_len: int = 0,
        swa_evicted_seqlen: int = 0,
    ) -> int:
        """Cache `key[:floor_P(len)]` with full slots `value`; returns how much was cached before.

        `value[:prev_prefix_len]` are the tree's own slots (the caller's locked match) and are
        never freed; every later slot passes to the tree or is freed here: a duplicate of a live
        node is freed; over a tombstone, slots that still have SWA KV
        (`>= swa_evicted_seqlen`) revive it (splitting off the part without), the rest are
        freed. New positions `[.., swa_evicted_seqlen)` become a tombstone node, the remainder
        a live leaf. Slots past the page-aligned length are left to the caller. Both lengths
        must be multiples of P.
        """
        cached, _ = self._insert(key, value, prev_prefix_len, swa_evicted_seqlen)
        self._flush()
        return cached

    def _insert(
        self, key: list[int], value: torch.Tensor, prev_prefix_len: int, swa_evicted_seqlen: int
    ) -> tuple[int, RadixNode]:
        """`insert` without the final flush; also returns the node that ends the inserted
        path (the root when nothing page-aligned was inserted). A new branch keeps the window
        before its branch point as a checkpoint."""
        n = len(key) // self.page_size * self.page_size
        self._check_insert_args(n, value, prev_prefix_len, swa_evicted_seqlen)
        value = value.to(torch.int64)
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            matched = self._common_len(child.key, key, pos, n)
            if matched < len(child.key):
                child = self._split(child, matched)
            self._touch_one(child)
            end, own = pos + matched, max(pos, prev_prefix_len)
            revive = max(own, swa_evicted_seqlen)
            if child.tombstone and revive < end:
                if revive > pos:
                    self._split(child, revive - pos)
                self._revive(child, value[revive:end])
                self._pending_full.append(value[own:revive])
            else:
                self._pending_full.append(value[own:end])
            node, pos = child, end
        cached, end = pos, node
        if pos < n:
            tomb_end = min(max(swa_evicted_seqlen, pos), n)
            if tomb_end == n:  # no SWA KV left at all: a leaf may not be a tombstone
                self._pending_full.append(value[pos:n])
            else:
                branch = node is not self.root and bool(node.children)
                tomb = (
                    self._add_child(node, key[pos:tomb_end], value[pos:tomb_end], True)
                    if tomb_end > pos
                    else None
                )
                end = self._add_child(tomb or node, key[tomb_end:n], value[tomb_end:n], False)
                if tomb is not None:
                    self._settle(tomb)
                if branch:
                    self._keep_window(node)
        return cached, end

    def evict(self, full_tokens: int, swa_tokens: int = 0) -> tuple[int, int]:
        """Free at least `full_tokens` full and `swa_tokens` SWA slots if the tree can.

        Full phase: LRU unlocked leaves. SWA phase (counting SWA already freed): LRU node
        without SWA lock, window checkpoints only once no other live node is left; an internal
        or full-locked one becomes a tombstone, an unlocked leaf is removed. Returns (full
        slots freed, SWA slots freed).
        """
        full_freed = swa_freed = 0
        while full_freed < full_tokens:
            leaf = next((x for x in self._full_lru if x.full_lock == 0 and not x.children), None)
            if leaf is None:
                break
            full, swa = self._remove_leaf(leaf)
            full_freed, swa_freed = full_freed + full, swa_freed + swa
        while swa_freed < swa_tokens:
            node = next((x for x in self._swa_lru if x.swa_lock == 0), None)
            if node is None:
                node = next((x for x in self._ckpt_lru if x.swa_lock == 0), None)
            if node is None:
                break
            if node.children or node.full_lock > 0:
                swa_freed += self._tombstone(node)
                full_freed += self._settle(node)
            else:
                full, swa = self._remove_leaf(node)
                full_freed, swa_freed = full_freed + full, swa_freed + swa
        self._flush()
        return full_freed, swa_freed

    def inc_lock_ref(self, node: RadixNode) -> LockHandle:
        """Lock full KV from `node` to the root and SWA KV from `node` up to the node that
        completes W tokens (under chunks: reaches the chunk start of `node`'s end), or the
        first tombstone. Pass the handle to `dec_lock_ref`."""
        need = self.sliding_window_size
        if self.attention_chunk_size:
            need = needed_before(self._end_of(node), need, self.attention_chunk_size)
        swa_open, swa_tokens, top = need > 0, 0, None
        for x in self._up(node):
            if x.full_lock == 0:
                self._full_evictable -= x.full_slots
                self._full_protected += x.full_slots
            x.full_lock += 1
            if swa_open and x.tombstone:
                swa_open = False
            elif swa_open:
                if x.swa_lock == 0:
                    self._swa_evictable -= len(x.key)
                    self._swa_protected += len(x.key)
                x.swa_lock += 1
                top, swa_tokens = x, swa_tokens + len(x.key)
                swa_open = swa_tokens < need
        if top is None or swa_open:
            return LockHandle(holds_swa=top is not None, swa_lock_id=None)
        if top.lock_id is None:
            top.lock_id = next(self._lock_ids)
        return LockHandle(holds_swa=True, swa_lock_id=top.lock_id)

    def dec_lock_ref(self, node: RadixNode, handle: LockHandle, skip_swa: bool = False) -> None:
        """Undo `inc_lock_ref`; `skip_swa` when `dec_swa_lock_only` already released the SWA
        part. A tombstone leaf left without a full lock is removed (its full KV is freed)."""
        swa_open = handle.holds_swa and not skip_swa
        released = []
        for x in self._up(node):
            self._expect_lock(x, x.full_lock, "full")
            x.full_lock -= 1
            if x.full_lock == 0:
                self._full_protected -= x.full_slots
                self._full_evictable += x.full_slots
                released.append(x)
            if swa_open:
                self._expect_lock(x, x.swa_lock, "SWA")
                x.swa_lock -= 1
                if x.swa_lock == 0:
                    self._swa_protected -= len(x.key)
                    self._swa_evictable += len(x.key)
                swa_open = handle.swa_lock_id is None or x.lock_id != handle.swa_lock_id
        for x in released:
            self._settle(x)
        self._flush()

    def dec_swa_lock_only(self, node: RadixNode, handle: LockHandle) -> None:
        """Release only the SWA part of a lock (decode moved past the window); the full lock
        stays. The last `checkpoint_tokens` before `node`'s end stay live as a window
        checkpoint; a leaf left without SWA lock tombstones the rest of its run now."""
        self._dec_swa_lock(node, handle)
        self._flush()

    def _dec_swa_lock(self, node: RadixNode, handle: LockHandle) -> None:
        for x in self._up(node) if handle.holds_swa else ():
            self._expect_lock(x, x.swa_lock, "SWA")
            x.swa_lock -= 1
            if x.swa_lock == 0:
                self._swa_protected -= len(x.key)
                self._swa_evictable += len(x.key)
            if handle.swa_lock_id is not None and x.lock_id == handle.swa_lock_id:
                break
        if node.parent is None or node.tombstone:
            return
        if not handle.holds_swa and not self.attention_chunk_size:
            return  # the window before the lock's end was not live: nothing to keep
        # (under chunks a lock ending on a boundary holds no SWA, yet resumes just before it do)
        keep = self._checkpoint_len(node)
        if not node.children and node.swa_lock == 0 and len(node.key) > keep:
            self._tombstone(self._split(node, len(node.key) - keep))  # the interior
        self._keep_window(node)

    def _end_of(self, node: RadixNode) -> int:
        """The position where `node`'s run ends (its depth in tokens)."""
        return sum(len(x.key) for x in self._up(node))

    def _checkpoint_len(self, end: RadixNode) -> int:
        """Tokens before `end`'s end a window checkpoint keeps: `checkpoint_tokens` under a
        window; under chunks what the resumes at most S + P tokens before the end read."""
        if not self.attention_chunk_size:
            return self.checkpoint_tokens
        at = self._end_of(end)
        earliest = max(
            0, at - page_ceil(self.checkpoint_slack_tokens, self.page_size) - self.page_size
        )
        return at - read_start(earliest, self.sliding_window_size, self.attention_chunk_size)

    def _keep_window(self, end: RadixNode) -> None:
        """Mark the live nodes of the last `checkpoint_tokens` before `end`'s end as window
        checkpoints (splitting the topmost at the boundary); stops at a tombstone. Newly
        marked nodes join the checkpoint LRU parents first, as `_touch` orders them."""
        need, x, marked = self._checkpoint_len(end), end, []
        while need > 0 and x.parent is not None and not x.tombstone:
            if not x.checkpoint:
                if len(x.key) > need:
                    self._split(x, len(x.key) - need)  # x keeps the last `need` tokens
                marked.append(x)
            need -= len(x.key)
            x = x.parent
        for x in reversed(marked):
            del self._swa_lru[x]
            x.checkpoint = True
            self._ckpt_lru[x] = None

    def reset(self) -> None:
        """Drop every node and give all its slots back to the allocator. Raises RuntimeError
        while a lock is held."""
        if any(child.full_lock for child in self.root.children.values()):
            raise RuntimeError("reset(): the radix cache still has locked nodes (running requests)")
        self._pending_full.append(self.cached_indices())
        self._flush()
        self._init_tree()
        self._emit(KVCleared())

    # ---- request helpers (scheduler) -----------------------------------------------------
    def cache_finished_request(
        self, token_ids: list[int], kv_indices: torch.Tensor, lock: PrefixLock, state: SWAFreeState
    ) -> None:
        """Hand a finished request's KV to the tree: insert its page-aligned prefix, free the
        unaligned tail, release its lock. `kv_indices[i]` is the full slot of token i."""
        n = self._check_request(token_ids, kv_indices)
        aligned = n // self.page_size * self.page_size
        _, end = self._insert(
            token_ids,
            kv_indices[:aligned],
            state.cache_protected_len,
            min(state.swa_evicted_seqlen, aligned),
        )
        for resume in (lock.node, end):  # the prompt's end (its last cached point), the sequence's
            if resume.parent is not None and not resume.tombstone:
                self._keep_window(resume)
        self._flush()
        self.allocator.free(kv_indices[aligned:n])
        self.dec_lock_ref(lock.node, lock.handle, skip_swa=lock.swa_released)

    def cache_unfinished_request(
        self, token_ids: list[int], kv_indices: torch.Tensor, lock: PrefixLock, state: SWAFreeState
    ) -> tuple[torch.Tensor, PrefixLock]:
        """Insert the computed tokens of a running (chunked) request and move its lock to the
        new end. Returns the request's slots to write back ([n] int64: the tree's for the
        page-aligned part, its own after) and its new lock; sets `state.cache_protected_len`.
        The request must still hold SWA KV for its last page (`swa_evicted_seqlen < floor_P(n)`)."""
        n = self._check_request(token_ids, kv_indices)
        aligned = n // self.page_size * self.page_size
        if state.swa_evicted_seqlen >= aligned > 0:
            raise ValueError(
                f"swa_evicted_seqlen={state.swa_evicted_seqlen} leaves no SWA KV in the "
                f"{aligned} page-aligned tokens of a running request"
            )
        self.insert(
            token_ids, kv_indices[:aligned], state.cache_protected_len, state.swa_evicted_seqlen
        )
        path, _, _ = self._walk(token_ids)
        new_node = path[-1] if path else self.root
        self._touch(new_node)
        new_lock = PrefixLock(new_node, self.inc_lock_ref(new_node))
        self.dec_lock_ref(lock.node, lock.handle, skip_swa=lock.swa_released)
        state.cache_protected_len = aligned
        return torch.cat((self._values(path), kv_indices[aligned:n].to(torch.int64))), new_lock

    def release_request_swa(self, lock: PrefixLock) -> None:
        """Release the SWA part of a request's lock once (decode moved past the window)."""
        self.release_requests_swa([lock])

    def release_requests_swa(self, locks: list[PrefixLock]) -> None:
        """`release_request_swa` for many requests, with one free of the SWA KV they leave
        unlocked (the decodes of a batch pass their windows together)."""
        for lock in locks:
            if not lock.swa_released:
                self._dec_swa_lock(lock.node, lock.handle)
                lock.swa_released = True
        self._flush()

    # ---- internals -----------------------------------------------------------------------
    def _walk(self, key: list[int], allow_repair: bool = False) -> tuple[list[RadixNode], int, int]:
        """Nodes matching `key` from the root (the last one split to end at the match), how
        many of them the match uses (`prefix_reuse`: the longest end under the window rule, or
        all with a repair) and the repair length (0 = none)."""
        n = len(key) // self.page_size * self.page_size
        node, pos = self.root, 0
        path: list[RadixNode] = []
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            matched = self._common_len(child.key, key, pos, n)
            if matched < len(child.key):
                child = self._split(child, matched)
            path.append(child)
            pos += matched
            node = child
        reuse = prefix_reuse(
            [(len(c.key), c.tombstone) for c in path],
            self.sliding_window_size,
            self.window_repair_tokens if allow_repair else 0,
            self.attention_chunk_size,
        )
        num_used, end = 0, 0
        while num_used < len(path) and end + len(path[num_used].key) <= reuse.match_len:
            end += len(path[num_used].key)
            num_used += 1
        if end < reuse.match_len:  # a chunk boundary inside the next node: end the match there
            upper = self._split(path[num_used], reuse.match_len - end)
            path[num_used : num_used + 1] = [upper, path[num_used]]
            num_used += 1
        return path, num_used, reuse.repair_len

    def _revive(self, node: RadixNode, incoming: torch.Tensor) -> None:
        """Give a tombstone SWA KV again from `incoming` (the caller's slots for the same
        tokens). A full-locked node keeps its full slots (a running request reads them) and
        adopts the incoming SWA slots; otherwise the node takes the incoming slots."""
        if node.hollow or node.full_lock == 0:
            if not node.hollow:
                self._pending_full.append(node.value)
            self._account_full(node, len(node.key) - node.full_slots)
            node.value, node.hollow = incoming.clone(), False
        else:
            mapping = self.allocator.full_to_swa
            mapping[node.value] = mapping[incoming]
            mapping[incoming] = 0
            self._pending_full.append(incoming)
        node.tombstone = False
        self._live_lru(node)[node] = None
        self._swa_evictable += len(node.key)
        self._emit(KVRevived(tuple(node.page_hashes)))

    def _tombstone(self, node: RadixNode) -> int:
        """Free the SWA KV of a live node without SWA lock; returns the SWA slots freed."""
        del self._live_lru(node)[node]
        self._swa_evictable -= len(node.key)
        self._pending_swa.append(node.value)
        node.tombstone, node.checkpoint = True, False
        self._emit(KVTombstoned(tuple(node.page_hashes)))
        return len(node.key)

    def _settle(self, node: RadixNode) -> int:
        """Restore the tombstone invariants once `node` has no full lock: a tombstone leaf is
        removed; an internal tombstone becomes hollow in the pure-SWA variant. Returns the
        full slots freed."""
        if node.parent is None or not node.tombstone or node.full_lock > 0:
            return 0
        if not node.children:
            return self._remove_leaf(node)[0]
        if not self.hollow_tombstones or node.hollow:
            return 0
        self._pending_full.append(node.value)
        self._full_evictable -= len(node.key)
        node.value = torch.zeros_like(node.value)  # padding slot 0: no KV
        node.hollow = True
        return len(node.key)

    def _expect_lock(self, node: RadixNode, count: int, kind: str) -> None:
        if count <= 0:
            raise ValueError(f"dec of a {kind} lock that is not held on {node!r}")

    def _check_insert_args(
        self, n: int, value: torch.Tensor, prev_prefix_len: int, swa_evicted_seqlen: int
    ) -> None:
        if value.numel() < n:
            raise ValueError(f"insert: {value.numel()} slots for {n} page-aligned tokens")
        for name, length in (
            ("prev_prefix_len", prev_prefix_len),
            ("swa_evicted_seqlen", swa_evicted_seqlen),
        ):
            if length < 0 or length % self.page_size:
                raise ValueError(
                    f"insert: {name}={length} is not a non-negative multiple of P={self.page_size}"
                )

    def _check_request(self, token_ids: list[int], kv_indices: torch.Tensor) -> int:
        if kv_indices.numel() != len(token_ids):
            raise ValueError(f"{kv_indices.numel()} slots for {len(token_ids)} tokens")
        return len(token_ids)


class PureSWARadixCache(SWARadixCache):
    """For models whose layers are all SWA: the full pool is only an address space (no KV
    bytes), so a tombstone needs no full slot either. An internal tombstone without full lock
    gives its full slots back and turns hollow: its indices read as padding slot 0, which
    translates to "no SWA slot" and is never read (it lies outside every window). Matching,
    locking and eviction are those of `SWARadixCache`; hollow nodes count 0 full slots."""

    hollow_tombstones = True
