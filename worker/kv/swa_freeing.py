"""Give back SWA KV that slid out of a running request's window.

Positions of one request, with `pre_len` tokens already in the KV cache:

    # [0, cache_protected_len)                 owned by the radix tree (never freed here)
    # [cache_protected_len, swa_evicted_seqlen) SWA already freed by this request
    # [swa_evicted_seqlen, boundary)            may be freed now
    # [boundary, pre_len)                       the window (and the page of the last token)

`boundary = floor_P(pre_len - W)` with the chunk cache (no prefix tree), and
`floor_P(min(pre_len - max(W, P), floor_P(pre_len) - W))` with the radix cache: the tree receives
the page-aligned prefix `[0, floor_P(pre_len))`, whose end stays matchable only while the W tokens
before it keep their SWA KV. Under chunked attention (`attention_chunk_size` C) the next query
and the tree's end both read only their chunk, so `boundary = floor(pre_len / C)·C` in both
modes: a request gives back its whole previous chunk at each boundary. In every mode it never
reaches the page holding token `pre_len - 1`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from swaserve.proto.kv_rules import read_start
from swaserve.worker.kv.allocator import SWATokenAllocator

SlotsT = TypeVar("SlotsT", torch.Tensor, np.ndarray)


@dataclass(slots=True)
class SWAFreeState:
    """Per-request SWA bookkeeping: `[cache_protected_len, swa_evicted_seqlen)` is freed.
    `next_check_len`: the scheduler skips the request until it has computed this many tokens
    (nothing can be due before; 0 = check now)."""

    swa_evicted_seqlen: int = 0
    cache_protected_len: int = 0
    next_check_len: int = 0

    @property
    def own_start(self) -> int:
        """The first position whose SWA slot the request holds itself (before it: the
        tree's, or freed)."""
        return max(self.swa_evicted_seqlen, self.cache_protected_len)


def swa_free_boundary(
    pre_len: int,
    *,
    sliding_window_size: int,
    page_size: int,
    radix_cache: bool,
    attention_chunk_size: int | None = None,
) -> int:
    """End (exclusive) of the positions whose SWA KV is out of the window; page-floored."""
    if pre_len < 0 or sliding_window_size < 0 or page_size <= 0:
        raise ValueError(
            f"bad arguments: pre_len={pre_len}, sliding_window_size={sliding_window_size}, "
            f"page_size={page_size}"
        )
    if attention_chunk_size:
        limit = read_start(pre_len, sliding_window_size, attention_chunk_size)
    elif radix_cache:
        aligned_end = pre_len // page_size * page_size
        limit = min(
            pre_len - max(sliding_window_size, page_size), aligned_end - sliding_window_size
        )
    else:
        limit = pre_len - sliding_window_size
    boundary = max(0, limit) // page_size * page_size
    last_page_start = max(0, pre_len - 1) // page_size * page_size
    return min(boundary, last_page_start)


def free_swa_out_of_window_slots(
    allocator: SWATokenAllocator,
    state: SWAFreeState,
    token_indices: torch.Tensor,
    pre_len: int,
    *,
    sliding_window_size: int,
    radix_cache: bool,
    min_free_tokens: int = 0,
    attention_chunk_size: int | None = None,
) -> int:
    """Free the SWA slots of positions `[max(swa_evicted_seqlen, cache_protected_len), boundary)`.

    `token_indices` holds the request's full slot ids by position (at least `pre_len` of them).
    Nothing is freed until at least `min_free_tokens` positions are due (the eviction interval).
    Mutates `state.swa_evicted_seqlen`; returns the number of positions freed.
    """
    due = take_out_of_window_range(
        state,
        token_indices,
        pre_len,
        sliding_window_size=sliding_window_size,
        page_size=allocator.page_size,
        radix_cache=radix_cache,
        min_free_tokens=min_free_tokens,
        attention_chunk_size=attention_chunk_size,
    )
    if due is None:
        return 0
    allocator.free_swa(due)
    return due.numel()


def take_out_of_window_range(
    state: SWAFreeState,
    token_indices: SlotsT,
    pre_len: int,
    *,
    sliding_window_size: int,
    page_size: int,
    radix_cache: bool,
    min_free_tokens: int = 0,
    attention_chunk_size: int | None = None,
) -> SlotsT | None:
    """The full slots whose SWA KV is due to be freed (see `free_swa_out_of_window_slots`), with
    `state.swa_evicted_seqlen` already moved past them; None when nothing is due. The caller
    frees them (several requests' at once: one `free_swa` call). `token_indices` is a tensor
    or a host array (then so is the result, a view of it)."""
    if state.cache_protected_len % page_size:
        raise ValueError(
            f"cache_protected_len={state.cache_protected_len} is not page-aligned (P={page_size})"
        )
    if len(token_indices) < pre_len:
        raise ValueError(
            f"token_indices holds {len(token_indices)} slots, fewer than pre_len={pre_len}"
        )
    start = max(state.swa_evicted_seqlen, state.cache_protected_len)
    boundary = swa_free_boundary(
        pre_len,
        sliding_window_size=sliding_window_size,
        page_size=page_size,
        radix_cache=radix_cache,
        attention_chunk_size=attention_chunk_size,
    )
    if boundary <= start or boundary - start < min_free_tokens:
        state.swa_evicted_seqlen = start
        return None
    state.swa_evicted_seqlen = boundary
    return token_indices[start:boundary]
