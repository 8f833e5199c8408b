"""KVCacheManager: the typed boundary between the scheduler (policy) and rank 0's KV bookkeeping
(memory): the allocator and its `full_to_swa` mapping, the radix prefix cache, and the host
request → slot table.

The scheduler asks for room and gets a typed answer (`PrefixHit`, a slot tensor, or None); it
never edits a request's slots or the tree itself. Every slot a request holds lives in its row of
the host `RequestSlotTable`:

    # [0, swa.cache_protected_len)          owned by the prefix cache (locked by req.lock)
    # [cache_protected_len, num_computed)   owned by the request

A window repair (architecture §6) is admitted as a match of m tokens that resumes at m - R:

    # [0, m - R)            the tree's slots, reused
    # [m - R, m)            the tree's full slots in the device table (full layers read them);
    #                       the request's own new slots in its row, for the recomputed SWA KV
    # [m, ...)              the rest of the prompt, as usual

Once the prefill passes m, the prefix is inserted with the SWA KV of the window before m
(exact now) adopted by the tree and everything else of the repair given back.

Ranges whose slots change outside a step's new tokens (a matched prefix at admission, slots the
tree deduplicated on insert) are queued as `SlotWrites` for the device tables; `take_writes()`
hands them to the next `ModelInput`, translated to SWA ids there and then.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from swaserve.proto.kv_rules import cdiv, page_floor, read_start
from swaserve.worker.engine.decode_batch import DecodeBatch
from swaserve.worker.engine.request import Request
from swaserve.worker.engine.stats import EngineStats
from swaserve.worker.kv.allocator import SWATokenAllocator, TokenAllocator
from swaserve.worker.kv.radix_cache import SWARadixCache
from swaserve.worker.kv.radix_node import PrefixLock
from swaserve.worker.kv.slot_table import RequestSlotTable
from swaserve.worker.kv.swa_freeing import SWAFreeState, take_out_of_window_range
from swaserve.worker.runner.model_input import SlotWrites


def is_hybrid(
    allocator: SWATokenAllocator | TokenAllocator, sliding_window_size: int | None
) -> bool:
    """The one definition of "hybrid": two pools (an SWA allocator) for a model with SWA layers."""
    return isinstance(allocator, SWATokenAllocator) and sliding_window_size is not None


@dataclass(frozen=True, slots=True)
class WindowRepair:
    """A repaired hit recomputes positions `[start, end)` for their SWA KV only (architecture
    §6): the full KV there is the tree's; the request resumes at `start`."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Admission's match: `num_tokens` not computed (a repaired hit's match less its repair);
    the tokens the lock moved from evictable to protected in each pool (admission takes them
    off its budgets in the same pass); the window repair it needs, if any."""

    num_tokens: int
    full_newly_protected: int
    swa_newly_protected: int
    repair: WindowRepair | None = None
    lock: PrefixLock | None = None  # what the match locked in the tree (None: no prefix cache)


class KVCacheManager:
    """Rank 0's KV bookkeeping for running requests (host only; nothing here touches a device)."""

    def __init__(
        self,
        allocator: SWATokenAllocator | TokenAllocator,
        tree: SWARadixCache | None,
        slot_table: RequestSlotTable,
        *,
        page_size: int,
        sliding_window_size: int | None,
        window_repair_tokens: int = 0,
        attention_chunk_size: int | None = None,
        stats: EngineStats,
    ) -> None:
        self.allocator = allocator
        self.tree = tree
        self.slot_table = slot_table
        self.page_size = page_size
        self.sliding_window_size = sliding_window_size
        self.attention_chunk_size = attention_chunk_size  # C: chunked local layers (Llama 4)
        self.stats = stats
        self.hybrid = is_hybrid(allocator, sliding_window_size)
        # Admission may take a repaired match when the engine repairs windows (R > 0: decided
        # once, by the engine's builder, which gave the tree the same R).
        self.window_repair = window_repair_tokens > 0
        self._writes: list[tuple[int, int, torch.Tensor]] = []  # (row, start, full slots)
        self._taken: list[tuple[int, int, torch.Tensor]] = []  # the last take_writes()
        self._no_writes = SlotWrites.empty(self.hybrid)  # immutable, shared by idle steps
        self._repairs: dict[int, WindowRepair] = {}  # slot-table row -> its repair in progress

    # ---- queries -------------------------------------------------------------------------
    def available_tokens(self) -> tuple[int, int]:
        """(full, SWA) tokens free or evictable from the prefix cache."""
        alloc, tree = self.allocator, self.tree
        full = alloc.full_available_size() + (tree.full_evictable_size() if tree else 0)
        swa = alloc.swa_available_size() + (tree.swa_evictable_size() if tree else 0)
        return full, swa

    def owned_slots(self, reqs: list[Request]) -> torch.Tensor:
        """Full slots held by the requests themselves (not the tree): for `allocator.check`."""
        parts = [r.slots[r.swa.cache_protected_len :] for r in reqs]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    # ---- admission -----------------------------------------------------------------------
    def attach_prefix(self, req: Request) -> PrefixHit | None:
        """Give a waiting request a slot-table row and its cached prefix, locked (all but the
        last prompt token: one token is always computed), repaired where that saves more
        (the module docstring). A command: the hit names the lock it took (`PrefixHit.lock`,
        also `req.lock` until the request releases it). None when no row is free."""
        row = self.slot_table.acquire()
        if row is None:
            return None
        req.attach_row(row, self.slot_table.slots[row])
        tree = self.tree
        if tree is None:
            req.swa = SWAFreeState()
            return PrefixHit(0, 0, 0)
        match = tree.match_prefix(req.token_ids[:-1], allow_repair=self.window_repair)
        full_before, swa_before = tree.full_evictable_size(), tree.swa_evictable_size()
        req.lock = PrefixLock(match.last_node, tree.inc_lock_ref(match.last_node))
        self._set_slots(req, 0, match.indices, record=True)
        n = match.saved_tokens
        repair = None
        if match.repair_len:
            repair = self._repairs[row] = WindowRepair(n, match.indices.numel())
            req.num_slots = n  # [n, m) of the row are the tree's until the repair allocates
        req.num_computed = n
        req.swa = SWAFreeState(cache_protected_len=n)
        return PrefixHit(
            n,
            full_before - tree.full_evictable_size(),
            swa_before - tree.swa_evictable_size(),
            repair,
            req.lock,
        )

    def repair_of(self, req: Request) -> WindowRepair | None:
        """The window repair `req`'s next extend (from `num_computed`) takes part in, if any."""
        repair = self._repairs.get(req.row)
        return repair if repair is not None and repair.end > req.num_computed else None

    # ---- allocation ----------------------------------------------------------------------
    def allocate_extend(self, req: Request, num_tokens: int) -> torch.Tensor | None:
        """Slots for positions `[num_computed, num_computed + num_tokens)` of `req` (evicting
        from the prefix cache if needed); None (nothing changed) when the pools are short."""
        p = self.page_size
        start = req.num_computed
        pages = cdiv(start + num_tokens, p) - cdiv(start, p)
        if not self._make_room(pages * p):
            return None
        out = self.allocator.alloc_extend(
            torch.tensor([start]), torch.tensor([start + num_tokens]), torch.tensor([req.last_loc])
        )
        if out is not None:
            self._set_slots(req, start, out, record=False)
        return out

    def allocate_decodes(self, batch: DecodeBatch) -> torch.Tensor | None:
        """One slot per decoding request, at position `num_computed` ([B] int64), written to
        its slot-table row; None (nothing changed) when the pools are short. The requests'
        `num_slots` count the new slot once the step's results are in (`Scheduler`), or when
        a failed step releases them."""
        p = self.page_size
        seq = batch.seq_lens  # [B] int64
        new_pages = len(seq) if p == 1 else int(np.count_nonzero(seq % p == 0))
        if not self._make_room(new_pages * p):
            return None
        rows, table = batch.rows, self.slot_table.slots_host
        if p == 1:  # each new token is a page of its own: nothing continues a last slot
            out = self.allocator.alloc_host(len(seq))
        else:
            last = torch.from_numpy(table[rows, seq - 1])  # [B] int64
            slots = self.allocator.alloc_decode(torch.from_numpy(seq + 1), last)
            out = None if slots is None else slots.numpy()
        if out is None:
            return None
        table[rows, seq] = out
        return torch.from_numpy(out)

    def allocate_drafts(self, req: Request, start: int, num_tokens: int) -> torch.Tensor | None:
        """Slots for a decoding request's draft positions `[start, start + num_tokens)`
        (`start` = its decode slot's position + 1, that slot already in its row), written to
        its row but not counted in `num_slots`: the step's results keep the accepted ones
        (`trim_drafts`), a failed step's release counts them. None (nothing changed) when the
        pools are short even after evicting from the prefix cache (admission reserved the
        drafts' room as it reserves decode tokens: what they evict once, later steps' drafts
        reuse, since each step gives its drafts back)."""
        p = self.page_size
        pages = cdiv(start + num_tokens, p) - cdiv(start, p)
        if not self._make_room(pages * p):
            return None
        table = self.slot_table.slots_host
        last = torch.tensor([int(table[req.row, start - 1])])
        out = self.allocator.alloc_extend(
            torch.tensor([start]), torch.tensor([start + num_tokens]), last
        )
        if out is not None:
            table[req.row, start : start + num_tokens] = out.numpy()
        return out

    def trim_drafts(self, req: Request, kept: int, end: int) -> None:
        """After a verify step that computed positions up to `end` of `req`: keep the slots of
        `[0, kept)` (its committed tokens) and give back, in both pools, the pages that lie
        wholly past them (a rejected draft inside the last kept page stays as that page's
        free tail, overwritten when the request gets there)."""
        first = cdiv(kept, self.page_size) * self.page_size
        if first < end:
            self.allocator.free(req.row_slots[first:end])

    def _make_room(self, num_tokens: int) -> bool:
        """Evict from the prefix cache until both pools (the SWA one only when hybrid) have
        `num_tokens` free; False if they cannot."""
        alloc = self.allocator
        swa_tokens = num_tokens if self.hybrid else 0
        full_short = num_tokens - alloc.full_available_size()
        swa_short = swa_tokens - alloc.swa_available_size()
        if (full_short > 0 or swa_short > 0) and self.tree is not None:
            self.tree.evict(max(0, full_short), max(0, swa_short))
        return (
            alloc.full_available_size() >= num_tokens and alloc.swa_available_size() >= swa_tokens
        )

    # ---- out-of-window SWA ---------------------------------------------------------------
    def free_out_of_window(self, reqs: list[Request], decode_interval: int) -> None:
        """Free the out-of-window SWA slots of `reqs` — a decoding request's once at least
        `decode_interval` are due, a prefilling one's all — in one allocator call, and release
        the tree's SWA lock of each whose window has moved past its cached prefix."""
        w, c = self.sliding_window_size, self.attention_chunk_size
        if not self.hybrid or w is None:
            return
        assert isinstance(self.allocator, SWATokenAllocator)
        radix = self.tree is not None
        table = self.slot_table.slots_host  # rows read as numpy views: no torch op per request
        parts: list[np.ndarray] = []
        swa_unlocks: list[PrefixLock] = []
        for req in reqs:
            if req.num_computed == 0:
                continue
            state, lock = req.swa, req.lock
            interval = decode_interval if req.is_decoding else 0
            due = take_out_of_window_range(
                state,
                table[req.row],
                req.num_computed,
                sliding_window_size=w,
                page_size=self.page_size,
                radix_cache=radix,
                min_free_tokens=interval,
                attention_chunk_size=c,
            )
            if due is not None:
                parts.append(due)
            holds_swa_lock = self.tree is not None and lock is not None and not lock.swa_released
            left = (
                read_start(req.num_computed, w, c) >= state.cache_protected_len
                if c
                else req.num_computed - w >= state.cache_protected_len
            )
            if holds_swa_lock and left:
                assert lock is not None
                swa_unlocks.append(lock)
                holds_swa_lock = False
            state.next_check_len = self._next_due(state, interval, holds_swa_lock)
        if swa_unlocks:
            assert self.tree is not None
            self.tree.release_requests_swa(swa_unlocks)
        if parts:
            freed = np.concatenate(parts)  # [n] int64, a copy of the rows' slots
            self.allocator.free_swa(torch.from_numpy(freed))
            self.stats.swa_freed_tokens += len(freed)

    def _next_due(self, state: SWAFreeState, interval: int, holds_swa_lock: bool) -> int:
        """The computed length before which nothing of a request is due: the free boundary
        never passes num_computed - W (under chunks: its chunk start), and the SWA lock goes
        once the window (chunk) leaves the cached prefix; the smaller of the two."""
        w, c = self.sliding_window_size or 0, self.attention_chunk_size
        start = max(state.swa_evicted_seqlen, state.cache_protected_len)
        if c:
            next_due = cdiv(start + max(interval, 1), c) * c
            if holds_swa_lock:
                next_due = min(next_due, cdiv(state.cache_protected_len, c) * c)
            return next_due
        next_due = start + max(interval, 1) + w
        if holds_swa_lock:
            next_due = min(next_due, state.cache_protected_len + w)
        return next_due

    # ---- caching and release -------------------------------------------------------------
    def cache_unfinished(self, req: Request) -> None:
        """Insert the computed tokens of a running request into the tree (after a prefill
        chunk, and when its prefill ends) and move its lock to the new end; slots the tree
        deduplicated are re-addressed in the request's row."""
        done = req.num_computed
        before = req.swa.cache_protected_len
        if self.tree is None or req.lock is None or page_floor(done, self.page_size) <= before:
            return  # nothing new fills a page
        repair = self._repairs.get(req.row)
        if repair is not None:
            if done < repair.end:
                return  # the repaired SWA KV is exact only from repair.end - W, once it is done
            # Only the window before repair.end is kept: the tree frees the rest of the repair
            # as positions without SWA KV.
            w = self.sliding_window_size or 0
            window_start = page_floor(max(0, repair.end - w), self.page_size)
            req.swa.swa_evicted_seqlen = max(req.swa.swa_evicted_seqlen, window_start)
            self.stats.window_repairs += 1
            self.stats.window_repair_tokens += repair.end - repair.start
            del self._repairs[req.row]
        slots, req.lock = self.tree.cache_unfinished_request(
            req.token_ids[:done], req.slots[:done], req.lock, req.swa
        )
        req.swa.next_check_len = 0  # a new cached prefix and a new SWA lock
        old, new = req.slots[before:done], slots[before:done]
        changed = torch.nonzero(old != new).flatten()  # [k] int64: positions the tree re-addressed
        req.row_slots[before:done] = new
        if changed.numel():
            a, b = before + int(changed[0]), before + int(changed[-1]) + 1
            self._writes.append((req.row, a, new[a - before : b - before].clone()))

    def cache_finished(self, req: Request) -> None:
        """Hand a finished request's KV to the tree (or free it without one); frees its row."""
        done = req.num_computed
        if self.tree is not None and req.lock is not None:
            self.tree.cache_finished_request(
                req.token_ids[:done], req.slots[:done], req.lock, req.swa
            )
        else:
            self.allocator.free(req.slots[:done])
        self._detach(req)

    def release(self, req: Request) -> None:
        """Give back a request's own slots (also those allocated for a step that did not
        complete), its cache lock and its row, without caching anything."""
        own = req.slots[req.swa.cache_protected_len :]
        if own.numel():
            self.allocator.free(own)
        if self.tree is not None and req.lock is not None:
            self.tree.dec_lock_ref(req.lock.node, req.lock.handle, skip_swa=req.lock.swa_released)
        self._detach(req)

    def _detach(self, req: Request) -> None:
        if req.row >= 0:
            row = req.row
            self._writes = [w for w in self._writes if w[0] != row]
            self._repairs.pop(row, None)
            self.slot_table.release(row)
        req.reset_kv()

    # ---- device-table writes -------------------------------------------------------------
    def _set_slots(self, req: Request, start: int, slots: torch.Tensor, *, record: bool) -> None:
        end = start + slots.numel()
        req.row_slots[start:end] = slots
        req.num_slots = end
        if record and slots.numel():
            self._writes.append((req.row, start, slots.to(torch.int64).clone()))

    def take_writes(self) -> SlotWrites:
        """The queued slot-table writes (translated to SWA ids now), emptying the queue."""
        if not self._writes:
            self._taken = []
            return self._no_writes
        writes, self._writes = self._writes, []
        self._taken = writes
        rows = torch.cat(
            [torch.full((s.numel(),), row, dtype=torch.int64) for row, _, s in writes]
        )  # [N] int64
        positions = torch.cat(
            [torch.arange(start, start + s.numel()) for _, start, s in writes]
        )  # [N] int64
        full = torch.cat([s for _, _, s in writes])  # [N] int64
        return SlotWrites(rows, positions, full, self.translate(full) if self.hybrid else None)

    def requeue_writes(self, keep_rows: set[int]) -> None:
        """Put back the last taken writes of `keep_rows` (a step failed, so they may not have
        reached the device; writing them twice is harmless)."""
        kept = [w for w in self._taken if w[0] in keep_rows]
        self._writes = kept + self._writes
        self._taken = []

    def translate(self, full_idx: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.allocator, SWATokenAllocator)
        return self.allocator.translate(full_idx)

    def check(self, running: list[Request]) -> None:
        """Raise if a slot-table row is lost, doubly used, or held by a request not running."""
        self.slot_table.check([r.row for r in running if r.row >= 0])
