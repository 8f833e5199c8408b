"""What the router knows of one worker: its latest report, the requests routed to it, and the
KV budgets that admission checks against (architecture §6 admission, seen from the router).

A report is a snapshot of the worker when it was made. It lists the requests the engine took
since the previous report (`admitted_request_ids`; a snapshot report lists all open ones):
those are in it (admitted: their KV is allocated; waiting: counted in `queued_prefill_tokens`).
A request routed to the worker and not listed yet is "pending": its need is charged against
the report until a report lists it. No clock is compared across hosts: a report's age is
measured from its receipt, on the router's clock.

    full budget = full free + full evictable - full reserved (running decodes)
                  - waiting full need - Σ pending full need
    SWA budget  = SWA free + SWA evictable - SWA reserved
                  - (waiting + pending) × (max(W + P, SWA held / running)
                                           + SWA reserved / running)
                  - min(queued + pending prefill, chunk)

Full KV stays, so every queued request's full need counts: a waiting request the router
routed is charged its own need (uncached prompt + new tokens, what the engine's admission
charges it; a report counts its prompt whole, cached prefix and all), another one its whole
prompt as the report counts it (`_waiting_full_tokens`). SWA does not: a queued request
holds SWA KV once it runs as a running one does now (at least its window), and reserves what
one reserves (the worker charges that reserve to every request it admits later), but the prefill chunks before it come one step budget
(`chunk`) at a time, and a chunk's out-of-window SWA is freed as the prefill moves on, so
the queue holds one chunk of SWA at most, not one per request.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from swaserve.proto.kv_rules import swa_tokens_for_extend
from swaserve.proto.messages import Headroom
from swaserve.router.worker_table import NO_CHUNK, WorkerTable, need_tokens


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
    full, swa = need_tokens(
        num_prompt_tokens - hit_tokens,
        max_new_tokens,
        headroom.hybrid,
        headroom.chunked_prefill_size or NO_CHUNK,
        headroom.sliding_window_size,
        headroom.page_size,
    )
    return RequestNeed(int(full), int(swa))


@dataclass(slots=True)
class InFlight:
    """A request routed to a worker (at `routed_at_s`, router clock) and not finished.
    `pending`: no report of the worker listed it yet, so its need is in none (nor its
    `prefill_tokens` in the report's queued prefill)."""

    need: RequestNeed
    routed_at_s: float
    pending: bool = True
    prefill_tokens: int = 0  # its uncached prompt tokens (the prefill it will cost the worker)


DECAY = 0.9
"""Weight of the past in a worker's observed speed (per finished request) and prefix reuse
(per report that admitted prompts): the last ~10 samples count."""


class WorkerState:
    """One worker: identity (`bit`: its position in the cache views; `order`: add order),
    report tracking (`instance_id`, `seq`, `headroom`, `reported_at_s`: when the router got
    the latest report, on its own clock; `needs_snapshot`: reports went missing and the
    router waits for a snapshot report), in-flight requests with running totals of the
    pending ones (`add`, `remove`, `take_report` keep them) and its speed: observed per
    finished request (`s_per_token`, kept by `observe`) and measured by its reports
    (`s_per_prefill_token`, kept by `take_report`). With a `table`, it is added there, and
    each of those methods marks its row stale there (`WorkerTable.changed`)."""

    def __init__(
        self,
        worker_id: str,
        bit: int,
        order: int,
        kv_events: bool,
        table: WorkerTable | None = None,
    ) -> None:
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
        self.pending_full_tokens = 0  # Σ full needs of the pending requests
        self.pending_prefill_tokens = 0  # Σ prefill tokens of the pending requests
        self.num_pending = 0
        self._busy_s = 0.0  # decayed Σ seconds from routing to finish of observed requests
        self._prompt_tokens = 0.0  # decayed Σ prompt tokens the worker admitted ...
        self._cached_tokens = 0.0  # ... and Σ of them its prefix cache held
        self._generated_tokens = 0.0  # decayed Σ their generated tokens
        self._prefill_s = 0.0  # decayed Σ seconds of the worker's prefill steps (its reports) ...
        self._prefill_tokens = 0.0  # ... and Σ the prompt tokens they computed
        self._decode_s = 0.0  # decayed Σ seconds of its decode-only steps (its reports) ...
        self._decode_steps = 0.0  # ... and Σ how many
        self._table = table
        if table is not None:
            table.add(self)

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
            - self._waiting_full_tokens(h)
            - self.pending_full_tokens
        )
        if not h.hybrid:
            return full, full
        queued = h.queued_prefill_tokens + self.pending_prefill_tokens
        prefill = min(queued, h.chunked_prefill_size or queued)  # one chunk in flight at most
        # Once running, each queued request holds SWA KV as a running one does now: at
        # least its window (W + P), or what the running requests hold each (their windows,
        # a chunk under way, the cached windows their locks keep), plus what one reserves
        # (its decode's SWA until the next out-of-window free: the worker charges that to
        # every request admitted after it).
        each = swa_tokens_for_extend(0, h.sliding_window_size, h.page_size)  # W + P
        if h.num_running:
            held = h.swa_total_tokens - h.swa_available_tokens
            each = max(each, held // h.num_running) + h.swa_reserved_tokens // h.num_running
        queued_swa = (h.num_waiting + self.num_pending) * each + prefill
        swa = h.swa_available_tokens - h.swa_reserved_tokens - queued_swa
        return full, swa

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens the worker has to compute before a request sent now: the rest of
        the prefills under way in its last report, the uncached part of its waiting prompts
        (a report counts them whole: they are not matched until admitted;
        `_waiting_prefill_tokens`), and the uncached tokens of the pending requests."""
        h = self.headroom
        if h is None:
            return self.pending_prefill_tokens
        return h.prefilling_tokens + self._waiting_prefill_tokens(h) + self.pending_prefill_tokens

    def _waiting_requests(self, h: Headroom) -> list[InFlight] | None:
        """The worker's `num_waiting` waiting requests when the router routed them all: the
        worker admits in order, so they are the last it took (listed by a report); None
        when it routed fewer."""
        taken = (r for r in reversed(self.inflight.values()) if not r.pending)
        last = list(islice(taken, h.num_waiting))
        return last if len(last) == h.num_waiting else None

    def _waiting_full_tokens(self, h: Headroom) -> int:
        """Full KV the worker's waiting requests will take once admitted: their full needs
        when the router routed them (a fan-out waiting behind its prefix takes its suffix
        and its reply), else their whole prompts as the report counts them."""
        waiting = self._waiting_requests(h) if h.num_waiting else None
        if waiting is None:  # (none waiting: the report's count, 0 from an engine)
            return h.queued_prefill_tokens
        return sum(r.need.full_tokens for r in waiting)

    def _waiting_prefill_tokens(self, h: Headroom) -> int:
        """The uncached part of the worker's waiting prompts. The worker admits in order, so
        its `num_waiting` waiting requests are the last it took: when the router routed that
        many, their predicted uncached tokens (hits on prompts in flight included: a fan-out
        that waits behind the prefill of its prefix) answer it; else the share its cache
        has been saving of the whole waiting prompts the report counts."""
        whole = h.queued_prefill_tokens
        if h.num_waiting and (waiting := self._waiting_requests(h)) is not None:
            return min(whole, sum(r.prefill_tokens for r in waiting))
        return round(whole * (1.0 - self.reuse))

    @property
    def reuse(self) -> float:
        """Share of the recently admitted prompt tokens that the worker's cache held, from the
        reports' counters (`prompt_tokens_total`, `cached_tokens_total`); 0.0 before any."""
        return self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0

    def fits(self, need: RequestNeed) -> bool:
        full, swa = self.budgets()
        return need.full_tokens <= full and need.swa_tokens <= swa

    def fits_when_idle(self, need: RequestNeed) -> bool:
        """The need fits the worker's pools with nothing else on them."""
        h = self.headroom
        if h is None:
            return False
        return need.full_tokens <= h.full_total_tokens and need.swa_tokens <= h.swa_total_tokens

    def add(
        self, request_id: str, need: RequestNeed, now_s: float, prefill_tokens: int = 0
    ) -> None:
        """A request was routed here at `now_s` with `prefill_tokens` uncached prompt tokens:
        pending until a report covers it."""
        r = self.inflight[request_id] = InFlight(need, now_s, prefill_tokens=prefill_tokens)
        self._count(r, +1)
        self._write(report=False)

    def remove(self, request_id: str) -> InFlight:
        """The request left the worker; returns its record."""
        r = self.inflight.pop(request_id)
        if r.pending:
            self._count(r, -1)
        self._write(report=False)
        return r

    def observe(self, elapsed_s: float, generated_tokens: int) -> None:
        """A request generated `generated_tokens` (> 0) in the `elapsed_s` from its routing
        to its finish: a sample of the worker's speed (decode dominates it; its queue and
        prefill add to it as they would to the next request's)."""
        self._busy_s = DECAY * self._busy_s + elapsed_s
        self._generated_tokens = DECAY * self._generated_tokens + generated_tokens
        self._write(report=False)

    @property
    def s_per_token(self) -> float | None:
        """Seconds per generated token over the recent observed requests; None before any."""
        if not self._generated_tokens:
            return None
        return self._busy_s / self._generated_tokens

    @property
    def s_per_prefill_token(self) -> float | None:
        """Seconds per prompt token of the worker's recent prefill steps, as its reports'
        counters measure them (`prefill_s_total`, `prefill_tokens_total`); None before any."""
        if not self._prefill_tokens:
            return None
        return self._prefill_s / self._prefill_tokens

    @property
    def prefill_sample(self) -> tuple[float, float]:
        """(seconds, prompt tokens) of the worker's recent prefill steps, decayed as
        `s_per_prefill_token` weighs them: how much evidence its speed rests on
        (`WorkerTable.speeds` weighs it against the fleet's)."""
        return self._prefill_s, self._prefill_tokens

    @property
    def s_per_decode_step(self) -> float | None:
        """Seconds of the worker's recent decode-only steps (`decode_s_total`,
        `decode_steps_total`): what its running requests cost each step, which a new
        request's first step shares; None before any."""
        if not self._decode_steps:
            return None
        return self._decode_s / self._decode_steps

    @property
    def decode_tokens(self) -> int:
        """The worker's running decodes as work: its decode step's seconds in its own prompt
        tokens (a first token waits for about one step besides the prefills; 0 with nothing
        running or before both speeds are measured)."""
        h, step, token = self.headroom, self.s_per_decode_step, self.s_per_prefill_token
        if h is None or not h.num_running or step is None or not token:
            return 0
        return round(step / token)

    def take_report(
        self, headroom: Headroom, received_at_s: float, admitted_request_ids: Iterable[str]
    ) -> None:
        """A newer report, received at `received_at_s` (router clock): the requests it lists
        are in it and stop being pending; ids the router does not know here are skipped
        (finished already, or routed by an earlier router). The counters' growth since the
        previous report samples the worker's reuse and its prefill speed; without a previous
        report (the first, or the first since a restart: `forget_report`) the prefill
        counters since the instance's start do, which include the prefill the engine times
        at start."""
        previous = self.headroom
        if previous is not None:
            prompt = headroom.prompt_tokens_total - previous.prompt_tokens_total
            cached = headroom.cached_tokens_total - previous.cached_tokens_total
            if prompt > 0 and 0 <= cached <= prompt:
                self._prompt_tokens = DECAY * self._prompt_tokens + prompt
                self._cached_tokens = DECAY * self._cached_tokens + cached
        computed, spent = headroom.prefill_tokens_total, headroom.prefill_s_total
        if previous is not None:  # else: an instance's first report, counting from its start
            computed -= previous.prefill_tokens_total
            spent -= previous.prefill_s_total
        if computed > 0 and spent > 0:
            self._prefill_tokens = DECAY * self._prefill_tokens + computed
            self._prefill_s = DECAY * self._prefill_s + spent
        steps, spent = headroom.decode_steps_total, headroom.decode_s_total
        if previous is not None:
            steps -= previous.decode_steps_total
            spent -= previous.decode_s_total
        if steps > 0 and spent > 0:
            self._decode_steps = DECAY * self._decode_steps + steps
            self._decode_s = DECAY * self._decode_s + spent
        self.headroom = headroom
        self.reported_at_s = received_at_s
        for request_id in admitted_request_ids:
            r = self.inflight.get(request_id)
            if r is not None and r.pending:
                r.pending = False
                self._count(r, -1)
        self._write()

    def forget_report(self) -> None:
        """The worker restarted: its last report's counters are no base for the new
        instance's (the next report replaces the report itself)."""
        self.headroom = None

    def _write(self, *, report: bool = True) -> None:
        if self._table is not None:
            self._table.changed(self, report=report)

    def _count(self, r: InFlight, sign: int) -> None:
        self.pending_full_tokens += sign * r.need.full_tokens
        self.pending_prefill_tokens += sign * r.prefill_tokens
        self.num_pending += sign
