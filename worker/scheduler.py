"""Scheduler: which requests run in the next step, with how many tokens, and where their KV goes.

A step mixes the decodes of all running requests with prefill chunks, within a prefill token
budget. Admission checks two budgets, one per pool (DESIGN §6):

    rem_total_tokens = full free + full evictable − Σ running: min(remaining new, CLIP) × ratio
    rem_swa_tokens   = SWA free + SWA evictable  − Σ running: min(remaining new, I + P)

A new request needs `extend + min(max_new, CLIP) × ratio` full tokens (its whole remaining
prompt: full KV stays) but only `chunk + W + P` SWA tokens (a chunk plus the window before it).
`ratio` (the expected share of max_new_tokens that gets used) decays while decodes succeed and
jumps back up after a retraction, as in SGLang. When decode cannot get slots even after
evicting the prefix cache, the newest request is retracted: its KV is released and it waits
again, to be re-prefilled (reusing whatever the cache still holds).

The scheduler decides and allocates; it never reads or writes KV contents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.worker.kv.allocator import SWATokenAllocator, TokenAllocator
from swaserve.worker.kv.radix_cache import SWARadixCache
from swaserve.worker.kv.radix_node import PrefixLock
from swaserve.worker.kv.swa_freeing import SWAFreeState, free_swa_out_of_window_slots
from swaserve.worker.request import FinishReason, Request, RequestStatus
from swaserve.worker.stats import EngineStats

CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
LPM_MAX_WAITING = 128
"""Longest-prefix-match ordering costs one tree walk per waiting request; past this many
waiting requests the scheduler falls back to FCFS (as SGLang does)."""


@dataclass(slots=True)
class ScheduledBatch:
    """One step: request i computes positions `[prefix_lens[i], prefix_lens[i] + extend_lens[i])`
    and samples a token when `samples[i]` (it reached the end of its sequence)."""

    reqs: list[Request]
    prefix_lens: list[int]
    extend_lens: list[int]
    samples: list[bool]
    out_full_loc: torch.Tensor  # [sum(extend_lens)] int64

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    page_size: int
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None  # None: no chunking
    max_model_len: int
    swa_eviction_interval: int
    sliding_window_size: int | None  # None: the model has no SWA layers
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0  # scales the new-token ratio; < 1 admits more

    @property
    def init_new_token_ratio(self) -> float:
        return min(1.0, INIT_NEW_TOKEN_RATIO * self.schedule_conservativeness)

    @property
    def min_new_token_ratio(self) -> float:
        return self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR

    @property
    def new_token_ratio_decay(self) -> float:
        return (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS


class Scheduler:
    """Owns the waiting and running queues and every request's slots and cache locks."""

    def __init__(
        self,
        limits: SchedulerLimits,
        allocator: SWATokenAllocator | TokenAllocator,
        tree: SWARadixCache | None,
        stats: EngineStats,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.limits = limits
        self.allocator = allocator
        self.tree = tree
        self.stats = stats
        self.eos_token_ids = eos_token_ids
        self.hybrid = (
            isinstance(allocator, SWATokenAllocator) and limits.sliding_window_size is not None
        )
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.new_token_ratio = limits.init_new_token_ratio

    # ---- queries -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def owned_slots(self) -> torch.Tensor:
        """Full slots held by requests themselves (not the tree): for `allocator.check`."""
        parts = [r.slots[r.swa.cache_protected_len : r.num_computed] for r in self.running]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def queued_prefill_tokens(self) -> int:
        return sum(r.pending_tokens for r in self.waiting)

    # ---- commands ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is; everything it held goes back."""
        if req in self.running:
            self._release(req)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.ABORTED
        req.finish_reason = FinishReason.ABORT

    def schedule(self) -> ScheduledBatch | None:
        """Pick and allocate the next step's work; None when there is nothing to run."""
        self._free_out_of_window_swa()
        reqs: list[Request] = []
        extends: list[int] = []
        locs: list[torch.Tensor] = []

        decodes = self._allocate_decodes()
        if decodes is not None:
            batch_reqs, out = decodes
            reqs += batch_reqs
            extends += [1] * len(batch_reqs)
            locs.append(out)

        num_decodes = len(reqs)
        budget = self.limits.chunked_prefill_size or self.limits.max_prefill_tokens
        for req in [r for r in self.running if not r.is_decoding]:
            n = self._prefill_len(req, budget, first=len(reqs) == num_decodes)
            if n == 0 or (out := self._allocate_extend(req, n)) is None:
                continue
            reqs.append(req)
            extends.append(n)
            locs.append(out)
            budget -= n
        self._admit(budget, num_decodes, reqs, extends, locs)

        if not reqs:
            return None
        lim = self.limits
        self.new_token_ratio = max(
            lim.min_new_token_ratio, self.new_token_ratio - lim.new_token_ratio_decay
        )
        prefix_lens = [r.num_computed for r in reqs]
        samples = [r.num_computed + n == r.seq_len for r, n in zip(reqs, extends, strict=True)]
        return ScheduledBatch(reqs, prefix_lens, extends, samples, torch.cat(locs))

    def process_results(
        self, batch: ScheduledBatch, next_tokens: list[int | None]
    ) -> list[Request]:
        """Advance each request of a finished step; returns the requests that finished."""
        finished = []
        for req, n, token in zip(batch.reqs, batch.extend_lens, next_tokens, strict=True):
            req.num_computed += n
            if token is None:
                if n > 0 and req.num_computed < req.seq_len:
                    self.stats.prefill_chunks += 1
                    self._cache_unfinished(req)
                continue
            req.output_ids.append(token)
            req.new_token_ids.append(token)
            if n > 1:  # a prefill just ended: drop what its chunk left out of the window
                self._free_swa_of(req, 0)
            reason = self._finish_reason(req, token)
            if reason is not None:
                req.finish_reason = reason
                req.status = RequestStatus.FINISHED
                self._cache_finished(req)
                self.running.remove(req)
                finished.append(req)
        return finished

    def flush_cache(self) -> None:
        """Drop the prefix cache (only when no request is running)."""
        if self.running:
            raise RuntimeError("flush_cache: requests are still running")
        if self.tree is not None:
            self.tree.reset()

    # ---- decode --------------------------------------------------------------------------
    def _allocate_decodes(self) -> tuple[list[Request], torch.Tensor] | None:
        """One new slot per decoding request, retracting the newest until they fit."""
        while True:
            decodes = [r for r in self.running if r.is_decoding][: self.limits.max_running_requests]
            if not decodes:
                return None
            p = self.limits.page_size
            new_pages = sum(1 for r in decodes if r.num_computed % p == 0)
            if self._make_room(new_pages * p, new_pages * p if self.hybrid else 0):
                seq = torch.tensor([r.num_computed + 1 for r in decodes])
                last = torch.tensor([r.last_loc for r in decodes])
                out = self.allocator.alloc_decode(seq, last)
                if out is not None:
                    for i, r in enumerate(decodes):
                        r.extend_slots(r.num_computed, out[i : i + 1])
                    return decodes, out
            self._retract(max(self.running, key=lambda r: r.arrival))

    def _retract(self, req: Request) -> None:
        self._release(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self.waiting.append(req)
        self.stats.retractions += 1
        self.new_token_ratio = self.limits.init_new_token_ratio

    # ---- prefill -------------------------------------------------------------------------
    def _prefill_len(self, req: Request, budget: int, first: bool) -> int:
        """Tokens of `req` to compute this step within `budget` (0 = wait)."""
        pending = req.pending_tokens
        if self.limits.chunked_prefill_size is None:
            return pending if pending <= budget or first else 0
        if budget <= 0:
            return 0
        n = min(pending, budget)
        if n < pending:  # a chunk that is not the last one ends on a page boundary
            end = (req.num_computed + n) // self.limits.page_size * self.limits.page_size
            n = end - req.num_computed
        return max(n, 0)

    def _allocate_extend(self, req: Request, n: int) -> torch.Tensor | None:
        p = self.limits.page_size
        pages = -(-(req.num_computed + n) // p) - -(-req.num_computed // p)
        if not self._make_room(pages * p, pages * p if self.hybrid else 0):
            return None
        out = self.allocator.alloc_extend(
            torch.tensor([req.num_computed]),
            torch.tensor([req.num_computed + n]),
            torch.tensor([req.last_loc]),
        )
        if out is not None:
            req.extend_slots(req.num_computed, out)
        return out

    def _admit(
        self,
        budget: int,
        num_decodes: int,
        reqs: list[Request],
        extends: list[int],
        locs: list[torch.Tensor],
    ) -> None:
        """Move waiting requests to running while both pools and the step budget allow."""
        rem_total, rem_swa = self._remaining_budgets()
        w = self.limits.sliding_window_size or 0
        p = self.limits.page_size
        for req in self._waiting_in_order():
            if len(self.running) >= self.limits.max_running_requests or budget <= 0:
                break
            prefix, lock = self._match_and_lock(req)
            req.slots, req.num_computed = prefix, prefix.numel()
            req.swa = SWAFreeState(cache_protected_len=prefix.numel())
            req.lock = lock
            n = self._prefill_len(req, budget, first=len(reqs) == num_decodes)
            full_need = req.pending_tokens + self._full_reserve(req)
            swa_need = n + w + p if self.hybrid else 0
            if (
                n == 0
                or full_need > rem_total
                or swa_need > rem_swa
                or (out := self._allocate_extend(req, n)) is None
            ):
                self._release(req)
                req.reset_kv()
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.num_retractions == 0:
                req.cached_tokens = prefix.numel()
                self.stats.prompt_tokens += len(req.prompt_ids)
                self.stats.cached_tokens += prefix.numel()
            reqs.append(req)
            extends.append(n)
            locs.append(out)
            budget -= n
            rem_total -= full_need
            rem_swa -= swa_need

    def _waiting_in_order(self) -> list[Request]:
        if (
            self.limits.schedule_policy == "lpm"
            and self.tree is not None
            and len(self.waiting) <= LPM_MAX_WAITING
        ):
            tree = self.tree
            hit = {id(r): tree.match_prefix(r.token_ids[:-1]).indices.numel() for r in self.waiting}
            return sorted(self.waiting, key=lambda r: (-hit[id(r)], r.arrival))
        return sorted(self.waiting, key=lambda r: r.arrival)

    def _match_and_lock(self, req: Request) -> tuple[torch.Tensor, PrefixLock | None]:
        if self.tree is None:
            return torch.empty(0, dtype=torch.int64), None
        match = self.tree.match_prefix(req.token_ids[:-1])  # keep one token to compute
        return match.indices, PrefixLock(match.last_node, self.tree.inc_lock_ref(match.last_node))

    def _remaining_budgets(self) -> tuple[int, int]:
        alloc = self.allocator
        full = alloc.full_available_size() + (self.tree.full_evictable_size() if self.tree else 0)
        swa = alloc.swa_available_size() + (self.tree.swa_evictable_size() if self.tree else 0)
        full_reserved, swa_reserved = self.reserved_tokens()
        return full - full_reserved, swa - swa_reserved

    def reserved_tokens(self) -> tuple[int, int]:
        """(full, SWA) tokens promised to running requests' future decode steps."""
        step = self.limits.swa_eviction_interval + self.limits.page_size
        full = sum(self._full_reserve(r) for r in self.running)
        swa = sum(min(r.remaining_new_tokens, step) for r in self.running) if self.hybrid else 0
        return full, swa

    def _full_reserve(self, req: Request) -> int:
        return int(min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)

    # ---- memory --------------------------------------------------------------------------
    def _make_room(self, full_tokens: int, swa_tokens: int) -> bool:
        """Evict from the prefix cache until both pools have the tokens free; False if they can't."""
        alloc = self.allocator
        full_short = full_tokens - alloc.full_available_size()
        swa_short = swa_tokens - alloc.swa_available_size()
        if (full_short > 0 or swa_short > 0) and self.tree is not None:
            self.tree.evict(max(0, full_short), max(0, swa_short))
        return (
            alloc.full_available_size() >= full_tokens and alloc.swa_available_size() >= swa_tokens
        )

    def _free_out_of_window_swa(self) -> None:
        """Before a step: decodes give back out-of-window SWA once the interval piled up,
        prefill chunks give back everything out of the window."""
        for req in self.running:
            self._free_swa_of(req, self.limits.swa_eviction_interval if req.is_decoding else 0)

    def _free_swa_of(self, req: Request, interval: int) -> None:
        """Free `req`'s out-of-window SWA slots (when at least `interval` are due) and release
        the tree's SWA lock once the window has moved past the cached prefix."""
        w = self.limits.sliding_window_size
        if not self.hybrid or w is None or req.num_computed == 0:
            return
        assert isinstance(self.allocator, SWATokenAllocator)
        self.stats.swa_freed_tokens += free_swa_out_of_window_slots(
            self.allocator,
            req.swa,
            req.slots,
            req.num_computed,
            sliding_window_size=w,
            radix_cache=self.tree is not None,
            min_free_tokens=interval,
        )
        lock = req.lock
        window_left_cache = req.num_computed - w >= req.swa.cache_protected_len
        if (
            self.tree is not None
            and lock is not None
            and not lock.swa_released
            and window_left_cache
        ):
            self.tree.release_request_swa(lock)

    def _cache_unfinished(self, req: Request) -> None:
        if self.tree is None or req.lock is None:
            return
        done = req.num_computed
        slots, req.lock = self.tree.cache_unfinished_request(
            req.token_ids[:done], req.slots[:done], req.lock, req.swa
        )
        req.slots = slots

    def _cache_finished(self, req: Request) -> None:
        done = req.num_computed
        if self.tree is not None and req.lock is not None:
            self.tree.cache_finished_request(
                req.token_ids[:done], req.slots[:done], req.lock, req.swa
            )
        else:
            self.allocator.free(req.slots[:done])
        req.reset_kv()

    def _release(self, req: Request) -> None:
        """Give back a request's own slots and its cache lock without caching anything."""
        own = req.slots[req.swa.cache_protected_len : req.num_computed]
        if own.numel():
            self.allocator.free(own)
        if self.tree is not None and req.lock is not None:
            self.tree.dec_lock_ref(req.lock.node, req.lock.handle, skip_swa=req.lock.swa_released)
        req.reset_kv()

    def _finish_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return FinishReason.STOP
        if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.limits.max_model_len:
            return FinishReason.LENGTH
        return None
