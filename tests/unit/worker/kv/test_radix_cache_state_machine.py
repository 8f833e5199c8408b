"""Random inserts, matches, request lifecycles, locks and evictions over SWARadixCache.

After every step: `check()` on tree and allocator, the event mirror equals the tree page for
page, and every match length equals a brute-force oracle of the window rule (and, with window
repair allowed, of `prefix_reuse`). Requests may start from a repaired match and hand its
window to the tree as the engine's KV manager does; SWA eviction takes window checkpoints
only once no other unlocked live node is left.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from kv_event_mirror import KVEventMirror

from swaserve.proto.kv_events import page_hashes
from swaserve.proto.kv_rules import page_floor
from swaserve.worker.kv import (
    SWAFreeState,
    SWATokenAllocator,
    free_swa_out_of_window_slots,
    swa_free_boundary,
)
from swaserve.worker.kv.radix_cache import PureSWARadixCache, SWARadixCache
from swaserve.worker.kv.radix_node import PrefixLock, RadixNode

FULL_PAGES, SWA_PAGES = 48, 32
keys = st.tuples(st.lists(st.integers(0, 1), min_size=2, max_size=7), st.integers(0, 3))


def oracle_match_len(
    pages: dict[int, bool], tokens: list[int], p: int, window: int, chunk: int | None = None
) -> int:
    """Brute force: cached pages give per-token tombstone flags; the answer is the largest
    page-aligned end with no tombstone before it or `window` live tokens right before it
    (chunk rule: no tombstone from its chunk's start to it)."""
    flags: list[bool] = []
    for h in page_hashes(tokens, p):
        if h not in pages:
            break
        flags += [pages[h]] * p
    ends = range(0, len(flags) + 1, p)
    if chunk:
        return max(e for e in ends if not any(flags[e // chunk * chunk : e]))
    return max(
        e for e in ends if not any(flags[:e]) or (e >= window and not any(flags[e - window : e]))
    )


def tree_pages(cache: SWARadixCache) -> dict[int, bool]:
    """Page hash -> tombstone, computed from the tokens along each path."""
    out: dict[int, bool] = {}
    stack: list[tuple[RadixNode, list[int]]] = [(cache.root, [])]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            tokens = prefix + child.key
            for h in page_hashes(tokens, cache.page_size)[len(prefix) // cache.page_size :]:
                out[h] = child.tombstone
            stack.append((child, tokens))
    return out


@dataclass(eq=False)
class Request:
    tokens: list[int]
    kv: torch.Tensor  # [len(tokens)] int64: the tree's slots before cache_protected_len, own after
    lock: PrefixLock
    state: SWAFreeState
    repair_end: int = 0  # a repaired match: [.., repair_end) recomputed its SWA KV


class RadixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Request] = []
        self.mirror = KVEventMirror()
        self.seen: list[list[int]] = []  # inserted token lists: matches often follow them

    @initialize(
        page_size=st.sampled_from([1, 4]),
        window=st.sampled_from([1, 4, 8]),
        pure=st.booleans(),
        repair_pages=st.sampled_from([0, 1, 3]),
        chunk_pages=st.sampled_from([0, 0, 1, 2, 3]),
    )
    def setup(
        self, page_size: int, window: int, pure: bool, repair_pages: int, chunk_pages: int
    ) -> None:
        # chunk_pages > 0: the chunk rule with C = chunk_pages · max(P, 2) (W = C - 1), else
        # the window.
        self.chunk = chunk_pages * max(page_size, 2) or None
        if self.chunk:
            window = self.chunk - 1
        self.p, self.w = page_size, window
        self.alloc = SWATokenAllocator(
            FULL_PAGES * page_size, SWA_PAGES * page_size, page_size=page_size
        )
        cls = PureSWARadixCache if pure else SWARadixCache
        self.cache = cls(
            self.alloc,
            sliding_window_size=window,
            page_size=page_size,
            window_repair_tokens=repair_pages * page_size,
            attention_chunk_size=self.chunk,
        )
        self.repair = self.cache.window_repair_tokens

    # ---- helpers -----------------------------------------------------------------------------
    def tokens(self, data: st.DataObject) -> list[int]:
        """A new key (pages named by symbols, maybe a partial page), or a prefix or extension
        of one seen before."""
        symbols, tail = data.draw(keys)
        fresh = [10 * s + j for s in symbols for j in range(self.p)] + [7] * min(tail, self.p - 1)
        if not self.seen or data.draw(st.booleans()):
            return fresh
        old = data.draw(st.sampled_from(self.seen))
        cut = data.draw(st.integers(1, len(old)))
        return old[:cut] + fresh[: data.draw(st.integers(0, len(fresh)))]

    def sync_mirror(self) -> None:
        self.mirror.apply(self.cache.take_events())

    def match(
        self, tokens: list[int], allow_repair: bool = False
    ) -> tuple[torch.Tensor, RadixNode, int]:
        self.sync_mirror()
        expected = oracle_match_len(self.mirror.pages, tokens, self.p, self.w, self.chunk)
        assert self.mirror.match_length(tokens, self.p, self.w, 0, self.chunk) == expected
        result = self.cache.match_prefix(tokens, allow_repair=allow_repair)
        cached = 0  # pages the tree holds along `tokens`, tombstones included
        for h in page_hashes(tokens, self.p):
            if h not in self.mirror.pages:
                break
            cached += self.p
        repair = self.repair if allow_repair else 0
        if repair and cached - repair > expected:
            assert (result.indices.numel(), result.repair_len) == (cached, repair)
        else:
            assert (result.indices.numel(), result.repair_len) == (expected, 0)
        return result.indices, result.last_node, result.repair_len

    def settle_repair(self, req: Request) -> None:
        """The KV manager's rule once a repair is computed: only the window before its end is
        exact, so the tree sees everything before that as freed SWA."""
        if req.repair_end:
            window_start = page_floor(max(0, req.repair_end - self.w), self.p)
            req.state.swa_evicted_seqlen = max(req.state.swa_evicted_seqlen, window_start)
            req.repair_end = 0

    def alloc_pages(self, num_tokens: int) -> torch.Tensor | None:
        need = -(-num_tokens // self.p) * self.p
        self.cache.evict(
            need - self.alloc.full_available_size(), need - self.alloc.swa_available_size()
        )
        return self.alloc.alloc(need)

    # ---- rules -------------------------------------------------------------------------------
    @rule(data=st.data())
    def match_only(self, data: st.DataObject) -> None:
        self.match(self.tokens(data), allow_repair=data.draw(st.booleans()))

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        tokens = self.tokens(data)
        n = len(tokens) // self.p * self.p
        value = self.alloc_pages(n)
        if value is None:
            return
        if data.draw(st.booleans()):  # what decode would have freed by now
            swa_evicted = swa_free_boundary(
                n,
                sliding_window_size=self.w,
                page_size=self.p,
                radix_cache=True,
                attention_chunk_size=self.chunk,
            )
        else:  # anything that leaves the last page live
            swa_evicted = data.draw(st.integers(0, max(0, n // self.p - 1))) * self.p
        self.alloc.free_swa(value[:swa_evicted])
        cached = self.cache.insert(tokens, value, swa_evicted_seqlen=swa_evicted)
        assert 0 <= cached <= n
        self.seen.append(tokens)

    @rule(data=st.data())
    def start_request(self, data: st.DataObject) -> None:
        tokens = self.tokens(data)
        self.seen.append(tokens)
        prefix, node, repair = self.match(tokens, allow_repair=data.draw(st.booleans()))
        lock = PrefixLock(node, self.cache.inc_lock_ref(node))
        m = prefix.numel() - repair  # a repair recomputes [m, m + repair) in slots of its own
        own = self.alloc_pages(len(tokens) - m)
        if own is None:
            self.cache.dec_lock_ref(node, lock.handle)
            return
        kv = torch.cat((prefix[:m], own[: len(tokens) - m]))
        state = SWAFreeState(cache_protected_len=m)
        self.requests.append(Request(tokens, kv, lock, state, m + repair if repair else 0))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free_out_of_window(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.requests))
        free_swa_out_of_window_slots(
            self.alloc,
            req.state,
            req.kv,
            len(req.tokens),
            sliding_window_size=self.w,
            radix_cache=True,
            attention_chunk_size=self.chunk,
        )

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def release_swa_lock(self, data: st.DataObject) -> None:
        self.cache.release_request_swa(data.draw(st.sampled_from(self.requests)).lock)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def cache_unfinished(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.requests))
        aligned = len(req.tokens) // self.p * self.p
        self.settle_repair(req)
        if req.state.swa_evicted_seqlen >= aligned > 0:
            return
        req.kv, req.lock = self.cache.cache_unfinished_request(
            req.tokens, req.kv, req.lock, req.state
        )
        assert req.state.cache_protected_len == aligned

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.requests))
        self.requests.remove(req)
        self.settle_repair(req)
        self.cache.cache_finished_request(req.tokens, req.kv, req.lock, req.state)

    def big_tree(self) -> bool:
        """Evict on request only once the tree holds something (the pools also evict under
        pressure in `alloc_pages`)."""
        return hasattr(self, "cache") and self.cache.total_size()[0] >= 12 * self.p

    @precondition(big_tree)
    @rule(full_tokens=st.integers(0, 24), swa_tokens=st.integers(0, 24))
    def evict(self, full_tokens: int, swa_tokens: int) -> None:
        full_before, swa_before = self.alloc.full_available_size(), self.alloc.swa_available_size()
        checkpoints = {x for x in self.cache._nodes() if x.checkpoint}
        full, swa = self.cache.evict(full_tokens, swa_tokens)
        assert (full, swa) == (
            self.alloc.full_available_size() - full_before,
            self.alloc.swa_available_size() - swa_before,
        )
        nodes = self.cache._nodes()
        assert full >= full_tokens or not any(x.full_lock == 0 and not x.children for x in nodes)
        assert swa >= swa_tokens or not any(x.swa_lock == 0 and not x.tombstone for x in nodes)
        # Under SWA pressure checkpoints go last: if one lost its SWA KV, no other unlocked live
        # node is left (full eviction takes LRU leaves, checkpoints or not).
        if full_tokens == 0 and any(x.tombstone or x.parent is None for x in checkpoints):
            assert not any(x.swa_lock == 0 and not x.tombstone and not x.checkpoint for x in nodes)

    @precondition(big_tree)
    @rule(swa_tokens=st.integers(1, 12))
    def evict_swa(self, swa_tokens: int) -> None:
        self.evict(0, swa_tokens)

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check()
        own = [r.kv[r.state.cache_protected_len :] for r in self.requests]
        self.alloc.check(owned=torch.cat([self.cache.cached_indices(), *own]))
        for r in self.requests:  # the locked prefix a request reads is still allocated
            prefix = r.kv[: r.state.cache_protected_len]
            assert not bool(self.alloc.full.is_free(prefix[prefix > 0]).any())
            assert r.lock.node is self.cache.root or r.lock.node.parent is not None
        self.sync_mirror()
        assert self.mirror.pages == tree_pages(self.cache)

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for req in self.requests:
            self.settle_repair(req)
            self.cache.cache_finished_request(req.tokens, req.kv, req.lock, req.state)
        self.requests.clear()
        assert self.cache.full_protected_size() == self.cache.swa_protected_size() == 0
        big = 10**6
        self.cache.evict(big, big)
        self.consistent()
        assert self.cache.total_size() == (0, 0) and self.mirror.pages == {}
        assert self.alloc.full_available_size() == FULL_PAGES * self.p
        assert self.alloc.swa_available_size() == SWA_PAGES * self.p


RadixCacheMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, derandomize=True, database=None
)
TestRadixCacheMachine = RadixCacheMachine.TestCase
