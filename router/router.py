"""Router: prefix-, SWA- and headroom-aware routing of requests to workers (architecture §5 router).

    route(request)  →  fresh workers → predicted hits (cache views) → those that fit (budgets)
                    →  policy picks one  |  none fits, or the policy holds it: queue (FIFO,
                       deadline)  |  queue full: raise

The cluster layer drives it: `add_worker` / `remove_worker`; `update(report)` for every
worker report (True back: the worker is out of sync and should send a snapshot report);
`route(...)` per request; `finish(request_id[, generated_tokens])` when a request ends on its
worker (or is cancelled while queued; the count, for one that ran to its end, samples the
worker's speed); `poll()` after each update and finish and on a timer, to send queued
requests that fit now and fail expired ones. Time comes from `clock` only (report ages count
from their receipt; a report's own `timestamp_s`, the worker's clock, is never compared with
it), so tests and simulations are deterministic. Not thread-safe: one caller at a time (the
router actor).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from swaserve.proto.messages import WorkerReport
from swaserve.router.approx_view import ApproxCacheView
from swaserve.router.config import RouterConfig
from swaserve.router.decision import Outcome, Overloaded, RouteDecision
from swaserve.router.exact_view import ExactCacheView
from swaserve.router.inflight_view import InflightPrompts
from swaserve.router.policies import POLICIES, Candidates, RouteRequest
from swaserve.router.request_queue import QueuedRequest, RequestQueue
from swaserve.router.stats import RouterStats
from swaserve.router.window_walk import bits_mask, held_tokens, inflight_extends, walk_runs
from swaserve.router.worker_state import RequestNeed, WorkerState
from swaserve.router.worker_table import WorkerTable


class Router:
    """Routes requests among registered workers (see the module docstring for the loop).

    Commands (`add_worker`, `remove_worker`, `update`, `route`, `poll`, `finish`) change only
    the router's own state: worker reports, cache views, in-flight requests, queue, stats.
    `predict_hits` and `check` are queries. A ROUTED decision charges the request's KV need
    to its worker until a report of that worker lists it as admitted, and counts it in the
    worker's load until `finish`.
    """

    def __init__(self, config: RouterConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.policy = POLICIES[config.policy](config)
        self.stats = RouterStats()
        self._workers: dict[str, WorkerState] = {}  # in add order
        self._owner: dict[str, str] = {}  # in-flight request id -> worker id
        self._queue = RequestQueue(config.max_queue_len)
        self._next_order = 0
        self.page_size: int | None = None  # fixed by the first report
        self._exact: ExactCacheView | None = None
        self._approx: ApproxCacheView | None = None
        self._inflight: InflightPrompts | None = None
        self._table = WorkerTable()  # the workers' columns, by bit

    # ---- workers -------------------------------------------------------------------------
    def add_worker(self, worker_id: str, *, kv_events: bool | None = None) -> None:
        """Register a worker; it takes requests once it has reported. `kv_events=False`: the
        router ignores its KV events (it may send none) and tracks its cache approximately,
        from the prompts routed to it; None: as `RouterConfig.cache_view` says."""
        if kv_events is None:
            kv_events = self.config.cache_view == "exact"
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already registered")
        used = {w.bit for w in self._workers.values()}
        bit = next(b for b in range(len(used) + 1) if b not in used)
        self._workers[worker_id] = WorkerState(
            worker_id, bit, self._next_order, kv_events, self._table
        )
        self._next_order += 1

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker, its cache view and its in-flight requests (`finish` on them then
        returns False). Queued requests stay queued."""
        state = self._worker(worker_id)
        self._drop_view(state)
        for request_id in state.inflight:
            del self._owner[request_id]
        del self._workers[worker_id]
        self._table.remove(state.bit)

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def worker(self, worker_id: str) -> WorkerState:
        """A registered worker's state (its last headroom, report time, load); a query: do
        not change it. Raises KeyError for an unknown worker."""
        return self._worker(worker_id)

    def update(self, report: WorkerReport) -> bool:
        """Take a worker's report (its age counts from now, on `clock`); returns True when
        the router asks the worker for a snapshot report (`WorkerReport.snapshot`).

        Reports apply in `seq` order per instance; an older or repeated `seq` is ignored. A
        new `instance_id` (a restart: its cache starts empty) drops the worker's cache view. A
        gap in `seq` (lost reports), or a first report of an instance with `seq` > 1 (this
        router missed its start, e.g. the router restarted), puts the worker out of sync: its
        view is kept and the next events still apply to it (what does not fit is counted in
        `stats.event_mismatches`), the worker stays routable, and every answer is True until a
        snapshot report replaces the view (`resync`). Workers without KV events are never
        asked. Raises KeyError for an unknown worker, ValueError for a page size other than
        the other workers'."""
        state = self._worker(report.worker_id)
        self.stats.reports += 1
        self._init_views(report.headroom.page_size)
        if report.instance_id != state.instance_id:
            if state.instance_id is not None:
                self.stats.restarts += 1
                self._drop_view(state)
                state.forget_report()
            state.instance_id, state.seq, state.needs_snapshot = report.instance_id, 0, False
            missed = report.seq > 1  # an instance counts its reports from 1
        elif report.seq <= state.seq:
            self.stats.out_of_order_reports += 1
            return state.needs_snapshot
        else:
            missed = report.seq != state.seq + 1
            self.stats.lost_reports += missed
        state.seq = report.seq
        if report.snapshot:
            self._resync(state, report)
        else:
            if missed and state.kv_events and not state.needs_snapshot:
                state.needs_snapshot = True
                self.stats.resyncs_requested += 1
            if state.kv_events and self._exact is not None:
                self.stats.event_mismatches += self._exact.apply(state.bit, report.events)
        now = self.clock()
        if self._inflight is not None and self._exact is not None:
            exact, bit = self._exact, state.bit
            self._inflight.settle(
                bit, lambda key: exact.holds(bit, key), now, self.config.report_timeout_s
            )
        state.take_report(report.headroom, now, report.admitted_request_ids)
        return state.needs_snapshot

    # ---- requests ------------------------------------------------------------------------
    def route(
        self,
        request_id: str,
        token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        session_key: str | None = None,
        deadline_s: float | None = None,
    ) -> RouteDecision:
        """Send the request to a worker that fits it now (ROUTED), or queue it (QUEUED) behind
        the requests already queued; a `deadline_s` (router clock; default now +
        `queue_timeout_s`) already past gives EXPIRED. Raises `Overloaded` when it would queue
        and the queue is full, ValueError on a bad or duplicate request. `token_ids` must not
        change until the request leaves the router."""
        if request_id in self._owner or request_id in self._queue:
            raise ValueError(f"request {request_id!r} is already routed or queued")
        if not token_ids or max_new_tokens < 0:
            raise ValueError(
                f"request {request_id!r}: need a non-empty prompt and max_new_tokens >= 0, "
                f"got {len(token_ids)} tokens and max_new_tokens={max_new_tokens}"
            )
        request = RouteRequest(request_id, token_ids, max_new_tokens, session_key)
        now = self.clock()
        if not self._queue:
            decision = self._place(request, now, now)
            if decision is not None:
                return decision
        deadline = now + self.config.queue_timeout_s if deadline_s is None else deadline_s
        if deadline <= now:
            return self._decide(RouteDecision(request_id, Outcome.EXPIRED, policy=self.policy.name))
        if self._queue.full:
            self.stats.decisions[self.policy.name, "overloaded"] += 1
            raise Overloaded(request_id, len(self._queue))
        self._queue.push(QueuedRequest(request, now, deadline))
        self.stats.queue_len = len(self._queue)
        return self._decide(RouteDecision(request_id, Outcome.QUEUED, policy=self.policy.name))

    def poll(self) -> list[RouteDecision]:
        """Decisions for queued requests: EXPIRED for those past their deadline, then ROUTED
        for those that fit now, in queue order, stopping at the first that does not (or that
        the policy holds, `Policy.hold`)."""
        now = self.clock()
        out = []
        for q in self._queue.pop_expired(now):
            self.stats.record_wait(now - q.enqueued_at_s)
            decision = RouteDecision(
                q.request.request_id,
                Outcome.EXPIRED,
                policy=self.policy.name,
                queued_s=now - q.enqueued_at_s,
            )
            out.append(self._decide(decision))
        while (head := self._queue.head()) is not None:
            routed = self._place(head.request, now, head.enqueued_at_s)
            if routed is None:
                break
            self._queue.pop_head()
            self.stats.record_wait(now - head.enqueued_at_s)
            out.append(routed)
        self.stats.queue_len = len(self._queue)
        return out

    def finish(self, request_id: str, generated_tokens: int | None = None) -> bool:
        """The request ended on its worker (or is cancelled while queued): release what it
        held in the router. `generated_tokens`, for a request that ran to its end: the time
        since its routing over them samples the worker's speed (`WorkerState.observe`; the
        `ttft` policy scales its costs by it). Returns False for an unknown id."""
        if self._queue.remove(request_id) is not None:
            self.stats.queue_len = len(self._queue)
            return True
        worker_id = self._owner.pop(request_id, None)
        if worker_id is None:
            return False
        state = self._workers[worker_id]
        r = state.remove(request_id)
        if generated_tokens:
            state.observe(self.clock() - r.routed_at_s, generated_tokens)
        if self._inflight is not None:
            if generated_tokens:
                self._inflight.finished(request_id, self.clock())
            else:
                self._inflight.remove(request_id)
        return True

    @property
    def queue_len(self) -> int:
        return len(self._queue)

    def predict_hits(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Per reported worker, the tokens of `token_ids` its prefix cache would let a request
        skip: the `saved_tokens` of the worker's `match_prefix(token_ids, allow_repair=True)`
        (exact view; a repaired hit counts its match less the R tokens it recomputes; or the
        prompts routed there that no report shows cached yet, when they hold more, `_hits`)
        or the longest prompt prefix routed there (approximate view). A query: changes
        nothing."""
        self._table.flush()
        hits = self._hits(token_ids, self._table.reported, self._keys(token_ids))
        return {w.worker_id: int(hits[w.bit]) for w in self._workers.values() if w.headroom}

    def check(self) -> None:
        """Raise AssertionError (`CacheViewCorrupted` for the views) on a broken invariant:
        the views, the workers' table, in-flight ownership, queue/in-flight overlap, the queue
        length stat, pending totals, and a snapshot awaited only from workers that send KV
        events."""
        self._table.check(self._workers.values())
        if self._exact is not None:
            self._exact.check()
        if self._approx is not None:
            self._approx.check()
        if self._inflight is not None:
            bits = {w.worker_id: w.bit for w in self._workers.values()}
            self._inflight.check(lambda rid: bits.get(self._owner.get(rid, "")))
        owned = {rid: w.worker_id for w in self._workers.values() for rid in w.inflight}
        if owned != self._owner:
            raise AssertionError("in-flight requests and their owners disagree")
        if any(rid in self._queue for rid in owned) or self.stats.queue_len != len(self._queue):
            raise AssertionError("a request is both queued and in flight, or queue_len is off")
        if len({w.bit for w in self._workers.values()}) != len(self._workers):
            raise AssertionError("two workers share a cache-view bit")
        for w in self._workers.values():
            if w.needs_snapshot and not w.kv_events:
                raise AssertionError(
                    f"worker {w.worker_id!r} sends no events but awaits a snapshot"
                )
            pending = [r for r in w.inflight.values() if r.pending]
            totals = (
                sum(r.need.full_tokens for r in pending),
                sum(r.prefill_tokens for r in pending),
                len(pending),
            )
            if totals != (w.pending_full_tokens, w.pending_prefill_tokens, w.num_pending):
                raise AssertionError(f"worker {w.worker_id!r}: pending totals are off")

    # ---- internals -----------------------------------------------------------------------
    def _place(
        self, request: RouteRequest, now: float, enqueued_at_s: float
    ) -> RouteDecision | None:
        """Route to the policy's choice among the fresh workers that fit; None if none fits,
        or if the policy holds the request (for at most `max_hold_s` since it was queued) for
        a worker that lacks room now but would fit it idle. Over the workers as columns
        (`WorkerTable`), by bit."""
        t = self._table
        t.flush()
        fresh = t.fresh(now, self.config.report_timeout_s)
        self.stats.stale_skips += len(self._workers) - int(np.count_nonzero(fresh))
        # The engine keeps the last prompt token to compute, so it matches the prompt minus it.
        keys = self._keys(request.token_ids)
        query = keys[: (len(request.token_ids) - 1) // self._page_size]
        hits = self._hits(request.token_ids[:-1], fresh, query)
        full, swa = t.needs(len(request.token_ids), hits, request.max_new_tokens)
        fits = fresh & (full <= t.full_budget) & (swa <= t.swa_budget)
        rows = t.by_order[fits[t.by_order]]
        if not rows.size:
            return None
        speeds = t.speeds(fresh)
        candidates = self._candidates(rows, hits, speeds)
        i = self.policy.pick(request, candidates)
        bit, chosen = int(rows[i]), candidates[i]
        if now - enqueued_at_s < self.config.max_hold_s:
            idle = (full <= t.full_total) & (swa <= t.swa_total)
            waiting = t.by_order[(fresh & ~fits & idle)[t.by_order]]
            if waiting.size and self.policy.hold(
                request, chosen, self._candidates(waiting, hits, speeds)
            ):
                return None
        self.policy.placed(request, chosen)
        state = self._workers[chosen.worker_id]
        uncached = len(request.token_ids) - chosen.hit_tokens
        state.add(request.request_id, RequestNeed(int(full[bit]), int(swa[bit])), now, uncached)
        self._owner[request.request_id] = chosen.worker_id
        if not state.kv_events and self._approx is not None:
            self._approx.record(state.bit, request.token_ids)
        elif state.kv_events and self._inflight is not None:
            self._inflight.add(request.request_id, state.bit, keys)
        self.stats.prompt_tokens += len(request.token_ids)
        self.stats.predicted_hit_tokens += chosen.hit_tokens
        decision = RouteDecision(
            request.request_id,
            Outcome.ROUTED,
            chosen.worker_id,
            self.policy.name,
            chosen.hit_tokens,
            now - enqueued_at_s,
        )
        return self._decide(decision)

    def _candidates(self, rows: np.ndarray, hits: np.ndarray, speeds: np.ndarray) -> Candidates:
        """The workers at bits `rows` as the policy sees them."""
        t = self._table
        return Candidates(
            t.ids[rows],
            t.order[rows],
            t.load[rows],
            hits[rows],
            t.queued[rows],
            speeds[rows],
            t.full_free[rows],
            t.full_total[rows],
            t.decode[rows],
        )

    def _keys(self, token_ids: Sequence[int]) -> list[int]:
        """The exact view's fingerprints of the whole pages of `token_ids` ([] before the
        first report, when there is no view)."""
        return [] if self._exact is None else self._exact.prompt_keys(token_ids)

    @property
    def _page_size(self) -> int:
        return self.page_size or 1

    def _hits(self, token_ids: Sequence[int], among: np.ndarray, keys: list[int]) -> np.ndarray:
        """By bit, the prompt tokens a hit saves the workers of `among` (`predict_hits`);
        `keys`: `_keys(token_ids)`; the table is flushed.

        An event-sending worker's hit comes from its exact view, unless the prompts routed to
        it that no report shows cached yet (`InflightPrompts`) hold a longer run of the
        prompt's pages F' than the view's run F: the pages past F are new KV, all of it in the
        tree once those prefills end, so the match ends on live SWA KV when F' − F >= W (or
        F = 0) and saves F' tokens. A shorter extension keeps the view's answer, whose window
        rule sees the tombstones before F."""
        t = self._table
        hits = np.zeros(t.capacity, np.int64)
        exact = bits_mask(among & t.kv_events)
        if exact and self._exact is not None:
            runs = self._exact.runs(keys)
            hits = walk_runs(
                runs, self._exact.page_size, exact, t.window, t.repair, chunks=t.span_chunk
            )
            if self._inflight is not None and len(self._inflight):
                flying = self._inflight.match_columns(keys, exact, t.capacity)
                if flying.any():
                    held = held_tokens(runs, self._exact.page_size, exact, t.capacity)
                    extends = inflight_extends(flying, held, t.window)
                    hits = np.where(extends, flying, hits)
        approx = bits_mask(among & ~t.kv_events)
        if approx and self._approx is not None:
            zeros = np.zeros(t.capacity, np.int64)
            hits = hits + self._approx.match_columns(token_ids, approx, zeros, zeros)
        return hits

    def _decide(self, decision: RouteDecision) -> RouteDecision:
        self.stats.decisions[decision.policy, decision.outcome.value] += 1
        return decision

    def _init_views(self, page_size: int) -> None:
        if self.page_size is None:
            self.page_size = page_size
            self._exact = ExactCacheView(page_size)
            self._approx = ApproxCacheView(page_size, self.config.approx_max_tokens)
            if self.config.inflight_prefixes:
                self._inflight = InflightPrompts(page_size)
        elif page_size != self.page_size:
            raise ValueError(
                f"a worker reports page_size={page_size}; this router's workers use "
                f"{self.page_size} (one router serves one model)"
            )

    def _resync(self, state: WorkerState, report: WorkerReport) -> None:
        """A snapshot report: the worker's exact view becomes the snapshot's pages."""
        self.stats.snapshots += 1
        state.needs_snapshot = False
        if state.kv_events and self._exact is not None:
            self._exact.drop(state.bit)
            self.stats.event_mismatches += self._exact.apply(state.bit, report.events)

    def _drop_view(self, state: WorkerState) -> None:
        if self._exact is not None:
            self._exact.drop(state.bit)
        if self._inflight is not None:
            self._inflight.drop(state.bit)
        if self._approx is not None:
            self._approx.drop(state.bit)

    def _worker(self, worker_id: str) -> WorkerState:
        state = self._workers.get(worker_id)
        if state is None:
            raise KeyError(f"unknown worker {worker_id!r}; add_worker() it first")
        return state
