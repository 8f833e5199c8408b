"""Token-slot allocators: one paged pool (`TokenAllocator`) and the two-pool `SWATokenAllocator`.

A pool of `size` token slots is cut into `size // page_size` pages. Page 0 (slots
`[0, page_size)`) is the padding page and is never handed out, so real slots are
`[page_size, size + page_size)` and every buffer indexed by a slot id has `size + page_size` rows.

The SWA allocator keeps two such pools. The full index is the only primary address; the SWA slot
of a token is found through `full_to_swa[full_idx]` (0 = none). The mapping has one more entry,
the trailing sentinel `-1`, so that `translate(-1) == -1` (the "no last location" marker of
`alloc_extend`).
"""

from __future__ import annotations

import numpy as np
import torch

from swaserve.proto.kv_rules import cdiv, page_ceil
from swaserve.worker.kv.errors import AllocatorCorrupted, InvalidFree

NO_LAST_LOC = -1
"""`last_loc` value of a request that holds no token yet."""


def _check_sizes(size: int, page_size: int, what: str) -> None:
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"{what} must be a non-negative int, got {size!r}")
    if size % page_size:
        raise ValueError(f"{what}={size} is not a multiple of page_size={page_size}")


class TokenAllocator:
    """One paged pool of token slots.

    Host state whatever `device` (the device of the slot tensors it hands out): free pages live
    in an int64 numpy queue (FIFO, so freed slots are reused last) and a boolean mask that
    catches double frees at the call; a small numpy op costs a microsecond where a torch op
    costs several. Freed pages wait in a list and join the queue only when an allocation needs
    them, so `free` costs O(pages freed), not O(pool).
    """

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu") -> None:
        _check_sizes(size, page_size, "size")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        """Return every slot to the pool."""
        self._free_pages = np.arange(1, self.num_pages + 1, dtype=np.int64)  # [num_pages] int64
        self._page_is_free = np.ones(self.num_pages + 1, dtype=np.bool_)  # [num_pages+1] bool
        self._page_is_free[0] = False
        self._released: list[np.ndarray] = []  # freed pages not yet in the queue, in order
        self._num_released = 0

    def _merge_released(self) -> None:
        if self._released:
            self._free_pages = np.concatenate((self._free_pages, *self._released))
            self._released, self._num_released = [], 0

    # ---- queries -------------------------------------------------------------------------
    def available_size(self) -> int:
        """Free token slots (whole free pages × page_size)."""
        return self.free_page_count() * self.page_size

    def free_page_count(self) -> int:
        return len(self._free_pages) + self._num_released

    def is_free(self, indices: torch.Tensor) -> torch.Tensor:
        """Bool mask: is the page of each slot free? Indices must be in range."""
        return torch.from_numpy(self._page_is_free[self._pages_of(host_ids(indices))])

    # ---- commands ------------------------------------------------------------------------
    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Take `num_tokens` slots (a multiple of page_size) in whole new pages.

        Returns a LongTensor of slot ids, or None (nothing changed) when the pool is short.
        """
        pages = self.alloc_host(num_tokens)
        return None if pages is None else self._out(pages)

    def alloc_host(self, num_tokens: int) -> np.ndarray | None:
        """`alloc` as a host array ([num_tokens] int64, the caller's to keep)."""
        if num_tokens < 0 or num_tokens % self.page_size:
            raise ValueError(
                f"alloc({num_tokens}): need a non-negative multiple of page_size={self.page_size}"
            )
        pages = self._take_pages(num_tokens // self.page_size)
        return None if pages is None else self._slots_of_pages(pages)

    def _take_pages(self, num_pages: int) -> np.ndarray | None:
        """[num_pages] int64 page ids taken from the queue (a view of it), or None."""
        if num_pages > self.free_page_count():
            return None
        if num_pages > len(self._free_pages):
            self._merge_released()
        pages = self._free_pages[:num_pages]  # [num_pages] int64
        self._free_pages = self._free_pages[num_pages:]
        self._page_is_free[pages] = False
        return pages

    def _slots_of_pages(self, pages: np.ndarray) -> np.ndarray:  # [n] → [n * P] int64, a copy
        if self.page_size == 1:  # a page is its slot
            return pages.copy()
        offsets = np.arange(self.page_size, dtype=np.int64)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def _out(self, values: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(values)
        return out if self.device.type == "cpu" else out.to(self.device)

    def free(self, indices: torch.Tensor) -> None:
        """Give back the pages that hold `indices` (any slot of a page frees the whole page).

        Raises `InvalidFree` for slot ids out of range, the padding page, or a page that is
        already free; in that case nothing is freed.
        """
        self.free_host(host_ids(indices))

    def free_host(self, indices: np.ndarray, *, distinct: bool = False) -> None:
        """`free` of a host array of slot ids. `distinct`: the caller knows no page is in it
        twice, so with P = 1 the sort that finds repeats is skipped."""
        if indices.size == 0:
            return
        pages = self._pages_of(indices)
        pages = pages.copy() if distinct and self.page_size == 1 else np.unique(pages)
        already = self._page_is_free[pages]
        if already.any():
            bad = pages[already][:8].tolist()
            raise InvalidFree(
                f"double free: page(s) {bad} (page_size={self.page_size}) are already free"
            )
        self._page_is_free[pages] = True
        self._released.append(pages)
        self._num_released += len(pages)

    def _pages_of(self, indices: np.ndarray) -> np.ndarray:
        if indices.size:
            lo, hi = int(indices.min()), int(indices.max())
            if lo < self.page_size or hi >= self.size + self.page_size:
                raise InvalidFree(
                    f"slot ids must lie in [{self.page_size}, {self.size + self.page_size}) "
                    f"(slot 0..{self.page_size - 1} is padding); got min {lo}, max {hi}"
                )
        return indices if self.page_size == 1 else indices // self.page_size

    # ---- paged allocation for requests ---------------------------------------------------
    def alloc_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """Slots for tokens `[prefix_len, seq_len)` of each request, concatenated.

        Each request first fills the rest of its partly filled last page (continuing after
        `last_loc`, its last slot, or `-1` when it has none), then takes new pages. Returns None
        (nothing changed) when the pool is short.
        """
        prefix, seq, last = _extend_args(prefix_lens, seq_lens, last_loc, self.page_size)
        plan = _extend_plan(prefix, seq, self.page_size)
        pages = self._take_pages(sum(p.new_pages for p in plan))
        if pages is None:
            return None
        return self._out(_fill_extend(plan, last, pages, self.page_size))

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for its new token; `seq_lens` already count that token.

        A request whose new token starts a page (`(seq_len - 1) % P == 0`) takes a new page; the
        others continue at `last_loc + 1`. Returns None (nothing changed) when the pool is short.
        """
        seq, last = _decode_args(seq_lens, last_loc, self.page_size)
        if self.page_size == 1:  # every new token is a new page: no last_loc arithmetic
            return self.alloc(len(seq))
        needs_page = (seq - 1) % self.page_size == 0
        pages = self._take_pages(int(needs_page.sum()))
        if pages is None:
            return None
        return self._out(_fill_decode(needs_page, last, pages, self.page_size))

    # ---- the two-pool contract, for one pool --------------------------------------------
    # With `disable_hybrid_swa_memory` every layer's KV of a token lives in its one slot, so the
    # prefix cache and scheduler can treat this allocator as an `SWATokenAllocator` whose SWA
    # address is the full address and whose SWA KV goes only with the full slot.
    @property
    def full(self) -> TokenAllocator:
        return self

    @property
    def full_size(self) -> int:
        return self.size

    def full_available_size(self) -> int:
        return self.available_size()

    def swa_available_size(self) -> int:
        return self.available_size()

    def translate(self, full_idx: torch.Tensor) -> torch.Tensor:
        """Identity: one pool, one address (-1 stays -1)."""
        return full_idx.to(torch.int64)

    def free_swa(self, full_idx: torch.Tensor) -> None:
        """Nothing to do: a single pool frees SWA-layer KV only with the slot (`free`)."""

    # ---- integrity -----------------------------------------------------------------------
    def check(self, owned: torch.Tensor | None = None) -> None:
        """Raise `AllocatorCorrupted` if the free list is broken.

        Free pages must be distinct, in range and agree with the mask. When `owned` (every slot
        held by requests and the prefix cache) is given, free + owned must cover each page
        exactly once.
        """
        self._merge_released()
        pages = self._free_pages
        if len(pages):
            if int(pages.min()) < 1 or int(pages.max()) > self.num_pages:
                raise AllocatorCorrupted(f"free list holds page ids outside [1, {self.num_pages}]")
            if len(np.unique(pages)) != len(pages):
                dup = _duplicates(pages)
                raise AllocatorCorrupted(
                    f"double free: page(s) {dup} appear twice in the free list"
                )
        mask = np.zeros_like(self._page_is_free)
        mask[pages] = True
        if not np.array_equal(mask, self._page_is_free):
            raise AllocatorCorrupted("free-page mask disagrees with the free list")
        if owned is None:
            return
        owned_pages = np.unique(self._pages_of(host_ids(owned)))
        if self._page_is_free[owned_pages].any():
            bad = owned_pages[self._page_is_free[owned_pages]][:8].tolist()
            raise AllocatorCorrupted(f"page(s) {bad} are both free and owned")
        if len(owned_pages) + len(pages) != self.num_pages:
            leaked = self.num_pages - len(owned_pages) - len(pages)
            raise AllocatorCorrupted(
                f"leak: {leaked} page(s) are neither free nor owned "
                f"({len(pages)} free + {len(owned_pages)} owned of {self.num_pages})"
            )


def host_ids(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    """[n] int64 numpy view (or copy) of slot / page ids given as a tensor on any device."""
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False).reshape(-1)
    if ids.dtype == torch.int64 and ids.device.type == "cpu" and ids.dim() == 1:
        return ids.numpy()  # the common case: no conversion
    return ids.detach().to("cpu", torch.int64).reshape(-1).numpy()


class SWATokenAllocator:
    """Two pools, one address: full slots are primary, SWA slots hang off `full_to_swa`.

    `alloc*` take a full slot and an SWA slot for every token (or nothing, when either pool is
    short). `free` gives back both; `free_swa` gives back only the SWA side (whole pages when
    P > 1) and zeroes the mapping, so calling it again is a no-op. The mapping is a host tensor
    (whatever `device`), read and written through its numpy view.
    """

    def __init__(
        self, full_size: int, swa_size: int, page_size: int = 1, device: str | torch.device = "cpu"
    ) -> None:
        _check_sizes(full_size, page_size, "full_size")
        _check_sizes(swa_size, page_size, "swa_size")
        self.page_size = page_size
        self.device = torch.device(device)
        self.full = TokenAllocator(full_size, page_size, device)
        self.swa = TokenAllocator(swa_size, page_size, device)
        self.full_to_swa = torch.zeros(full_size + page_size + 1, dtype=torch.int64)  # [F+P+1]
        self._map = self.full_to_swa.numpy()  # the same memory
        self._map[-1] = NO_LAST_LOC

    @property
    def full_size(self) -> int:
        return self.full.size

    @property
    def swa_size(self) -> int:
        return self.swa.size

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        self._map[:] = 0
        self._map[-1] = NO_LAST_LOC

    # ---- queries -------------------------------------------------------------------------
    def full_available_size(self) -> int:
        return self.full.available_size()

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def available_size(self) -> int:
        """Tokens that can be allocated now: the smaller of the two pools."""
        return min(self.full_available_size(), self.swa_available_size())

    def translate(self, full_idx: torch.Tensor) -> torch.Tensor:
        """Full → SWA slot ids (0 where the SWA KV is gone; -1 stays -1). Valid until the next
        `alloc*` / `free*` touching those slots."""
        return self.full._out(self._map[host_ids(full_idx)])

    # ---- commands ------------------------------------------------------------------------
    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """`num_tokens` (a multiple of P) full slots in new pages, each with an SWA slot."""
        full_idx = self.alloc_host(num_tokens)
        return None if full_idx is None else self.full._out(full_idx)

    def alloc_host(self, num_tokens: int) -> np.ndarray | None:
        """`alloc` as a host array ([num_tokens] int64, the caller's to keep)."""
        if num_tokens < 0 or num_tokens % self.page_size:
            raise ValueError(
                f"alloc({num_tokens}): need a non-negative multiple of page_size={self.page_size}"
            )
        if num_tokens > self.full.available_size() or num_tokens > self.swa.available_size():
            return None
        full_idx = self.full.alloc_host(num_tokens)
        swa_idx = self.swa.alloc_host(num_tokens)
        assert full_idx is not None and swa_idx is not None  # both were checked above
        self._map[full_idx] = swa_idx
        return full_idx

    def alloc_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """Paged extend on both pools (see `TokenAllocator.alloc_extend`).

        The SWA side continues its own partly filled page through `translate(last_loc)`; a request
        that continues a page must still hold SWA KV for its last token.
        """
        prefix, seq, last = _extend_args(prefix_lens, seq_lens, last_loc, self.page_size)
        plan = _extend_plan(prefix, seq, self.page_size)
        num_pages = sum(p.new_pages for p in plan)
        if num_pages > self.full.free_page_count() or num_pages > self.swa.free_page_count():
            return None
        swa_last = self._translate_last_loc(last, np.asarray(prefix, dtype=np.int64))
        full_pages = self.full._take_pages(num_pages)
        swa_pages = self.swa._take_pages(num_pages)
        assert full_pages is not None and swa_pages is not None
        full_idx = _fill_extend(plan, last, full_pages, self.page_size)
        swa_idx = _fill_extend(plan, swa_last, swa_pages, self.page_size)
        self._map[full_idx] = swa_idx
        return self.full._out(full_idx)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """Paged decode on both pools (see `TokenAllocator.alloc_decode`)."""
        seq, last = _decode_args(seq_lens, last_loc, self.page_size)
        if self.page_size == 1:  # every new token is a new page in both pools
            return self.alloc(len(seq))
        needs_page = (seq - 1) % self.page_size == 0
        num_pages = int(needs_page.sum())
        if num_pages > self.full.free_page_count() or num_pages > self.swa.free_page_count():
            return None
        swa_last = self._translate_last_loc(last, seq - 1)
        full_pages = self.full._take_pages(num_pages)
        swa_pages = self.swa._take_pages(num_pages)
        assert full_pages is not None and swa_pages is not None
        full_idx = _fill_decode(needs_page, last, full_pages, self.page_size)
        swa_idx = _fill_decode(needs_page, swa_last, swa_pages, self.page_size)
        self._map[full_idx] = swa_idx
        return self.full._out(full_idx)

    def free(self, full_idx: torch.Tensor) -> None:
        """Give back the full pages holding `full_idx` and their SWA pages.

        Raises `InvalidFree` (nothing freed) for out-of-range ids or pages already free.
        """
        idx = host_ids(full_idx)
        if idx.size == 0:
            return
        self.full.free_host(idx)
        self._free_swa(idx)

    def free_swa(self, full_idx: torch.Tensor) -> None:
        """Give back only the SWA KV of `full_idx`; the full slots stay allocated.

        With P > 1 this expands to the whole full pages that hold the indices. Only mapped
        slots are freed and the mapping is zeroed, so repeating the call frees nothing.
        """
        self._free_swa(host_ids(full_idx))

    def _free_swa(self, full_idx: np.ndarray) -> None:
        if full_idx.size == 0:
            return
        pages = self.full._pages_of(full_idx)  # raises InvalidFree for ids out of range
        if self.page_size > 1:  # whole pages
            full_idx = self.full._slots_of_pages(np.unique(pages))
        swa_idx = self._map[full_idx]  # [n] int64, a copy
        # Repeated full ids, found in O(n) instead of by a sort: each entry writes its own
        # stamp (negative, never an id) and reads it back; a repeat reads a later entry's.
        stamps = -2 - np.arange(len(full_idx), dtype=np.int64)  # [n] int64
        self._map[full_idx] = stamps
        distinct = bool(np.array_equal(self._map[full_idx], stamps))
        live = swa_idx[swa_idx > 0]  # the mapping is one-to-one: distinct ids, distinct slots
        try:
            if live.size:
                self.swa.free_host(live, distinct=distinct)
        except InvalidFree:
            self._map[full_idx] = swa_idx  # nothing freed, nothing changed
            raise
        self._map[full_idx] = 0

    def _translate_last_loc(self, last: np.ndarray, filled_lens: np.ndarray) -> np.ndarray:
        swa_last = self._map[last]
        if self.page_size == 1:  # every token starts its own page: nothing continues
            return swa_last
        continues = (filled_lens % self.page_size != 0) & (last >= 0)
        if (continues & (swa_last <= 0)).any():
            raise ValueError(
                "alloc: a request continues a partly filled page whose last token has no SWA KV "
                "(its SWA was freed); the last page of a sequence must keep its SWA KV"
            )
        return swa_last

    # ---- integrity -----------------------------------------------------------------------
    def check(self, owned: torch.Tensor | None = None) -> None:
        """Raise `AllocatorCorrupted` on a broken invariant (architecture §6).

        Both free lists are sound; mapped SWA slots are distinct, live (not free) and together
        with the free SWA slots cover the SWA pool exactly (no SWA leak); free full slots map to
        nothing; the sentinel is intact. `owned`, when given, is checked against the full pool.
        """
        self.full.check(owned)
        self.swa.check()
        if int(self._map[-1]) != NO_LAST_LOC:
            raise AllocatorCorrupted("full_to_swa sentinel was overwritten")
        mapping = self._map[:-1]
        if (mapping < 0).any():
            raise AllocatorCorrupted("full_to_swa holds negative SWA slot ids")
        full_slots = np.flatnonzero(mapping)
        swa_slots = mapping[full_slots]
        if full_slots.size:
            if self.full._page_is_free[self.full._pages_of(full_slots)].any():
                raise AllocatorCorrupted("a free full slot still maps to an SWA slot")
            if (
                int(swa_slots.min()) < self.page_size
                or int(swa_slots.max()) >= self.swa.size + self.page_size
            ):
                raise AllocatorCorrupted("full_to_swa holds SWA slot ids outside the SWA pool")
            if len(np.unique(swa_slots)) != len(swa_slots):
                raise AllocatorCorrupted(f"SWA slot(s) {_duplicates(swa_slots)} are owned twice")
            if self.swa._page_is_free[self.swa._pages_of(swa_slots)].any():
                raise AllocatorCorrupted("a mapped SWA slot is also in the SWA free list")
        # Every allocated SWA page is reachable from the mapping (otherwise it leaked).
        used_pages = np.unique(swa_slots // self.page_size)
        if len(used_pages) + self.swa.free_page_count() != self.swa.num_pages:
            leaked = self.swa.num_pages - len(used_pages) - self.swa.free_page_count()
            raise AllocatorCorrupted(f"SWA leak: {leaked} page(s) are neither free nor mapped")


# ---- shared paged-allocation arithmetic (host arrays) -------------------------------------


class _ExtendPart:
    __slots__ = ("in_page", "new_pages", "new_tokens")

    def __init__(self, in_page: int, new_tokens: int, new_pages: int) -> None:
        self.in_page = in_page  # tokens that continue the partly filled last page
        self.new_tokens = new_tokens  # tokens placed in new pages
        self.new_pages = new_pages


def _host_ints(values: torch.Tensor | np.ndarray | list[int]) -> np.ndarray:  # [n] int64
    if isinstance(values, torch.Tensor):
        return host_ids(values)
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _extend_args(
    prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor, page_size: int
) -> tuple[list[int], list[int], np.ndarray]:
    prefix = _host_ints(prefix_lens).tolist()
    seq = _host_ints(seq_lens).tolist()
    last = _host_ints(last_loc)
    if not (len(prefix) == len(seq) == len(last)):
        raise ValueError(
            f"alloc_extend: prefix_lens, seq_lens and last_loc differ in length "
            f"({len(prefix)}, {len(seq)}, {len(last)})"
        )
    for i, (p, s) in enumerate(zip(prefix, seq, strict=True)):
        if p < 0 or s < p:
            raise ValueError(f"alloc_extend: request {i} has prefix_len={p}, seq_len={s}")
        if p % page_size and int(last[i]) < 0:
            raise ValueError(
                f"alloc_extend: request {i} continues a partly filled page (prefix_len={p}, "
                f"page_size={page_size}) but has no last_loc"
            )
    return prefix, seq, last


def _extend_plan(prefix: list[int], seq: list[int], page_size: int) -> list[_ExtendPart]:
    plan = []
    for p, s in zip(prefix, seq, strict=True):
        page_end = page_ceil(p, page_size)  # end of the partly filled page
        in_page = min(s, page_end) - p
        new_tokens = s - p - in_page
        plan.append(_ExtendPart(in_page, new_tokens, cdiv(new_tokens, page_size)))
    return plan


def _fill_extend(
    plan: list[_ExtendPart], last: np.ndarray, pages: np.ndarray, page_size: int
) -> np.ndarray:
    out = []
    page_cursor = 0
    offsets = np.arange(page_size, dtype=np.int64)
    for part, last_slot in zip(plan, last.tolist(), strict=True):
        if part.in_page:
            out.append(np.arange(last_slot + 1, last_slot + 1 + part.in_page, dtype=np.int64))
        if part.new_pages:
            req_pages = pages[page_cursor : page_cursor + part.new_pages]
            page_cursor += part.new_pages
            out.append((req_pages[:, None] * page_size + offsets).reshape(-1)[: part.new_tokens])
    if not out:
        return np.empty(0, dtype=np.int64)
    return np.concatenate(out)  # [sum(seq - prefix)] int64


def _decode_args(
    seq_lens: torch.Tensor, last_loc: torch.Tensor, page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    seq = _host_ints(seq_lens)
    last = _host_ints(last_loc)
    if len(seq) != len(last):
        raise ValueError(f"alloc_decode: {len(seq)} seq_lens but {len(last)} last_loc")
    if len(seq) and int(seq.min()) < 1:
        raise ValueError("alloc_decode: seq_lens count the new token and must be >= 1")
    if page_size == 1:  # every token starts its own page
        return seq, last
    continues = (seq - 1) % page_size != 0
    if (continues & (last < 0)).any():
        raise ValueError("alloc_decode: a request continuing a page has no last_loc")
    return seq, last


def _fill_decode(
    needs_page: np.ndarray, last: np.ndarray, pages: np.ndarray, page_size: int
) -> np.ndarray:
    out = last + 1  # [batch] int64
    out[needs_page] = pages * page_size
    return out


def _duplicates(values: np.ndarray) -> list[int]:
    uniq, counts = np.unique(values, return_counts=True)
    return uniq[counts > 1][:8].tolist()
