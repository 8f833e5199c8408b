from __future__ import annotations

import pytest
import torch

from swaserve.worker.kv import (
    SWAFreeState,
    SWATokenAllocator,
    free_swa_out_of_window_slots,
    swa_free_boundary,
)


def grow(alloc: SWATokenAllocator, slots: torch.Tensor, n: int) -> torch.Tensor:
    pre = slots.numel()
    last = int(slots[-1]) if pre else -1
    out = alloc.alloc_extend(torch.tensor([pre]), torch.tensor([pre + n]), torch.tensor([last]))
    assert out is not None
    return torch.cat((slots, out))


def test_p1_radix_frees_up_to_pre_len_minus_w() -> None:
    alloc = SWATokenAllocator(64, 64, page_size=1)
    state = SWAFreeState()
    slots = torch.empty(0, dtype=torch.int64)
    for pre_len in range(1, 30):
        slots = grow(alloc, slots, 1)
        free_swa_out_of_window_slots(
            alloc, state, slots, pre_len, sliding_window_size=4, radix_cache=True
        )
        assert state.swa_evicted_seqlen == max(0, pre_len - 4)
        assert alloc.swa_available_size() == 64 - min(pre_len, 4)
        alloc.check(owned=slots)


def test_p8_w4_pre_len_9_frees_nothing() -> None:
    alloc = SWATokenAllocator(64, 64, page_size=8)
    state = SWAFreeState()
    slots = grow(alloc, torch.empty(0, dtype=torch.int64), 9)
    assert (
        free_swa_out_of_window_slots(
            alloc, state, slots, 9, sliding_window_size=4, radix_cache=True
        )
        == 0
    )
    assert (
        free_swa_out_of_window_slots(
            alloc, state, slots, 9, sliding_window_size=4, radix_cache=False
        )
        == 0
    )
    assert state.swa_evicted_seqlen == 0
    assert alloc.swa_available_size() == 64 - 16


@pytest.mark.parametrize("page_size", [4, 8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("radix", [True, False])
def test_boundary_stays_below_the_last_page_when_w_below_p(page_size: int, radix: bool) -> None:
    for window in {0, 1, page_size // 2, page_size - 1}:
        for pre_len in range(1, 3 * page_size + 2):
            boundary = swa_free_boundary(
                pre_len, sliding_window_size=window, page_size=page_size, radix_cache=radix
            )
            last_page_start = (pre_len - 1) // page_size * page_size
            assert boundary % page_size == 0
            assert boundary <= last_page_start
            assert boundary <= max(0, pre_len - window)


def test_chunk_cache_and_radix_bounds_differ() -> None:
    # W = 4, P = 8, pre_len = 20: chunk cache frees [0, 16), radix keeps max(W, P) = 8 → [0, 8).
    assert swa_free_boundary(20, sliding_window_size=4, page_size=8, radix_cache=False) == 16
    assert swa_free_boundary(20, sliding_window_size=4, page_size=8, radix_cache=True) == 8
    # pre_len = 16: the last token sits in page [8, 16); chunk cache may free [0, 8) only.
    assert swa_free_boundary(16, sliding_window_size=4, page_size=8, radix_cache=False) == 8
    assert swa_free_boundary(16, sliding_window_size=4, page_size=8, radix_cache=True) == 8


def test_lower_bound_is_cache_protected_len_and_interval_waits() -> None:
    alloc = SWATokenAllocator(64, 64, page_size=4)
    slots = grow(alloc, torch.empty(0, dtype=torch.int64), 30)
    state = SWAFreeState(cache_protected_len=8)
    # boundary = floor4(30 - 4) = 24; 16 tokens due; an interval of 20 waits.
    assert (
        free_swa_out_of_window_slots(
            alloc, state, slots, 30, sliding_window_size=4, radix_cache=True, min_free_tokens=20
        )
        == 0
    )
    assert (
        free_swa_out_of_window_slots(
            alloc, state, slots, 30, sliding_window_size=4, radix_cache=True, min_free_tokens=16
        )
        == 16
    )
    assert state.swa_evicted_seqlen == 24
    assert (alloc.translate(slots[:8]) > 0).all()  # the tree's part is untouched
    assert (alloc.translate(slots[8:24]) == 0).all()
    assert (alloc.translate(slots[24:]) > 0).all()
    alloc.check(owned=slots)


def test_unaligned_protected_len_raises() -> None:
    alloc = SWATokenAllocator(64, 64, page_size=4)
    slots = grow(alloc, torch.empty(0, dtype=torch.int64), 20)
    with pytest.raises(ValueError, match="page-aligned"):
        free_swa_out_of_window_slots(
            alloc,
            SWAFreeState(cache_protected_len=3),
            slots,
            20,
            sliding_window_size=4,
            radix_cache=True,
        )
    with pytest.raises(ValueError, match="pre_len"):
        free_swa_out_of_window_slots(
            alloc, SWAFreeState(), slots, 21, sliding_window_size=4, radix_cache=True
        )


def test_radix_boundary_keeps_the_window_of_the_cached_prefix() -> None:
    # P = 4, W = 5, pre_len = 15: the tree will receive [0, 12); tokens 7..11 must stay live,
    # so only [0, 4) may go (pre_len - max(W, P) alone would allow [0, 8)).
    assert swa_free_boundary(15, sliding_window_size=5, page_size=4, radix_cache=True) == 4
    assert swa_free_boundary(15, sliding_window_size=5, page_size=4, radix_cache=False) == 8
    for pre_len in range(1, 80):
        for window, page in [(5, 4), (1, 8), (9, 4), (3, 1)]:
            boundary = swa_free_boundary(
                pre_len, sliding_window_size=window, page_size=page, radix_cache=True
            )
            assert boundary <= max(0, pre_len // page * page - window)
