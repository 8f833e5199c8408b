"""DecodeBatch: the running requests that decode, as host arrays kept from step to step.

A decode step should cost a handful of array ops over the batch, not a pass over every request
object (each pass after a forward misses the cache once per request). The scheduler builds a
`DecodeBatch` when the set of decoding requests changes and keeps it while that set holds; the
`Request` objects stay the source of truth and the arrays mirror them:

    # rows[i]         req.row                           (fixed while it runs)
    # seq_lens[i]     req.num_computed                  (+1 per step)
    # last_tokens[i]  req.output_ids[-1]                (this step's input token)
    # next_check[i]   req.swa.next_check_len            (refreshed when SWA freeing visits it)
    # limits[i]       len(prompt) + max_output_len - 1  (LENGTH once seq_lens reaches it)

`check()` raises when a mirror disagrees with its request.
"""

from __future__ import annotations

import numpy as np
import torch

from swaserve.worker.request import Request


class DecodeBatch:
    """The decoding requests (in running order) and their mirrored state."""

    __slots__ = (
        "_length_countdown",
        "_stop_groups",
        "_swa_countdown",
        "all_greedy",
        "appends",
        "cached_tokens",
        "done",
        "last_tokens",
        "limits",
        "next_check",
        "reqs",
        "request_ids",
        "rows",
        "seq_lens",
    )

    def __init__(self, reqs: list[Request]) -> None:
        self.reqs = reqs
        self.request_ids = [r.request_id for r in reqs]
        self.cached_tokens = [r.cached_tokens for r in reqs]
        self.appends = [r.output_ids.append for r in reqs]  # each request's output list
        self.done = _NONE  # [k] int64 indices of the requests the last step finished
        self.rows = np.array([r.row for r in reqs], dtype=np.int64)  # [B] int64
        self.seq_lens = np.array([r.num_computed for r in reqs], dtype=np.int64)  # [B] int64
        self.last_tokens = np.array([r.output_ids[-1] for r in reqs], dtype=np.int64)  # [B] int64
        self.next_check = np.array(
            [r.swa.next_check_len for r in reqs], dtype=np.int64
        )  # [B] int64
        self.limits = np.array(
            [len(r.prompt_ids) + r.max_output_len - 1 for r in reqs], dtype=np.int64
        )  # [B] int64
        self.all_greedy = all(r.greedy for r in reqs)
        groups: dict[frozenset[int], list[int]] = {}
        for i, r in enumerate(reqs):
            if r.stop_ids:
                groups.setdefault(r.stop_ids, []).append(i)
        self._stop_groups = [
            (None if len(idx) == len(reqs) else np.array(idx, dtype=np.int64), _mask(stops))
            for stops, idx in groups.items()
        ]  # (indices of the group or None for all, its stop mask over token ids)
        # Steps until the first request may be due (<= 0: check now); exact minima, so the
        # arrays are compared only on the steps where something happens.
        self._swa_countdown = _min_gap(self.next_check, self.seq_lens)
        self._length_countdown = _min_gap(self.limits, self.seq_lens)

    def __len__(self) -> int:
        return len(self.reqs)

    def due_for_swa_check(self) -> np.ndarray:  # [k] int64
        """Indices of the requests that may have out-of-window SWA to free."""
        if self._swa_countdown > 0:
            return _NONE
        return np.flatnonzero(self.seq_lens >= self.next_check)

    def refresh_next_check(self, idx: np.ndarray) -> None:
        """Re-read `next_check_len` of requests `idx` (after SWA freeing visited them)."""
        reqs = self.reqs
        self.next_check[idx] = [reqs[i].swa.next_check_len for i in idx.tolist()]
        self._swa_countdown = _min_gap(self.next_check, self.seq_lens)

    def advance(self, tokens: np.ndarray) -> np.ndarray:  # [B] int64 → [k] int64
        """After a step that decoded every request: mirror the new token and length, and
        return the indices of the requests that now finish (a stop id, or out of length)."""
        self.seq_lens += 1
        self.last_tokens[:] = tokens
        self._swa_countdown -= 1
        self._length_countdown -= 1
        if not self._stop_groups and self._length_countdown > 0:
            self.done = _NONE
            return _NONE
        done = self.seq_lens >= self.limits  # [B] bool
        for idx, mask in self._stop_groups:
            if idx is None:
                done |= mask[np.minimum(tokens, len(mask) - 1)]
            else:
                done[idx] |= mask[np.minimum(tokens[idx], len(mask) - 1)]
        self.done = np.flatnonzero(done)
        return self.done

    def check(self) -> None:
        """Raise if a mirrored array disagrees with its request."""
        reqs = self.reqs
        mirrors = {
            "rows": [r.row for r in reqs],
            "seq_lens": [r.num_computed for r in reqs],
            "last_tokens": [r.output_ids[-1] if r.output_ids else -1 for r in reqs],
            "next_check": [r.swa.next_check_len for r in reqs],
        }
        if self.request_ids != [r.request_id for r in reqs] or self.cached_tokens != [
            r.cached_tokens for r in reqs
        ]:
            raise RuntimeError("decode batch: request ids or cached tokens disagree")
        for name, truth in mirrors.items():
            if getattr(self, name).tolist() != truth:
                raise RuntimeError(f"decode batch: {name} disagrees with the requests")
        if not all(r.is_decoding for r in reqs):
            raise RuntimeError("decode batch: holds a request that does not decode")


_NONE = np.empty(0, dtype=np.int64)  # [0] int64: no index (never written)
_NO_GAP = 1 << 62


def _mask(stops: frozenset[int]) -> np.ndarray:  # [max(stops) + 2] bool
    """True at each stop id; the last entry (False) stands for every larger token id."""
    mask = np.zeros(max(stops) + 2, dtype=np.bool_)
    mask[list(stops)] = True
    return mask


def _min_gap(ends: np.ndarray, lens: np.ndarray) -> int:
    return int((ends - lens).min()) if len(lens) else _NO_GAP


def as_tensor(values: np.ndarray) -> torch.Tensor:  # [n] int64 CPU, a copy
    """A CPU tensor of a mirror's current values (the mirror changes after the step)."""
    return torch.from_numpy(values.copy())
