"""Scheduler: which requests run in the next step, with how many tokens, and where their KV goes.

A step mixes the decodes of all running requests with prefill chunks, within a prefill token
budget. Admission checks two budgets, one per pool (architecture §6):

    rem_total_tokens = full free + full evictable − Σ running: min(remaining new, CLIP) × ratio
    rem_swa_tokens   = SWA free + SWA evictable  − Σ running: min(remaining new, I + P)

A new request needs `extend + min(max_new, CLIP) × ratio` full tokens (its whole remaining
prompt: full KV stays) but only `chunk + W + P` SWA tokens (a chunk plus the window before it),
less the part of that window its prefix hit just locked in the tree (the lock already took it
off the budget; it is no new slot). `ratio` (the expected share of max_new_tokens that gets
used) decays while decodes succeed and jumps back up after a retraction, as in SGLang.

Liveness (architecture §6): every step runs a batch or ends a request. When the decodes cannot get
slots even after evicting the prefix cache, the newest request is retracted: its KV is released
and it waits again, to be re-prefilled (reusing whatever the cache still holds). When nothing
decodes and no prefill chunk gets room, the oldest prefilling request takes a shorter chunk
(whole pages of the room there is; a cached chunk's lock may hold more than W), else the
newest is retracted. When nothing runs, the head request has the pools to itself: it is
admitted if its next chunk, or a shorter one, fits them at all, else it ends with finish
reason `error` and a message saying what it needs and what the pools hold.

The scheduler decides; it asks the `KVCacheManager` for room and never edits a request's slots,
the tree or KV contents.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from swaserve.proto.kv_rules import (
    decode_swa_tokens,
    page_ceil,
    page_floor,
    swa_tokens_for_extend,
)
from swaserve.proto.stream import FinishReason
from swaserve.worker.engine.decode_batch import DecodeBatch
from swaserve.worker.engine.kv_manager import KVCacheManager, PrefixHit, WindowRepair
from swaserve.worker.engine.ngram import Drafter
from swaserve.worker.engine.request import Request, RequestStatus
from swaserve.worker.engine.stats import EngineStats

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
    # reqs[:num_decodes] are the decode batch as it was scheduled: one token each, all sample.
    # (The batch itself changes once the results are in: finished requests leave it.)
    decode: DecodeBatch | None = None
    num_decodes: int = 0
    # One per request when a prefill of the step recomputes a window (architecture §6), else None.
    repairs: list[WindowRepair | None] | None = None
    # Speculative decoding: one list per decode request, the draft tokens its extend verifies
    # after its last token (extend_lens[i] = 1 + len(drafts[i]); [] for none); None: no drafts.
    drafts: list[list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the step computes (its extends past the decode batch)."""
        return sum(self.extend_lens[self.num_decodes :])

    @property
    def pure_decode(self) -> bool:
        """Only decodes, one token each: the decode batch's arrays are the step's whole input."""
        return (
            self.decode is not None and self.num_decodes == len(self.reqs) and self.drafts is None
        )


@dataclass(slots=True)
class _StepParts:
    """The step being planned: each request's new-token count and the slots it got, in batch
    order (the decodes first)."""

    reqs: list[Request] = field(default_factory=list)
    extends: list[int] = field(default_factory=list)
    locs: list[torch.Tensor] = field(default_factory=list)

    def add(self, req: Request, num_tokens: int, slots: torch.Tensor) -> None:
        self.reqs.append(req)
        self.extends.append(num_tokens)
        self.locs.append(slots)


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    page_size: int
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None  # None: no chunking
    max_model_len: int
    swa_eviction_interval: int
    sliding_window_size: int | None  # None: the model has no SWA layers
    attention_chunk_size: int | None = None  # C: an extend never crosses a multiple of C
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0  # scales the new-token ratio; < 1 admits more
    num_speculative_tokens: int = 0  # k drafts per decoding request and step (0: no drafter)
    speculative_max_batch: int | None = None  # no drafts when this many or more decode

    @property
    def decode_swa_cap(self) -> int:
        """The most SWA slots a decoding request holds, in whole pages (W and I need not be
        multiples of P): `DecodeBatch.reserved_tokens` promises it up to that."""
        p = self.page_size
        return page_ceil(
            decode_swa_tokens(self.sliding_window_size or 0, self.swa_eviction_interval, p), p
        )

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
        kv: KVCacheManager,
        stats: EngineStats,
        eos_token_ids: frozenset[int] = frozenset(),
        drafter: Drafter | None = None,
    ) -> None:
        self.limits = limits
        self.drafter = drafter if limits.num_speculative_tokens else None
        self.kv = kv
        self.tree = kv.tree
        self.stats = stats
        self.eos_token_ids = eos_token_ids
        self.hybrid = kv.hybrid
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.new_token_ratio = limits.init_new_token_ratio
        # `running` = the decode batch + the requests still prefilling, kept in step: a request
        # joins as prefilling, moves to the decode batch when it samples, leaves either.
        self._decode = DecodeBatch()
        self._prefilling: list[Request] = []
        self._failed: list[Request] = []  # unservable requests ended since `take_failed`

    # ---- queries -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def owned_slots(self) -> torch.Tensor:
        """Full slots held by requests themselves (not the tree): for `allocator.check`."""
        return self.kv.owned_slots(self.running)

    def queued_prefill_tokens(self) -> int:
        return sum(r.pending_tokens for r in self.waiting)

    def prefilling_tokens(self) -> int:
        """Prompt tokens the admitted requests whose prefill is under way still compute:
        the chunks after this step's, which a request sent now waits behind."""
        return sum(r.pending_tokens for r in self._prefilling)

    # ---- commands ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        params = req.params
        req.stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            req.stop_ids |= self.eos_token_ids
        req.max_output_len = min(
            params.max_new_tokens, self.limits.max_model_len - len(req.prompt_ids)
        )
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is; everything it held goes back."""
        if req in self.running:
            self.kv.release(req)
            self._leave(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.end(FinishReason.ABORT)

    def take_failed(self) -> list[Request]:
        """The requests ended as unservable (finish reason `error`) since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def schedule(self) -> ScheduledBatch | None:
        """Pick and allocate the next step's work; None when there is nothing to run (then
        nothing waits either, or every waiting request just failed as unservable)."""
        self._free_out_of_window_swa()
        parts = _StepParts()
        prefix_lens: list[int] = []

        decode = self._allocate_decodes()
        if decode is not None:
            db, out = decode
            parts.reqs += db.reqs
            parts.extends += [1] * len(db)
            parts.locs.append(out)
            prefix_lens += db.seq_lens.tolist()

        num_decodes = len(parts.reqs)
        budget = self.limits.chunked_prefill_size or self.limits.max_prefill_tokens
        budget = self._extend_prefills(budget, num_decodes, parts)
        self._admit(budget, num_decodes, parts)
        drafts = None  # last: drafts take the room prefill chunks and admissions left
        if (
            decode is not None
            and self._drafting(db)
            and (drafted := self._allocate_drafts(db, out))
        ):
            drafts, parts.locs[0] = drafted
            parts.extends[:num_decodes] = [1 + len(d) for d in drafts]
        reqs, extends, locs = parts.reqs, parts.extends, parts.locs

        if not reqs:
            return None
        lim = self.limits
        self.new_token_ratio = max(
            lim.min_new_token_ratio, self.new_token_ratio - lim.new_token_ratio_decay
        )
        samples = [True] * num_decodes
        repairs: list[WindowRepair | None] | None = None
        for i, (r, n) in enumerate(zip(reqs[num_decodes:], extends[num_decodes:], strict=True)):
            prefix_lens.append(r.num_computed)
            samples.append(r.num_computed + n == len(r.prompt_ids) + len(r.output_ids))
            if (repair := self.kv.repair_of(r)) is not None:
                repairs = repairs or [None] * len(reqs)
                repairs[num_decodes + i] = repair
        out_full_loc = locs[0] if len(locs) == 1 else torch.cat(locs)
        return ScheduledBatch(
            reqs,
            prefix_lens,
            extends,
            samples,
            out_full_loc,
            None if decode is None else db,
            num_decodes,
            repairs,
            drafts,
        )

    def _leave(self, req: Request) -> None:
        self.running.remove(req)
        if req in self._prefilling:
            self._prefilling.remove(req)
        else:
            self._decode.remove([self._decode.index(req)])

    def process_results(
        self,
        batch: ScheduledBatch,
        next_tokens: list[int | None],
        stopped: Sequence[int] = (),
        emitted: list[list[int]] | None = None,
    ) -> list[Request]:
        """Advance each request of a finished step; returns the requests that finished.
        `stopped`: batch indices of requests that their sampling ended (a stop string, a
        completed grammar: `RequestSampling.stopped`; a broken grammar: `.failed`).
        `emitted` (a step with drafts): the tokens each decode request keeps, 1 to 1 + its
        drafts, already cut after a stop token and at its length.

        A prompt enters the prefix cache as soon as its prefill ends (locked while the request
        runs), so requests that arrive while it decodes reuse it."""
        finished: list[Request] = []
        nd = batch.num_decodes
        if batch.decode is not None and emitted is not None:
            self._commit_verified(batch, emitted, stopped, finished)
        elif batch.decode is not None:
            db = batch.decode
            tokens: list[int] = next_tokens[:nd]  # type: ignore[assignment]  # decodes sample
            done = db.advance(np.asarray(tokens, dtype=np.int64))
            if stopped:
                ended_early = [i for i in stopped if i < nd]
                if ended_early:
                    done = np.union1d(done, ended_early)
            for req, output, n, token in zip(
                db.reqs, db.outputs, db.seq_lens.tolist(), tokens, strict=True
            ):
                req.num_computed = req.num_slots = n  # the step's slot is now computed KV
                output.append(token)
            if len(done):
                ended = done.tolist()
                for i in ended:
                    self._finish(db.reqs[i], tokens[i], finished)
                db.remove(ended)
        joined: list[Request] = []
        for req, n, token in zip(
            batch.reqs[nd:], batch.extend_lens[nd:], next_tokens[nd:], strict=True
        ):
            prefilling = n > 1 or not req.output_ids
            if not req.output_ids:  # the steps up to its first token, and what shared them
                trace = req.trace
                trace.prefill_steps += 1
                trace.step_decodes += nd
                trace.step_prefill_tokens += batch.prefill_tokens
            req.num_computed += n
            if token is None:
                if n > 0 and req.num_computed < req.seq_len:
                    self.stats.prefill_chunks += 1
                    self.kv.cache_unfinished(req)
                continue
            if prefilling:
                self.kv.cache_unfinished(req)
            req.output_ids.append(token)
            if n > 1:  # a prefill just ended: drop what its chunk left out of the window
                self.kv.free_out_of_window([req], 0)
            self._prefilling.remove(req)
            sampling = req.sampling
            if (
                token in req.stop_ids
                or len(req.output_ids) >= req.max_output_len
                or (sampling is not None and (sampling.stopped or sampling.failed is not None))
            ):
                self._finish(req, token, finished)
            else:
                joined.append(req)  # it decodes from now on
        self._decode.extend(joined)
        return finished

    def _commit_verified(
        self,
        batch: ScheduledBatch,
        emitted: list[list[int]],
        stopped: Sequence[int],
        finished: list[Request],
    ) -> None:
        """The decode part of a step with drafts: each request keeps its emitted tokens (their
        KV: its last token and the accepted drafts), the slots of rejected drafts go back in
        both pools, and the requests that ended leave the batch."""
        db = batch.decode
        assert db is not None
        nd = batch.num_decodes
        ended = set(i for i in stopped if i < nd)
        for i, (req, tokens, n) in enumerate(
            zip(db.reqs, emitted[:nd], batch.extend_lens[:nd], strict=True)
        ):
            start = req.num_computed
            kept = start + len(tokens)
            self.kv.trim_drafts(req, kept, start + n)
            req.num_computed = req.num_slots = kept
            req.output_ids.extend(tokens)
            if tokens[-1] in req.stop_ids or len(req.output_ids) >= req.max_output_len:
                ended.add(i)
        counts = np.fromiter((len(t) for t in emitted[:nd]), dtype=np.int64, count=nd)
        last = np.fromiter((t[-1] for t in emitted[:nd]), dtype=np.int64, count=nd)
        db.advance_by(counts, last)
        if ended:
            done = sorted(ended)
            for i in done:
                self._finish(db.reqs[i], emitted[i][-1], finished)
            db.remove(done)

    def _finish(self, req: Request, token: int, finished: list[Request]) -> None:
        """End a request that sampled its last token (the caller drops it from its part of
        the split)."""
        sampling = req.sampling
        if sampling is not None and sampling.failed is not None:
            req.end(FinishReason.ERROR, sampling.failed)
        else:
            stopped = token in req.stop_ids or (sampling is not None and sampling.stopped)
            req.end(FinishReason.STOP if stopped else FinishReason.LENGTH)
        self.kv.cache_finished(req)
        self.running.remove(req)
        finished.append(req)

    def fail(self, batch: ScheduledBatch, message: str) -> None:
        """End every request of a batch whose step raised: finish reason `error`, everything
        it holds released (nothing of the failed step is cached)."""
        for req, n in zip(batch.reqs[: batch.num_decodes], batch.extend_lens, strict=False):
            req.num_slots = req.num_computed + n  # the slots allocated for the step go too
        for req in batch.reqs:
            if req.finished:
                continue
            self.kv.release(req)
            if req in self.running:
                self._leave(req)
            req.end(FinishReason.ERROR, message)

    def flush_cache(self) -> None:
        """Drop the prefix cache (only when no request is running)."""
        if self.running:
            raise RuntimeError("flush_cache: requests are still running")
        if self.tree is not None:
            self.tree.reset()

    # ---- decode --------------------------------------------------------------------------
    def _allocate_decodes(self) -> tuple[DecodeBatch, torch.Tensor] | None:
        """One new slot per decoding request, retracting the newest until they fit."""
        while len(batch := self._decode):
            out = self.kv.allocate_decodes(batch)
            if out is not None:
                return batch, out
            self._retract(max(self.running, key=lambda r: r.arrival))
        return None

    def _drafting(self, db: DecodeBatch) -> bool:
        """Whether this step's decodes take drafts: a drafter, and fewer decodes than
        `speculative_disable_by_batch_size`."""
        limit = self.limits.speculative_max_batch
        return self.drafter is not None and (limit is None or len(db) < limit)

    def _allocate_drafts(
        self, db: DecodeBatch, out: torch.Tensor
    ) -> tuple[list[list[int]], torch.Tensor] | None:
        """Drafts for the decoding requests that may take them (`Request.draftable`), with
        slots after each one's decode slot; None when no request got any. Returns the drafts
        and the step's decode slots in token order (each request's decode slot, then its
        drafts'). A request whose drafts find no room decodes one token, as without them."""
        drafter = self.drafter
        assert drafter is not None
        drafts: list[list[int]] = [[] for _ in db.reqs]
        slots: dict[int, torch.Tensor] = {}  # batch index → its drafts' slots
        drafter.new_step()
        for i, (req, start) in enumerate(zip(db.reqs, db.seq_lens.tolist(), strict=True)):
            k = self.draft_room(req)
            proposed = drafter.propose(req, k) if k > 0 else []
            got = self.kv.allocate_drafts(req, start + 1, len(proposed)) if proposed else None
            if got is not None:
                drafts[i], slots[i] = proposed, got
        if not slots:
            return None
        locs = []
        for i in range(len(db)):
            locs.append(out[i : i + 1])
            if i in slots:
                locs.append(slots[i])
        return drafts, torch.cat(locs)

    def draft_room(self, req: Request, arriving: int = 0) -> int:
        """How many drafts `req` may verify in its next step once `arriving` more of its
        tokens are committed (the MTP drafter asks before this step's results are): its cap,
        fewer when fewer tokens are left to it (every kept token is an output). A draft is a
        decode row of its own (`Engine._verify_rows`), so drafts may cross a chunk boundary:
        each row reads from its own chunk's start."""
        return max(
            0, min(self._draft_cap(req), req.max_output_len - len(req.output_ids) - arriving - 1)
        )

    def _draft_cap(self, req: Request) -> int:
        """The drafts `req` takes per step: k, or fewer if it asked
        (`SamplingParams.num_speculative_tokens`); none for a request with a grammar
        (`Request.draftable`)."""
        if not req.draftable:
            return 0
        k = self.limits.num_speculative_tokens
        if (asked := req.params.num_speculative_tokens) is not None:
            k = min(k, asked)
        return k

    def _retract(self, req: Request) -> None:
        self.kv.release(req)
        self._leave(req)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self.waiting.append(req)
        self.stats.retractions += 1
        self.new_token_ratio = self.limits.init_new_token_ratio

    # ---- prefill -------------------------------------------------------------------------
    def _extend_prefills(self, budget: int, num_decodes: int, parts: _StepParts) -> int:
        """Allocate the next chunk of each prefilling request within `budget`; returns the
        budget left. When nothing decodes and no chunk gets room, the oldest prefilling
        request takes a shorter chunk (whole pages of the room left); if not one page fits,
        the newest request is retracted and the oldest tries again, as for decodes."""
        for req in self._prefilling:  # a request retracted for the decodes has left it
            n = self._prefill_len(req, budget, first=len(parts.reqs) == num_decodes)
            if n > 0 and (out := self.kv.allocate_extend(req, n)) is not None:
                parts.add(req, n, out)
                budget -= n
        while not parts.reqs and self._prefilling:
            req = min(self._prefilling, key=lambda r: r.arrival)
            n = self._chunk_in_room(req, self._prefill_len(req, budget, first=True), self._room())
            if n > 0 and (out := self.kv.allocate_extend(req, n)) is not None:
                parts.add(req, n, out)
                return budget - n
            self._retract(max(self.running, key=lambda r: r.arrival))
        return budget

    def _prefill_len(self, req: Request, budget: int, first: bool) -> int:
        """Tokens of `req` to compute this step within `budget` (0 = wait)."""
        pending = req.pending_tokens
        if c := self.limits.attention_chunk_size:  # the kernels read one chunk per extend
            pending = min(pending, (req.num_computed // c + 1) * c - req.num_computed)
        if self.limits.chunked_prefill_size is None:
            return pending if pending <= budget or first else 0
        if budget <= 0:
            return 0
        n = min(pending, budget)
        if n < pending:  # a chunk that is not the last one ends on a page boundary
            end = (req.num_computed + n) // self.limits.page_size * self.limits.page_size
            n = end - req.num_computed
        return max(n, 0)

    def _admit(self, budget: int, num_decodes: int, parts: _StepParts) -> None:
        """Move waiting requests to running while both pools and the step budget allow.
        With nothing running, the head request is admitted if its next chunk fits the pools at
        all, or ends as unservable (`take_failed`); then the next one is tried."""
        if not self.waiting:
            return
        rem_total, rem_swa = self._remaining_budgets()
        for req in self._waiting_in_order():
            if len(self.running) >= self.limits.max_running_requests or budget <= 0:
                req.trace.held_by = "running" if budget > 0 else "budget"
                break
            alone = not self.running  # the pools are this request's alone: move it or end it
            hit = self.kv.attach_prefix(req)
            if hit is None:
                req.trace.held_by = "rows"
                break
            # The lock just moved the matched prefix from evictable to protected.
            rem_total -= hit.full_newly_protected
            rem_swa -= hit.swa_newly_protected
            n = self._prefill_len(req, budget, first=len(parts.reqs) == num_decodes)
            full_need, swa_need = self._admission_need(req, n, hit)
            out = None
            if n > 0 and full_need <= rem_total and swa_need <= rem_swa:
                out = self.kv.allocate_extend(req, n)
            if out is None and alone:  # forecasts aside: the room there is
                wanted, n = n, self._chunk_in_room(req, n, self._room())
                out = self.kv.allocate_extend(req, n) if n > 0 else None
                if out is None:
                    self._fail_unservable(req, wanted, hit)
                    rem_total, rem_swa = self._remaining_budgets()
                    continue
            if out is None:
                req.trace.held_by = (
                    "budget"
                    if n == 0
                    else "full"
                    if full_need > rem_total
                    else "swa"
                    if swa_need > rem_swa
                    else "pools"
                )
                self.kv.release(req)
                break
            self.waiting.remove(req)
            self.running.append(req)
            self._prefilling.append(req)
            req.status = RequestStatus.RUNNING
            if req.num_retractions == 0:
                req.trace.admitted_s = time.monotonic()
                req.cached_tokens = hit.num_tokens
                self.stats.prompt_tokens += len(req.prompt_ids)
                self.stats.cached_tokens += hit.num_tokens
            parts.add(req, n, out)
            budget -= n
            rem_total -= full_need
            rem_swa -= swa_need

    def _admission_need(self, req: Request, n: int, hit: PrefixHit) -> tuple[int, int]:
        """(full, SWA) tokens admitting `req` with a first extend of `n` takes off the budgets.

        Full: its whole remaining prompt plus its expected share of max_new (full KV stays).
        SWA: `swa_tokens_for_extend` (the chunk, the window before it, a page), where the
        window counts once: the part of it `hit`'s lock just moved off the budget (the tree's
        locked window before the chunk) is not charged again."""
        full = req.pending_tokens + self._full_reserve(req)
        if not self.hybrid:
            return full, 0
        w = self.limits.sliding_window_size or 0
        swa = swa_tokens_for_extend(n, w, self.limits.page_size) - min(w, hit.swa_newly_protected)
        return full, swa

    def _room(self) -> int:
        """Tokens an extend can get now: free or evictable in both pools (what running
        requests and their locks hold is neither)."""
        full, swa = self.kv.available_tokens()
        return min(full, swa) if self.hybrid else full

    def _chunk_in_room(self, req: Request, n: int, room: int) -> int:
        """`n` if the new pages of extending `req` by `n` tokens fit `room`, else the longest
        shorter chunk whose pages do (it ends on a page boundary); 0 when not one page fits."""
        p = self.limits.page_size
        start = req.num_computed
        if page_ceil(start + n, p) - page_ceil(start, p) <= room:
            return n
        return max(page_ceil(start, p) + page_floor(room, p) - start, 0)

    def _fail_unservable(self, req: Request, num_tokens: int, hit: PrefixHit) -> None:
        """End a waiting request that cannot move with the pools to itself (extending it by
        `num_tokens` after its prefix `hit`, or by a page, finds no room): finish reason
        `error` with a message, its lock and row released, queued for `take_failed`."""
        full, swa = self.kv.available_tokens()
        p = self.limits.page_size
        swa_part = f" and {swa} SWA" if self.hybrid else ""
        locked = f"{hit.full_newly_protected} full" + (
            f" and {hit.swa_newly_protected} SWA" if self.hybrid else ""
        )
        message = (
            f"request {req.request_id!r} cannot run even alone: its next {num_tokens} tokens "
            f"(after {hit.num_tokens} cached) need {page_ceil(num_tokens, p)} new slots in each "
            f"pool, a shorter chunk at least {p}; the pools have {full} full{swa_part} tokens "
            f"free or evictable, besides the {locked} its cached prefix locks"
        )
        self.kv.release(req)
        self.waiting.remove(req)
        req.end(FinishReason.ERROR, message)
        self._failed.append(req)

    def _waiting_in_order(self) -> list[Request]:
        if (
            self.limits.schedule_policy == "lpm"
            and self.tree is not None
            and len(self.waiting) <= LPM_MAX_WAITING
        ):
            tree, repair = self.tree, self.kv.window_repair
            hit = {  # the prompt tokens each would skip, a repair's cost taken off
                id(r): tree.match_prefix(r.token_ids[:-1], allow_repair=repair).saved_tokens
                for r in self.waiting
            }
            return sorted(self.waiting, key=lambda r: (-hit[id(r)], r.arrival))
        return sorted(self.waiting, key=lambda r: r.arrival)

    def _remaining_budgets(self) -> tuple[int, int]:
        full, swa = self.kv.available_tokens()
        full_reserved, swa_reserved = self.reserved_tokens()
        return full - full_reserved, swa - swa_reserved

    def reserved_tokens(self) -> tuple[int, int]:
        """(full, SWA) tokens promised to running requests' future decode steps: a decoding
        request's SWA up to the most it holds (`DecodeBatch.reserved_tokens`), a prefilling
        one's the interval it grows by after its prefill freed all but its window."""
        limits = self.limits
        step = limits.swa_eviction_interval + limits.page_size
        full, swa = self._decode.reserved_tokens(
            self.new_token_ratio, CLIP_MAX_NEW_TOKENS, limits.decode_swa_cap
        )
        full += sum(self._full_reserve(r) for r in self._prefilling)
        swa += sum(min(r.remaining_new_tokens, step) for r in self._prefilling)
        if self._drafting(self._decode):  # the draft slots of each step (held for one step):
            p = self.limits.page_size  # k drafts after a decode slot take <= ceil_P(k) new slots
            drafts = sum(page_ceil(self._draft_cap(r), p) for r in self._decode.reqs)
            full, swa = full + drafts, swa + drafts
        return full, swa if self.hybrid else 0

    def _full_reserve(self, req: Request) -> int:
        return int(min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)

    # ---- memory --------------------------------------------------------------------------
    def _free_out_of_window_swa(self) -> None:
        """Before a step: decodes give back out-of-window SWA once the interval piled up,
        prefill chunks give back everything out of the window."""
        if not self.hybrid:
            return
        decoding, prefilling = self._decode, self._prefilling
        idx = decoding.due_for_swa_check()  # [k] int64
        due = [decoding.reqs[i] for i in idx.tolist()]
        due += [r for r in prefilling if r.num_computed >= r.swa.next_check_len]
        if due:
            self.kv.free_out_of_window(due, self.limits.swa_eviction_interval)
            decoding.refresh_next_check(idx)

    # ---- integrity -----------------------------------------------------------------------
    def check(self) -> None:
        """Raise if the kept (decoding, prefilling) split disagrees with the running requests.

        A prefilling request may look decoding only after a retraction: re-admitted with a
        cached prefix of all but its last token, it prefills that token, then joins."""
        decoding, prefilling = self._decode, self._prefilling
        split = [{id(r) for r in part} for part in (decoding.reqs, prefilling)]
        if (
            len(decoding) + len(prefilling) != len(self.running)
            or split[0] | split[1] != {id(r) for r in self.running}
            or not all(r.is_decoding for r in decoding.reqs)
            or any(r.is_decoding and not r.num_retractions for r in prefilling)
        ):
            raise RuntimeError("scheduler: the kept decode / prefill split is stale")
        if any(r.num_slots != r.num_computed for r in decoding.reqs):  # between steps
            raise RuntimeError("scheduler: a decoding request holds slots past its KV (drafts?)")
        decoding.check()
