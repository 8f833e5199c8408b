"""What the router knows of one worker: its latest report, the requests routed to it, and the
KV budgets that admission checks against (architecture §6 admission, seen from the router).

A report is a snapshot of the worker when it was made. It lists the requests the engine took
since the previous report (`admitted_request_ids`; a snapshot report lists all open ones):
those are in it (admitted: their KV is allocated; waiting: counted in `queued_prefill_tokens`).
A request routed to the worker and not listed yet is "pending": its need is charged against
the report until a report lists it. No clock is compared across hosts: a report's age is
measured from its receipt, on the router's clock.

    full budget = full free + full evictable - full reserved (running decodes)
                  - queued prefill tokens - Σ pending full need
    SWA budget  = SWA free + SWA evictable - SWA reserved - waiting × (W + P)
                  - min(queued prefill, waiting × chunk) - Σ pending SWA need
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from swaserve.proto.kv_rules import swa_tokens_for_extend
from swaserve.proto.messages import Headroom


@dataclass(frozen=True, slots=True)
class RequestNeed:
    """KV tokens a request needs on one worker: `full` for the uncached prompt and all new
    tokens (full KV stays), `swa` for one prefill chunk plus the window before it and a page."""

    full_tokens: int
    swa_tokens: int


def request_need(
    headroom: Headroom, num_prompt_tokens: int, hit_tokens: int, max_new_tokens: int
) -> RequestNeed:
    """`full ≈ prompt − hit + max_new`; `swa ≈ min(prompt − hit, chunk) + W + P` (0 on a
    single-pool worker, whose SWA fields mirror the full ones). `hit_tokens` are the tokens
    the hit saves: a repaired hit's R recomputed tokens take new slots of both pools while
    they are computed, so they count as uncached here."""
    uncached = num_prompt_tokens - hit_tokens
    if not headroom.hybrid:
        return RequestNeed(uncached + max_new_tokens, 0)
    chunk = min(uncached, headroom.chunked_prefill_size or uncached)
    swa = swa_tokens_for_extend(chunk, headroom.sliding_window_size, headroom.page_size)
    return RequestNeed(uncached + max_new_tokens, swa)


@dataclass(slots=True)
class InFlight:
    """A request routed to a worker (at `routed_at_s`, router clock) and not finished.
    `pending`: no report of the worker listed it yet, so its need is in none (nor its
    `prefill_tokens` in the report's queued prefill)."""

    need: RequestNeed
    routed_at_s: float
    pending: bool = True
    prefill_tokens: int = 0  # its uncached prompt tokens (the prefill it will cost the worker)


class WorkerState:
    """One worker: identity (`bit`: its position in the cache views; `order`: add order),
    report tracking (`instance_id`, `seq`, `headroom`, `reported_at_s`: when the router got
    the latest report, on its own clock; `needs_snapshot`: reports went missing and the
    router waits for a snapshot report) and in-flight requests with running totals of the
    pending ones (`add`, `remove`, `take_report` keep them)."""

    def __init__(self, worker_id: str, bit: int, order: int, kv_events: bool) -> None:
        self.worker_id = worker_id
        self.bit = bit
        self.order = order
        self.kv_events = kv_events
        self.instance_id: str | None = None
        self.seq = 0
        self.needs_snapshot = False
        self.headroom: Headroom | None = None
        self.reported_at_s = float("-inf")
        self.inflight: dict[str, InFlight] = {}
        self.pending = RequestNeed(0, 0)  # Σ needs of the pending requests
        self.pending_prefill_tokens = 0  # Σ prefill tokens of the pending requests
        self.num_pending = 0

    def is_fresh(self, now_s: float, timeout_s: float) -> bool:
        """Reported within `timeout_s` of `now_s` (never: not fresh)."""
        return self.headroom is not None and now_s - self.reported_at_s <= timeout_s

    @property
    def load(self) -> int:
        """Requests on the worker: the router's own count of unfinished requests routed there,
        or the report's running + waiting plus those routed since, whichever is larger (other
        routers or clients may feed the worker too)."""
        reported = 0
        if self.headroom is not None:
            reported = self.headroom.num_running + self.headroom.num_waiting
        return max(len(self.inflight), reported + self.num_pending)

    def budgets(self) -> tuple[int, int]:
        """(full, SWA) tokens a new request may still take (see the module docstring)."""
        h = self.headroom
        if h is None:
            return 0, 0
        full = (
            h.full_available_tokens
            - h.full_reserved_tokens
            - h.queued_prefill_tokens
            - self.pending.full_tokens
        )
        if not h.hybrid:
            return full, full
        chunk = h.chunked_prefill_size or h.queued_prefill_tokens
        window = swa_tokens_for_extend(0, h.sliding_window_size, h.page_size)  # W + P
        waiting_swa = h.num_waiting * window + min(h.queued_prefill_tokens, h.num_waiting * chunk)
        swa = h.swa_available_tokens - h.swa_reserved_tokens - waiting_swa - self.pending.swa_tokens
        return full, swa

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens the worker has to prefill before a request sent now: the waiting
        prompts of its last report plus the uncached tokens of the pending requests."""
        reported = 0 if self.headroom is None else self.headroom.queued_prefill_tokens
        return reported + self.pending_prefill_tokens

    def fits(self, need: RequestNeed) -> bool:
        full, swa = self.budgets()
        return need.full_tokens <= full and need.swa_tokens <= swa

    def add(
        self, request_id: str, need: RequestNeed, now_s: float, prefill_tokens: int = 0
    ) -> None:
        """A request was routed here at `now_s` with `prefill_tokens` uncached prompt tokens:
        pending until a report covers it."""
        r = self.inflight[request_id] = InFlight(need, now_s, prefill_tokens=prefill_tokens)
        self._count(r, +1)

    def remove(self, request_id: str) -> None:
        r = self.inflight.pop(request_id)
        if r.pending:
            self._count(r, -1)

    def take_report(
        self, headroom: Headroom, received_at_s: float, admitted_request_ids: Iterable[str]
    ) -> None:
        """A newer report, received at `received_at_s` (router clock): the requests it lists
        are in it and stop being pending; ids the router does not know here are skipped
        (finished already, or routed by an earlier router)."""
        self.headroom = headroom
        self.reported_at_s = received_at_s
        for request_id in admitted_request_ids:
            r = self.inflight.get(request_id)
            if r is not None and r.pending:
                r.pending = False
                self._count(r, -1)

    def _count(self, r: InFlight, sign: int) -> None:
        need = r.need
        self.pending_prefill_tokens += sign * r.prefill_tokens
        self.pending = RequestNeed(
            self.pending.full_tokens + sign * need.full_tokens,
            self.pending.swa_tokens + sign * need.swa_tokens,
        )
        self.num_pending += sign
