"""The workers as columns: what a routing decision reads of every worker, one numpy array per
field, indexed by the worker's cache-view bit, so that a decision over a fleet is a few array
operations instead of a Python loop over the workers.

A row holds a worker's report fields that a request's need depends on (W, R, P, chunk, pool
sizes), and what its own methods derive from its state (`budgets`, `load`,
`queued_prefill_tokens`, `s_per_token`), computed there, so the admission rules have one
implementation. Each `WorkerState` marks its row stale when it changes (`changed`), and the
router writes the stale rows (`flush`) before it reads the columns: a worker that reports
many times between two decisions costs one row write, not one per report. Only what depends
on the request (its need, the fit) or on the clock (freshness) is computed per decision, over
the columns. `check` recomputes every row from its state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from swaserve.proto.kv_rules import swa_tokens_for_extend

if TYPE_CHECKING:
    from swaserve.router.worker_state import WorkerState

NO_CHUNK = np.iinfo(np.int64).max
"""`chunk` of a worker without chunked prefill: a prompt is one chunk, however long."""

SAME_SPEED = 0.75
"""Workers estimated at least this share of the fastest one's prefill speed count as equally
fast: alike workers on a shared CPU measure tens of percent apart from step to step, and a
turn whose history one of them caches must not move to a cold one for that (a worker at half
speed still counts as slow)."""

SPEED_PRIOR_TOKENS = 1024
"""How many prompt tokens of the fleet's pooled prefill speed each worker's own measure is
blended with (`WorkerTable.speeds`). A few hundred measured tokens are a handful of steps, and
one step stalled by the host (a loaded CPU, a collection pause) then makes a worker look
several times slower than its twin: its own speed counts in full only once it rests on many
more tokens than this. The start-up prefill (256 tokens) alone tells a worker 10x slower, not
one 4x slower."""

_COLUMNS: tuple[tuple[str, type, object], ...] = (
    ("present", np.bool_, False),  # a registered worker has this bit
    ("reported", np.bool_, False),  # it has reported (has a headroom)
    ("kv_events", np.bool_, False),
    ("order", np.int64, 0),  # add order
    ("reported_at", np.float64, -np.inf),  # router clock
    ("hybrid", np.bool_, False),
    ("window", np.int64, 0),  # W
    ("repair", np.int64, 0),  # R (0: it does not repair)
    ("span_chunk", np.int64, 0),  # C of chunked local layers (0: a sliding window)
    ("page", np.int64, 1),  # P
    ("chunk", np.int64, NO_CHUNK),
    ("full_budget", np.int64, 0),  # `WorkerState.budgets()`
    ("swa_budget", np.int64, 0),
    ("full_free", np.int64, 0),
    ("full_total", np.int64, 0),
    ("swa_total", np.int64, 0),
    ("load", np.int64, 0),
    ("queued", np.int64, 0),  # `WorkerState.queued_prefill_tokens`
    ("decode", np.int64, 0),  # `WorkerState.decode_tokens`
    ("s_per_token", np.float64, 0.0),  # 0.0: not observed
    ("prefill_s", np.float64, 0.0),  # `WorkerState.prefill_sample`: decayed Σ seconds ...
    ("prefill_tokens", np.float64, 0.0),  # ... and Σ prompt tokens; 0.0: not measured
)


class WorkerTable:
    """Per-worker columns by bit (see the module docstring); `ids` the worker ids, `by_order`
    the present bits in add order."""

    present: np.ndarray
    reported: np.ndarray
    kv_events: np.ndarray
    order: np.ndarray
    reported_at: np.ndarray
    hybrid: np.ndarray
    window: np.ndarray
    repair: np.ndarray
    span_chunk: np.ndarray
    page: np.ndarray
    chunk: np.ndarray
    full_budget: np.ndarray
    swa_budget: np.ndarray
    full_free: np.ndarray
    full_total: np.ndarray
    swa_total: np.ndarray
    load: np.ndarray
    queued: np.ndarray
    decode: np.ndarray
    s_per_token: np.ndarray
    prefill_s: np.ndarray
    prefill_tokens: np.ndarray

    def __init__(self, capacity: int = 64) -> None:
        for name, dtype, default in _COLUMNS:
            setattr(self, name, np.full(capacity, default, dtype))
        self.ids = np.full(capacity, None, object)
        self.by_order = np.zeros(0, np.intp)
        self._stale: dict[int, WorkerState] = {}  # bit -> its state, since the last flush
        self._stale_reports: set[int] = set()  # ... of those, the bits with a new report

    @property
    def capacity(self) -> int:
        return len(self.present)

    def add(self, state: WorkerState) -> None:
        """A new worker, at its bit; its row is written."""
        bit = state.bit
        if bit >= self.capacity:
            self._grow(max(2 * self.capacity, bit + 1))
        self.present[bit] = True
        self.ids[bit] = state.worker_id
        self.write(state)
        self.by_order = np.append(self.by_order, bit)

    def remove(self, bit: int) -> None:
        """The worker at `bit` is gone: its row returns to the defaults."""
        for name, _, default in _COLUMNS:
            getattr(self, name)[bit] = default
        self.ids[bit] = None
        self.by_order = self.by_order[self.by_order != bit]
        self._stale.pop(bit, None)
        self._stale_reports.discard(bit)

    def changed(self, state: WorkerState, *, report: bool = True) -> None:
        """`state` changed (`report=False`: only its requests, not its report): its row is
        written at the next `flush`."""
        self._stale[state.bit] = state
        if report:
            self._stale_reports.add(state.bit)

    def flush(self) -> None:
        """Write the stale rows: call before reading the columns."""
        for bit, state in self._stale.items():
            self.write(state, report=bit in self._stale_reports)
        self._stale.clear()
        self._stale_reports.clear()

    def write(self, state: WorkerState, *, report: bool = True) -> None:
        """Row `state.bit` from `state` (see the module docstring); `report=False`: only
        what its requests change (it has had no report since the last write)."""
        row = _derived(state) | _reported(state) if report else _derived(state)
        for name, value in row.items():
            getattr(self, name)[state.bit] = value

    def fresh(self, now_s: float, timeout_s: float) -> np.ndarray:
        """By bit: reported within `timeout_s` of `now_s` (`WorkerState.is_fresh`)."""
        return self.reported & (now_s - self.reported_at <= timeout_s)

    def needs(
        self, num_prompt_tokens: int, hit_tokens: np.ndarray, max_new_tokens: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(full, SWA) need of a request on every worker, by bit (`worker_state.request_need`)."""
        return need_tokens(
            num_prompt_tokens - hit_tokens,
            max_new_tokens,
            self.hybrid,
            self.chunk,
            self.window,
            self.page,
        )

    def speeds(self, among: np.ndarray) -> np.ndarray:
        """By bit: the fastest estimated seconds per token of the workers of `among` over each
        one's own (1.0: as fast as the fastest, within `SAME_SPEED` of it, or not known yet).
        The prefill speed the workers' reports measure when any of `among` has one (TTFT is
        prefill), each blended with `SPEED_PRIOR_TOKENS` tokens at the pooled speed of those
        measured, so that a worker measured on few tokens stays near the fleet's speed; else
        the speed observed from routing to finish."""
        seconds, tokens = self.prefill_s, self.prefill_tokens
        known = among & (tokens > 0)
        if known.any():
            pooled = seconds[known].sum() / tokens[known].sum()
            s = (seconds + SPEED_PRIOR_TOKENS * pooled) / (tokens + SPEED_PRIOR_TOKENS)
            return _same_speed(np.where(known, s[known].min() / s, 1.0))
        known = among & (self.s_per_token != 0)
        if known.any():
            s = self.s_per_token
            return _same_speed(np.where(known, s[known].min() / np.where(known, s, 1.0), 1.0))
        return np.ones(self.capacity)

    def check(self, states: Iterable[WorkerState]) -> None:
        """Raise AssertionError where a row differs from its state's (after a `flush`), a row
        is present without a state, or `by_order` is not the present bits in add order."""
        self.flush()
        states = list(states)
        bits = sorted(states, key=lambda s: s.order)
        if [s.bit for s in bits] != self.by_order.tolist():
            raise AssertionError("the table's add order differs from the workers'")
        if set(np.flatnonzero(self.present).tolist()) != {s.bit for s in states}:
            raise AssertionError("the table's present rows differ from the workers")
        for state in states:
            if self.ids[state.bit] != state.worker_id:
                raise AssertionError(f"row {state.bit} names {self.ids[state.bit]!r}")
            for name, value in (_derived(state) | _reported(state)).items():
                if getattr(self, name)[state.bit] != value:
                    raise AssertionError(
                        f"worker {state.worker_id!r}: column {name} is "
                        f"{getattr(self, name)[state.bit]!r}, its state gives {value!r}"
                    )

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for name, dtype, default in _COLUMNS:
            column: np.ndarray = np.full(capacity, default, dtype)
            column[:old] = getattr(self, name)
            setattr(self, name, column)
        ids = np.full(capacity, None, object)
        ids[: len(self.ids)] = self.ids
        self.ids = ids


def need_tokens(
    uncached: Any, max_new_tokens: int, hybrid: Any, chunk: Any, window: Any, page: Any
) -> tuple[Any, Any]:
    """(full, SWA) KV tokens of a request with `uncached` prompt tokens to compute, for ints
    or arrays alike: `full = uncached + max_new`; `swa = min(uncached, chunk) + W + P` on a
    hybrid worker, 0 on a single-pool one."""
    swa = swa_tokens_for_extend(np.minimum(uncached, chunk), window, page)
    return uncached + max_new_tokens, np.where(hybrid, swa, 0)


def _same_speed(speed: np.ndarray) -> np.ndarray:
    """`speed` with those within `SAME_SPEED` of the fastest as 1.0."""
    return np.where(speed >= SAME_SPEED, 1.0, speed)


def _derived(state: WorkerState) -> dict[str, object]:
    """The columns that `state`'s own methods derive from its report and requests."""
    full, swa = state.budgets()
    return {
        "full_budget": full,
        "swa_budget": swa,
        "load": state.load,
        "queued": state.queued_prefill_tokens,
        "decode": state.decode_tokens,
        "s_per_token": state.s_per_token or 0.0,
        "prefill_s": state.prefill_sample[0],
        "prefill_tokens": state.prefill_sample[1],
    }


def _reported(state: WorkerState) -> dict[str, object]:
    """The columns of `state` that change with its registration and its reports only."""
    h = state.headroom
    row: dict[str, object] = {
        "present": True,
        "reported": h is not None,
        "kv_events": state.kv_events,
        "order": state.order,
        "reported_at": state.reported_at_s,
    }
    if h is not None:
        row.update(
            hybrid=h.hybrid,
            window=h.sliding_window_size,
            repair=max(0, h.window_repair_tokens),
            span_chunk=max(0, h.attention_chunk_size),
            page=h.page_size,
            chunk=h.chunked_prefill_size or NO_CHUNK,
            full_free=h.full_free_tokens,
            full_total=h.full_total_tokens,
            swa_total=h.swa_total_tokens,
        )
    return row
