"""DecodeBatch: the running requests that decode, as host arrays kept from step to step.

A decode step should cost a handful of array ops over the batch, not a pass over every request
object (each pass after a forward misses the cache once per request). The scheduler keeps one
`DecodeBatch` for the life of the engine and edits it as requests join (their prefill ended)
and leave (finished, aborted, retracted), as SGLang's running batch is filtered and merged. The
`Request` objects stay the source of truth; the arrays mirror them:

    # rows[i]         req.row                               (fixed while it runs)
    # seq_lens[i]     req.num_computed                      (+1 per step; +kept after a verify)
    # last_tokens[i]  req.output_ids[-1]                    (this step's input token)
    # next_check[i]   req.swa.next_check_len                (re-read when SWA freeing visits it)
    # limits[i]       len(prompt) + max_output_len - 1      (LENGTH once seq_lens reaches it)
    # new_ends[i]     len(prompt) + max_new_tokens - 1      (remaining new tokens = this - seq)
    # stop_groups[i]  its stop-id set's group, -1 for none  (STOP when a step samples one)

`check()` raises when a mirror disagrees with its request.
"""

from __future__ import annotations

import numpy as np

from swaserve.worker.engine.request import Request

_NONE = np.empty(0, dtype=np.int64)  # [0] int64: no index (never written)
_NO_GAP = 1 << 62
_ARRAYS = (
    "rows",
    "seq_lens",
    "last_tokens",
    "next_check",
    "own_starts",
    "limits",
    "new_ends",
    "stop_groups",
)


def _mirror(i: int) -> property:
    """Row `i` of the batch's [8, B] state: a view to read or edit in place, or to assign."""

    def get(self: DecodeBatch) -> np.ndarray:  # [B] int64 view
        return self._state[i]

    def put(self: DecodeBatch, values: np.ndarray) -> None:
        self._state[i] = values

    return property(get, put)


class DecodeBatch:
    """The decoding requests and their mirrored state, in the order they joined."""

    __slots__ = (
        "_group_of",
        "_group_sizes",
        "_groups",
        "_length_countdown",
        "_num_sampled",
        "_state",
        "_swa_countdown",
        "cached_tokens",
        "outputs",
        "reqs",
        "request_ids",
    )
    # One [8, B] array holds every mirror, so a join or a leave is one concatenate or delete.
    rows, seq_lens, last_tokens, next_check, own_starts, limits, new_ends, stop_groups = (
        _mirror(i) for i in range(len(_ARRAYS))
    )

    def __init__(self, reqs: list[Request] | None = None) -> None:
        self.reqs: list[Request] = []
        self.request_ids: list[str] = []
        self.cached_tokens: list[int] = []
        self.outputs: list[list[int]] = []  # each request's output_ids
        self._state = np.empty((len(_ARRAYS), 0), dtype=np.int64)  # [8, B] int64
        self._groups: list[np.ndarray] = []  # sorted stop ids of each group
        self._group_of: dict[frozenset[int], int] = {}
        self._group_sizes: list[int] = []
        self._num_sampled = 0  # requests that do not sample greedily
        self._swa_countdown = self._length_countdown = _NO_GAP
        if reqs:
            self.extend(reqs)

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def all_greedy(self) -> bool:
        return self._num_sampled == 0

    # ---- membership ----------------------------------------------------------------------
    def extend(self, reqs: list[Request]) -> None:
        """Add requests that decode from now on (their last token sampled, not finished)."""
        if not reqs:
            return
        self.reqs += reqs
        self.request_ids += [r.request_id for r in reqs]
        self.cached_tokens += [r.cached_tokens for r in reqs]
        self.outputs += [r.output_ids for r in reqs]
        self._num_sampled += sum(not r.params.greedy for r in reqs)
        new = np.array(
            [
                [r.row for r in reqs],
                [r.num_computed for r in reqs],
                [r.output_ids[-1] for r in reqs],
                [r.swa.next_check_len for r in reqs],
                [r.swa.own_start for r in reqs],
                [len(r.prompt_ids) + r.max_output_len - 1 for r in reqs],
                [len(r.prompt_ids) + r.params.max_new_tokens - 1 for r in reqs],
                [self._join_group(r.stop_ids) for r in reqs],
            ],
            dtype=np.int64,
        )  # [8, k] int64, in _ARRAYS order
        self._state = np.concatenate((self._state, new), axis=1)
        self._recount()

    def remove(self, idx: list[int]) -> None:
        """Drop the requests at indices `idx` (distinct)."""
        if not idx:
            return
        for i in sorted(idx, reverse=True):
            req = self.reqs.pop(i)
            del self.request_ids[i], self.cached_tokens[i], self.outputs[i]
            self._num_sampled -= not req.params.greedy
        for g in self.stop_groups[idx].tolist():
            if g >= 0:
                self._group_sizes[g] -= 1
        self._state = np.delete(self._state, idx, axis=1)
        if len(self._groups) > 8 and self._group_sizes.count(0) > len(self._groups) // 2:
            self._compact_groups()
        self._recount()

    def index(self, req: Request) -> int:
        return self.reqs.index(req)

    # ---- a step --------------------------------------------------------------------------
    def due_for_swa_check(self) -> np.ndarray:  # [k] int64
        """Indices of the requests that may have out-of-window SWA to free."""
        if self._swa_countdown > 0:
            return _NONE
        return np.flatnonzero(self.seq_lens >= self.next_check)

    def refresh_next_check(self, idx: np.ndarray) -> None:
        """Re-read the SWA state (`next_check_len`, `own_start`) of requests `idx` after SWA
        freeing visited them: a decoding request's changes nowhere else."""
        states = [self.reqs[i].swa for i in idx.tolist()]
        self.next_check[idx] = [s.next_check_len for s in states]
        self.own_starts[idx] = [s.own_start for s in states]
        self._swa_countdown = _min_gap(self.next_check, self.seq_lens)

    def advance(self, tokens: np.ndarray) -> np.ndarray:  # [B] int64 → [k] int64
        """After a step that decoded every request: mirror the new token and length, and
        return the indices of the requests that now finish (a stop id, or out of length)."""
        self.seq_lens += 1
        self.last_tokens = tokens
        self._swa_countdown -= 1
        self._length_countdown -= 1
        live = [g for g, size in enumerate(self._group_sizes) if size]
        if not live and self._length_countdown > 0:
            return _NONE
        done = self.seq_lens >= self.limits  # [B] bool
        for g in live:
            stops = self._groups[g]  # [S] int64 sorted
            if self._group_sizes[g] == len(self.reqs):
                done |= _is_in(tokens, stops)
            else:
                sel = self.stop_groups == g  # [B] bool
                done[sel] |= _is_in(tokens[sel], stops)
        return np.flatnonzero(done)

    def advance_by(self, counts: np.ndarray, tokens: np.ndarray) -> None:
        """After a verify step (speculative decoding): request i kept `counts[i]` tokens, the
        last `tokens[i]` (the caller decides which finish)."""
        self.seq_lens += counts
        self.last_tokens = tokens
        self._recount()

    def reserved_tokens(self, new_token_ratio: float, clip: int, swa_cap: int) -> tuple[int, int]:
        """(full, SWA) tokens these requests' future decode steps are promised: per request
        int(min(remaining, clip) × ratio), and what it may still add to the SWA slots it holds
        before it holds `swa_cap` (W + I + P: out-of-window SWA is given back every I
        positions, so no decoding request holds more), at most its remaining tokens. A
        request that holds its window and most of an interval is promised little more: what
        it holds is already off the pool."""
        remaining = self.new_ends - self.seq_lens  # [B] int64, >= 1 while decoding
        full = np.floor(np.minimum(remaining, clip) * new_token_ratio)  # [B] float64
        growth = np.maximum(swa_cap - (self.seq_lens - self.own_starts), 0)  # [B] int64
        return int(full.sum()), int(np.minimum(remaining, growth).sum())

    # ---- integrity -----------------------------------------------------------------------
    def check(self) -> None:
        """Raise if a mirrored array disagrees with its request."""
        reqs = self.reqs
        mirrors = {
            "rows": [r.row for r in reqs],
            "seq_lens": [r.num_computed for r in reqs],
            "last_tokens": [r.output_ids[-1] if r.output_ids else -1 for r in reqs],
            "next_check": [r.swa.next_check_len for r in reqs],
            "own_starts": [r.swa.own_start for r in reqs],
            "limits": [len(r.prompt_ids) + r.max_output_len - 1 for r in reqs],
            "new_ends": [len(r.prompt_ids) + r.params.max_new_tokens - 1 for r in reqs],
        }
        for name, truth in mirrors.items():
            if getattr(self, name).tolist() != truth:
                raise RuntimeError(f"decode batch: {name} disagrees with the requests")
        groups = [
            frozenset(self._groups[g].tolist()) if g >= 0 else frozenset()
            for g in self.stop_groups.tolist()
        ]
        if groups != [r.stop_ids for r in reqs]:
            raise RuntimeError("decode batch: stop_groups disagrees with the requests")
        if (
            self.request_ids != [r.request_id for r in reqs]
            or self.cached_tokens != [r.cached_tokens for r in reqs]
            or self._num_sampled != sum(not r.params.greedy for r in reqs)
            or any(out is not r.output_ids for out, r in zip(self.outputs, reqs, strict=True))
        ):
            raise RuntimeError("decode batch: ids, cached tokens, outputs or greedy count disagree")
        if not all(r.is_decoding for r in reqs):
            raise RuntimeError("decode batch: holds a request that does not decode")

    # ---- internals -----------------------------------------------------------------------
    def _join_group(self, stops: frozenset[int]) -> int:
        if not stops:
            return -1
        g = self._group_of.get(stops)
        if g is None:
            g = self._group_of[stops] = len(self._groups)
            self._groups.append(np.array(sorted(stops), dtype=np.int64))
            self._group_sizes.append(0)
        self._group_sizes[g] += 1
        return g

    def _compact_groups(self) -> None:
        """Forget the stop-id groups no request uses any more."""
        keep = [g for g, size in enumerate(self._group_sizes) if size]
        renumber = np.full(len(self._groups) + 1, -1, dtype=np.int64)  # [G+1]; [-1] stays -1
        renumber[keep] = np.arange(len(keep))
        self._groups = [self._groups[g] for g in keep]
        self._group_sizes = [self._group_sizes[g] for g in keep]
        self._group_of = {frozenset(s.tolist()): i for i, s in enumerate(self._groups)}
        self.stop_groups = renumber[self.stop_groups]

    def _recount(self) -> None:
        self._swa_countdown = _min_gap(self.next_check, self.seq_lens)
        self._length_countdown = _min_gap(self.limits, self.seq_lens)


def _is_in(tokens: np.ndarray, stops: np.ndarray) -> np.ndarray:  # [n], [S] sorted → [n] bool
    pos = np.minimum(np.searchsorted(stops, tokens), len(stops) - 1)
    return stops[pos] == tokens


def _min_gap(ends: np.ndarray, lens: np.ndarray) -> int:
    """Steps until the first request reaches its end (<= 0: now); exact, so the arrays are
    compared only on the steps where something happens."""
    return int((ends - lens).min()) if len(lens) else _NO_GAP
