"""RouterActor: the cluster's one `Router`, as an async Ray actor.

Every method runs on the actor's event loop thread, one at a time between awaits, which is
the one-caller rule of `Router`. Workers push `update(report)` without waiting for it; its
answer, True when the router lost track of the worker's cache and wants a snapshot report,
reaches them on another thread (`EngineLoop.take_router_answer`). The ingress awaits
`route(...)`, which answers at once when a worker fits and otherwise waits in the router's
queue until a report or a `finish` frees room (or its deadline passes). A timer polls the
queue every `POLL_INTERVAL_S` so that expiries and stale workers are seen without traffic.
The process calls `gc.freeze()` once it is set up: the router's long-lived tables then stay
out of the collector's scans.
"""

from __future__ import annotations

import asyncio
import gc
import os
from dataclasses import dataclass
from typing import Any

from swaserve.proto.messages import Headroom, WorkerReport
from swaserve.router import Outcome, Overloaded, RouteDecision, Router, RouterConfig

POLL_INTERVAL_S = 0.05


@dataclass(frozen=True, slots=True)
class RouteAnswer:
    """`outcome`: "routed" (go to `worker_id`), "overloaded" (the queue is full), "expired"
    (waited past its deadline), "no_workers" (no worker is registered) or "invalid" (e.g. the
    id is already in flight; `message` says why)."""

    outcome: str
    worker_id: str | None = None
    predicted_hit_tokens: int = 0
    queued_s: float = 0.0
    queue_len: int = 0
    message: str = ""


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    worker_id: str
    headroom: Headroom | None
    report_age_s: float
    load: int


class RouterActor:
    def __init__(self, config: RouterConfig) -> None:
        self.router = Router(config)
        self._removed: set[str] = set()  # workers taken out: their late reports are ignored
        self._waiting: dict[str, asyncio.Future[RouteDecision]] = {}
        self._poller: asyncio.Task[None] | None = None
        gc.freeze()

    def _ensure_poller(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            self._poll()

    def _poll(self) -> None:
        for decision in self.router.poll():
            future = self._waiting.pop(decision.request_id, None)
            if future is not None and not future.done():
                future.set_result(decision)
            elif decision.outcome is Outcome.ROUTED:  # its caller left: give the room back
                self.router.finish(decision.request_id)

    # ---- workers -------------------------------------------------------------------------
    async def add_worker(self, worker_id: str) -> None:
        """Register a worker (idempotent); a worker's first report registers it too."""
        self._ensure_poller()
        if worker_id not in self.router.worker_ids and worker_id not in self._removed:
            self.router.add_worker(worker_id)

    async def remove_worker(self, worker_id: str) -> None:
        """Take a worker out for good (a restarted one comes back under a new id)."""
        self._removed.add(worker_id)
        if worker_id in self.router.worker_ids:
            self.router.remove_worker(worker_id)

    async def update(self, report: WorkerReport) -> bool:
        """Take a worker's report (`Router.update`); True: send a snapshot report."""
        if report.worker_id in self._removed:
            return False  # a report of a removed worker still in flight
        await self.add_worker(report.worker_id)
        resync = self.router.update(report)
        self._poll()
        return resync

    # ---- requests ------------------------------------------------------------------------
    async def route(
        self,
        request_id: str,
        token_ids: list[int],
        max_new_tokens: int,
        session_key: str | None = None,
        timeout_s: float | None = None,
    ) -> RouteAnswer:
        self._ensure_poller()
        if not self.router.worker_ids:
            return RouteAnswer("no_workers")
        now = self.router.clock()
        deadline = None if timeout_s is None else now + timeout_s
        try:
            decision = self.router.route(
                request_id, token_ids, max_new_tokens, session_key=session_key, deadline_s=deadline
            )
        except Overloaded as exc:
            return RouteAnswer("overloaded", queue_len=exc.queue_len)
        except ValueError as exc:  # a duplicate id or an empty prompt: the caller's mistake
            return RouteAnswer("invalid", message=str(exc))
        if decision.outcome is Outcome.QUEUED:
            future: asyncio.Future[RouteDecision] = asyncio.get_running_loop().create_future()
            self._waiting[request_id] = future
            try:
                decision = await future
            except asyncio.CancelledError:
                self._waiting.pop(request_id, None)
                self.router.finish(request_id)
                raise
        if decision.outcome is Outcome.EXPIRED:
            return RouteAnswer(
                "expired", queued_s=decision.queued_s, queue_len=self.router.queue_len
            )
        return RouteAnswer(
            "routed", decision.worker_id, decision.predicted_hit_tokens, decision.queued_s
        )

    async def finish(self, request_id: str, generated_tokens: int | None = None) -> None:
        """The request ended (`generated_tokens`: it ran to its end, after that many tokens)
        or its caller left; see `Router.finish`."""
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()
        self.router.finish(request_id, generated_tokens)
        self._poll()

    # ---- queries -------------------------------------------------------------------------
    async def workers(self) -> list[WorkerStatus]:
        now = self.router.clock()
        out = []
        for worker_id in self.router.worker_ids:
            state = self.router.worker(worker_id)
            age = now - state.reported_at_s if state.headroom is not None else float("inf")
            out.append(WorkerStatus(worker_id, state.headroom, age, state.load))
        return out

    async def stats(self) -> dict[str, Any]:
        stats = self.router.stats
        return {
            "policy": self.router.policy.name,
            "queue_len": self.router.queue_len,
            "decisions": {f"{p}/{o}": n for (p, o), n in stats.decisions.items()},
            "prompt_tokens": stats.prompt_tokens,
            "predicted_hit_tokens": stats.predicted_hit_tokens,
            "reports": stats.reports,
            "resyncs_requested": stats.resyncs_requested,
            "snapshots": stats.snapshots,
        }

    async def check(self) -> None:
        self.router.check()

    async def predict_hits(self, token_ids: list[int]) -> dict[str, int]:
        """Per reported worker, the prompt tokens its cache would save (`Router.predict_hits`)."""
        return self.router.predict_hits(token_ids)

    async def pid(self) -> int:
        """The actor's process (what a chaos test kills)."""
        return os.getpid()
