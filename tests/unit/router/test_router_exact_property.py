"""Exact mode, as a property: two workers, each a real SWARadixCache over a real allocator,
go through random inserts, request lifecycles (match, lock, chunked insert, out-of-window SWA
freeing, SWA lock release, finish), evictions, cache resets and restarts; their KV events
reach the router in reports, some of which are lost, and the router itself may restart (its
state gone). A worker answers the router's call for a snapshot (`update` -> True) with a
snapshot report at once. After every step the router's view of each worker equals its
tree page for page, and the predicted reuse of every probed prompt equals the tokens that
worker's `match_prefix(..., allow_repair=True)` saves (`saved_tokens`; each worker draws its
own window repair R, 0 = none, and requests start from repaired matches as the engine does),
and `route` predicts the same for the worker it picks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from swaserve.proto.kv_events import page_hashes
from swaserve.proto.kv_rules import page_floor
from swaserve.proto.messages import Headroom, WorkerReport
from swaserve.router import Outcome, Router, RouterConfig
from swaserve.worker.kv import SWAFreeState, SWATokenAllocator, free_swa_out_of_window_slots
from swaserve.worker.kv.radix_cache import PureSWARadixCache, SWARadixCache
from swaserve.worker.kv.radix_node import PrefixLock, RadixNode

FULL_PAGES, SWA_PAGES = 40, 24
symbols = st.lists(st.integers(0, 1), min_size=1, max_size=7)


def tree_pages(cache: SWARadixCache) -> dict[int, bool]:
    """Page hash -> tombstone, from the tokens along each path of the tree."""
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
    kv: torch.Tensor  # [len(tokens)] int64: the tree's slots, then the request's own
    lock: PrefixLock
    state: SWAFreeState


class Worker:
    def __init__(self, name: str, page_size: int, window: int, pure: bool, repair: int) -> None:
        self.name, self.p, self.w, self.pure, self.repair = name, page_size, window, pure, repair
        self.instances = itertools.count()
        self.seq = 0
        self.restart()

    def restart(self) -> None:
        self.instance = f"{self.name}-{next(self.instances)}"
        self.alloc = SWATokenAllocator(FULL_PAGES * self.p, SWA_PAGES * self.p, page_size=self.p)
        cls = PureSWARadixCache if self.pure else SWARadixCache
        self.cache = cls(
            self.alloc,
            sliding_window_size=self.w,
            page_size=self.p,
            window_repair_tokens=self.repair,
        )
        self.requests: list[Request] = []
        self.seq = 0

    def report(self, now: float, *, snapshot: bool = False) -> WorkerReport:
        """The next report: the events since the last one, or (`snapshot`) the whole tree,
        the pending events dropped as `EngineLoop` does."""
        self.seq += 1
        events = self.cache.take_events()
        if snapshot:
            events = self.cache.snapshot_events()
        headroom = Headroom(
            full_total_tokens=FULL_PAGES * self.p,
            full_free_tokens=self.alloc.full_available_size(),
            full_evictable_tokens=self.cache.full_evictable_size(),
            swa_total_tokens=SWA_PAGES * self.p,
            swa_free_tokens=self.alloc.swa_available_size(),
            swa_evictable_tokens=self.cache.swa_evictable_size(),
            num_running=len(self.requests),
            num_waiting=0,
            sliding_window_size=self.w,
            window_repair_tokens=self.cache.window_repair_tokens,  # 0 in the pure-SWA variant
            page_size=self.p,
        )
        return WorkerReport(
            self.name, self.instance, self.seq, now, headroom, events, snapshot=snapshot
        )

    def alloc_pages(self, num_tokens: int) -> torch.Tensor | None:
        need = -(-num_tokens // self.p) * self.p
        self.cache.evict(
            need - self.alloc.full_available_size(), need - self.alloc.swa_available_size()
        )
        return self.alloc.alloc(need)


class RouterMirrorsCaches(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 4]),
        windows=st.tuples(st.sampled_from([1, 4, 8]), st.sampled_from([1, 4, 8])),
        pure=st.booleans(),
        repair_pages=st.tuples(st.sampled_from([0, 1, 2, 4]), st.sampled_from([0, 1, 2, 4])),
    )
    def setup(
        self, page_size: int, windows: tuple[int, int], pure: bool, repair_pages: tuple[int, int]
    ) -> None:
        self.p, self.now = page_size, 0.0
        self.workers = [
            Worker(f"w{i}", page_size, w, pure, r * page_size)
            for i, (w, r) in enumerate(zip(windows, repair_pages, strict=True))
        ]
        self.lossy = False  # reports were lost or the router restarted: deltas may mismatch
        self.new_router()
        self.seen: list[list[int]] = []
        self.ids = itertools.count()
        self.sync()

    # ---- helpers -----------------------------------------------------------------------------
    def new_router(self) -> None:
        self.router = Router(RouterConfig(report_timeout_s=1e9), clock=lambda: self.now)
        for worker in self.workers:
            self.router.add_worker(worker.name)

    def sync(self) -> None:
        """Every worker reports (its events since the last report) one second later, and
        sends a snapshot report when the router answers that it lost track."""
        self.now += 1.0
        for worker in self.workers:
            if self.router.update(worker.report(self.now)):
                assert not self.router.update(worker.report(self.now, snapshot=True))

    def tokens(self, data: st.DataObject) -> list[int]:
        """A fresh key over a 2-symbol page alphabet (shared by both workers), or a prefix or
        extension of a key seen before."""
        fresh = [10 * s + j for s in data.draw(symbols) for j in range(self.p)]
        fresh += [7] * data.draw(st.integers(0, self.p - 1))
        if not self.seen or data.draw(st.booleans()):
            return fresh
        old = data.draw(st.sampled_from(self.seen))
        return old[: data.draw(st.integers(1, len(old)))] + fresh[: data.draw(st.integers(0, 8))]

    def worker(self, data: st.DataObject) -> Worker:
        return data.draw(st.sampled_from(self.workers))

    def expect_equal_predictions(self, tokens: list[int]) -> None:
        predicted = self.router.predict_hits(tokens)
        for worker in self.workers:
            match = worker.cache.match_prefix(tokens, allow_repair=True)
            assert predicted[worker.name] == match.saved_tokens

    # ---- worker-side rules --------------------------------------------------------------------
    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        worker, tokens = self.worker(data), self.tokens(data)
        n = len(tokens) // self.p * self.p
        value = worker.alloc_pages(n)
        if value is None:
            return
        swa_evicted = data.draw(st.integers(0, max(0, n // self.p - 1))) * self.p
        worker.alloc.free_swa(value[:swa_evicted])
        worker.cache.insert(tokens, value, swa_evicted_seqlen=swa_evicted)
        self.seen.append(tokens)

    @rule(data=st.data())
    def start_request(self, data: st.DataObject) -> None:
        """As the engine admits: the match (repaired where that saves more) locked, the
        tree's slots up to `saved_tokens`, the request's own after (a repair recomputes
        [m - R, m) into them); a repair keeps only the SWA KV of the window before m."""
        worker, tokens = self.worker(data), self.tokens(data)
        self.seen.append(tokens)
        match = worker.cache.match_prefix(tokens, allow_repair=True)
        lock = PrefixLock(match.last_node, worker.cache.inc_lock_ref(match.last_node))
        m = match.saved_tokens
        own = worker.alloc_pages(len(tokens) - m)
        if own is None:
            worker.cache.dec_lock_ref(match.last_node, lock.handle)
            return
        kv = torch.cat((match.indices[:m], own[: len(tokens) - m]))
        state = SWAFreeState(cache_protected_len=m)
        window_start = page_floor(max(0, match.indices.numel() - worker.w), self.p)
        if match.repair_len and window_start > m:
            worker.alloc.free_swa(kv[m:window_start])
            state.swa_evicted_seqlen = window_start
        worker.requests.append(Request(tokens, kv, lock, state))

    @rule(data=st.data())
    def advance_request(self, data: st.DataObject) -> None:
        """Free out-of-window SWA, maybe release the SWA lock, maybe cache the computed part."""
        worker = self.worker(data)
        if not worker.requests:
            return
        req = data.draw(st.sampled_from(worker.requests))
        free_swa_out_of_window_slots(
            worker.alloc, req.state, req.kv, len(req.tokens), sliding_window_size=worker.w,
            radix_cache=True,
        )  # fmt: skip
        if data.draw(st.booleans()):
            worker.cache.release_request_swa(req.lock)
        aligned = len(req.tokens) // self.p * self.p
        if data.draw(st.booleans()) and not req.state.swa_evicted_seqlen >= aligned > 0:
            req.kv, req.lock = worker.cache.cache_unfinished_request(
                req.tokens, req.kv, req.lock, req.state
            )

    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        worker = self.worker(data)
        if not worker.requests:
            return
        req = data.draw(st.sampled_from(worker.requests))
        worker.requests.remove(req)
        worker.cache.cache_finished_request(req.tokens, req.kv, req.lock, req.state)

    @rule(data=st.data(), full_tokens=st.integers(0, 24), swa_tokens=st.integers(0, 24))
    def evict(self, data: st.DataObject, full_tokens: int, swa_tokens: int) -> None:
        self.worker(data).cache.evict(full_tokens, swa_tokens)

    @rule(data=st.data())
    def reset_or_restart(self, data: st.DataObject) -> None:
        worker = self.worker(data)
        if data.draw(st.booleans()):
            worker.restart()  # a new instance: its old cache is gone, events start afresh
        elif not worker.requests:
            worker.cache.reset()  # KVCleared

    @rule(data=st.data())
    def lose_report(self, data: st.DataObject) -> None:
        """A report (and its events) never reaches the router."""
        self.worker(data).report(self.now)
        self.lossy = True

    @rule()
    def restart_router(self) -> None:
        """The router's process died: a new router, no views, while the workers count on."""
        self.new_router()
        self.lossy = True

    # ---- router-side checks -------------------------------------------------------------------
    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def probe(self, data: st.DataObject) -> None:
        self.sync()
        tokens = self.tokens(data)
        self.expect_equal_predictions(tokens)
        decision = self.router.route(f"r{next(self.ids)}", [*tokens, 5], 0)
        if decision.outcome == Outcome.ROUTED:
            chosen = next(w for w in self.workers if w.name == decision.worker_id)
            match = chosen.cache.match_prefix(tokens, allow_repair=True)
            assert decision.predicted_hit_tokens == match.saved_tokens
        assert self.router.finish(decision.request_id)

    @invariant()
    def router_view_equals_each_tree(self) -> None:
        if not hasattr(self, "router"):
            return
        self.sync()
        self.router.check()
        view = self.router._exact
        assert view is not None and (self.lossy or self.router.stats.event_mismatches == 0)
        assert not any(s.needs_snapshot for s in self.router._workers.values())
        for worker, state in zip(self.workers, self.router._workers.values(), strict=True):
            assert view.pages(state.bit) == tree_pages(worker.cache)
        for tokens in self.seen[-4:]:
            self.expect_equal_predictions(tokens)

    def teardown(self) -> None:
        if not hasattr(self, "router"):
            return
        for worker in self.workers:
            for req in worker.requests:
                worker.cache.cache_finished_request(req.tokens, req.kv, req.lock, req.state)
            worker.cache.evict(10**6, 10**6)
            worker.cache.check()
        self.sync()
        assert all(self.router._exact.num_pages(s.bit) == 0 for s in self.router._workers.values())  # type: ignore[union-attr]


RouterMirrorsCaches.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, derandomize=True, database=None
)
TestRouterMirrorsCaches = RouterMirrorsCaches.TestCase
