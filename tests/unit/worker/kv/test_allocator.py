from __future__ import annotations

import numpy as np
import pytest
import torch

from swaserve.worker.kv import AllocatorCorrupted, InvalidFree, SWATokenAllocator, TokenAllocator


def t(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ---- the scenarios of the issue ---------------------------------------------------------------


def test_p1_available_sizes_and_repeated_free_swa() -> None:
    alloc = SWATokenAllocator(16, 16, page_size=1)
    assert alloc.full_available_size() + alloc.swa_available_size() == 32
    idx = alloc.alloc(1)
    assert idx is not None and idx.tolist() == [1]
    assert alloc.full_available_size() + alloc.swa_available_size() == 30
    alloc.free_swa(idx)
    alloc.free_swa(idx)
    assert alloc.translate(idx).tolist() == [0]
    assert alloc.swa_available_size() == 16
    assert alloc.full_available_size() == 15
    alloc.check(owned=idx)
    alloc.free(idx)
    assert alloc.available_size() == 16
    alloc.check()


def test_p4_free_swa_expands_to_the_page() -> None:
    alloc = SWATokenAllocator(16, 16, page_size=4)
    idx = alloc.alloc(4)
    assert idx is not None and idx.tolist() == [4, 5, 6, 7]
    assert alloc.swa_available_size() == 12
    assert alloc.translate(idx).tolist() == [4, 5, 6, 7]
    alloc.free_swa(idx[:1])
    assert alloc.swa_available_size() == 16
    assert alloc.translate(idx).tolist() == [0, 0, 0, 0]
    alloc.free_swa(idx[1:2])
    assert alloc.swa_available_size() == 16
    assert alloc.full_available_size() == 12
    alloc.check(owned=idx)


def test_translate_sentinel() -> None:
    alloc = SWATokenAllocator(16, 16, page_size=4)
    assert alloc.translate(t(-1)).tolist() == [-1]
    assert alloc.full_to_swa.numel() == 16 + 4 + 1


# ---- allocation paths -------------------------------------------------------------------------


def test_alloc_returns_none_when_either_pool_is_short() -> None:
    alloc = SWATokenAllocator(16, 4, page_size=1)
    assert alloc.available_size() == 4
    assert alloc.alloc(5) is None
    assert alloc.full_available_size() == 16  # nothing taken
    assert alloc.alloc(4) is not None
    assert alloc.alloc(1) is None
    alloc.check()


def test_alloc_extend_continues_the_partial_page() -> None:
    alloc = SWATokenAllocator(32, 32, page_size=4)
    # Two requests: a new one of 6 tokens, one with 2 cached tokens growing to 5.
    first = alloc.alloc_extend(t(0), t(2), t(-1))
    assert first is not None and first.tolist() == [4, 5]
    out = alloc.alloc_extend(t(0, 2), t(6, 5), t(-1, 5))
    assert out is not None
    # request 0: a new page (8..11) and half of the next (12, 13); request 1: 6, 7 then page 16.
    assert out.tolist() == [8, 9, 10, 11, 12, 13, 6, 7, 16]
    swa = alloc.translate(out)
    # The SWA side continues its own page through translate(last_loc) = 5.
    assert swa.tolist() == [8, 9, 10, 11, 12, 13, 6, 7, 16]
    alloc.check(owned=torch.cat((first, out)))


def test_alloc_extend_when_swa_pages_differ_from_full_pages() -> None:
    alloc = SWATokenAllocator(64, 32, page_size=4)
    spare = alloc.alloc(4)  # full page 1, SWA page 1
    assert spare is not None
    alloc.free_swa(spare)  # SWA page 1 goes to the back of the SWA queue
    block = alloc.alloc(28)  # full pages 2..8, SWA pages 2..8
    assert block is not None
    req = alloc.alloc_extend(t(0), t(3), t(-1))  # full page 9, SWA page 1
    assert req is not None and req.tolist() == [36, 37, 38]
    assert alloc.translate(req).tolist() == [4, 5, 6]
    alloc.free(block)
    more = alloc.alloc_extend(t(3), t(9), t(38))
    assert more is not None and more.tolist() == [39, 40, 41, 42, 43, 44]
    # The SWA side continues its own page after translate(38) = 6, then takes pages 2 and 3.
    assert alloc.translate(more).tolist() == [7, 8, 9, 10, 11, 12]
    alloc.check(owned=torch.cat((spare, req, more)))


def test_alloc_decode_new_page_only_at_page_start() -> None:
    alloc = SWATokenAllocator(32, 32, page_size=4)
    a = alloc.alloc_extend(t(0, 0), t(3, 4), t(-1, -1))
    assert a is not None and a.tolist() == [4, 5, 6, 8, 9, 10, 11]
    out = alloc.alloc_decode(t(4, 5), t(6, 11))
    assert out is not None and out.tolist() == [7, 12]
    assert alloc.translate(out).tolist() == [7, 12]
    assert alloc.full_available_size() == 32 - 12
    alloc.check(owned=torch.cat((a, out)))


def test_alloc_decode_none_when_swa_is_short() -> None:
    alloc = SWATokenAllocator(32, 4, page_size=4)
    a = alloc.alloc_extend(t(0), t(4), t(-1))
    assert a is not None
    assert alloc.alloc_decode(t(5), t(7)) is None
    assert alloc.full_available_size() == 28
    alloc.check(owned=a)


def test_decode_continuing_a_page_whose_swa_was_freed_is_refused() -> None:
    alloc = SWATokenAllocator(32, 32, page_size=4)
    a = alloc.alloc_extend(t(0), t(3), t(-1))
    assert a is not None
    alloc.free_swa(a)
    with pytest.raises(ValueError, match="no SWA KV"):
        alloc.alloc_decode(t(4), t(6))
    alloc.check(owned=a)


def test_free_then_free_swa_never_double_frees() -> None:
    alloc = SWATokenAllocator(8, 8, page_size=1)
    idx = alloc.alloc(3)
    assert idx is not None
    alloc.free_swa(idx)
    alloc.free(idx)
    assert alloc.full_available_size() == 8
    assert alloc.swa_available_size() == 8
    alloc.check()


def test_token_allocator_alone() -> None:
    alloc = TokenAllocator(12, page_size=4)
    assert alloc.available_size() == 12
    a = alloc.alloc_extend(t(0), t(5), t(-1))
    assert a is not None and a.tolist() == [4, 5, 6, 7, 8]
    d = alloc.alloc_decode(t(6), t(8))
    assert d is not None and d.tolist() == [9]
    assert alloc.alloc(8) is None
    alloc.check(owned=torch.cat((a, d)))
    alloc.free(torch.cat((a, d)))
    assert alloc.available_size() == 12
    alloc.check(owned=torch.empty(0, dtype=torch.int64))


# ---- bad input and corruption -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("full", "swa", "page"),
    [(-1, 4, 1), (4, -4, 1), (4, 4, 0), (4, 4, -2), (6, 8, 4), (8, 6, 4)],
)
def test_bad_sizes_raise(full: int, swa: int, page: int) -> None:
    with pytest.raises(ValueError):
        SWATokenAllocator(full, swa, page_size=page)


def test_alloc_bad_count_raises() -> None:
    alloc = SWATokenAllocator(16, 16, page_size=4)
    with pytest.raises(ValueError, match="multiple of page_size"):
        alloc.alloc(3)
    with pytest.raises(ValueError):
        alloc.alloc(-4)


def test_alloc_extend_bad_lengths_raise() -> None:
    alloc = SWATokenAllocator(16, 16, page_size=4)
    with pytest.raises(ValueError, match="prefix_len"):
        alloc.alloc_extend(t(3), t(2), t(5))
    with pytest.raises(ValueError, match="differ in length"):
        alloc.alloc_extend(t(0, 0), t(2), t(-1))
    with pytest.raises(ValueError, match="no last_loc"):
        alloc.alloc_extend(t(2), t(4), t(-1))
    alloc.check()


def test_free_never_allocated_raises_and_changes_nothing() -> None:
    alloc = SWATokenAllocator(8, 8, page_size=1)
    idx = alloc.alloc(2)
    assert idx is not None
    with pytest.raises(InvalidFree, match="double free"):
        alloc.free(t(5))
    with pytest.raises(InvalidFree, match="double free"):
        alloc.free(t(1, 5))  # one good id does not make the call half-succeed
    assert alloc.full_available_size() == 6
    with pytest.raises(InvalidFree, match="padding"):
        alloc.free(t(0))
    with pytest.raises(InvalidFree):
        alloc.free(t(9))
    alloc.check(owned=idx)


def test_check_catches_a_planted_leak() -> None:
    alloc = SWATokenAllocator(8, 8, page_size=1)
    idx = alloc.alloc(3)
    assert idx is not None
    alloc.check(owned=idx)
    with pytest.raises(AllocatorCorrupted, match="leak"):
        alloc.check(owned=idx[:2])  # one slot is held by nobody
    # An SWA slot dropped from the mapping without being freed is an SWA leak.
    alloc.full_to_swa[idx[0]] = 0
    with pytest.raises(AllocatorCorrupted, match="SWA leak"):
        alloc.check()


def test_check_catches_a_planted_double_free() -> None:
    alloc = SWATokenAllocator(8, 8, page_size=1)
    idx = alloc.alloc(2)
    assert idx is not None
    alloc.full._free_pages = np.concatenate((alloc.full._free_pages, alloc.full._free_pages[:1]))
    with pytest.raises(AllocatorCorrupted, match="double free"):
        alloc.check()


def test_check_catches_double_ownership_of_an_swa_slot() -> None:
    alloc = SWATokenAllocator(8, 8, page_size=1)
    idx = alloc.alloc(2)
    assert idx is not None
    alloc.full_to_swa[idx[1]] = alloc.full_to_swa[idx[0]]
    with pytest.raises(AllocatorCorrupted, match="owned twice"):
        alloc.check()


def test_check_catches_an_swa_slot_both_mapped_and_free() -> None:
    alloc = SWATokenAllocator(8, 8, page_size=1)
    idx = alloc.alloc(1)
    assert idx is not None
    alloc.swa.free(alloc.translate(idx))  # bypasses the mapping
    with pytest.raises(AllocatorCorrupted):
        alloc.check()


def test_token_allocator_speaks_the_two_pool_contract() -> None:
    alloc = TokenAllocator(8, page_size=1)
    idx = alloc.alloc(2)
    assert idx is not None
    assert alloc.translate(t(-1, 1)).tolist() == [-1, 1]
    alloc.free_swa(idx)  # SWA-layer KV stays in the slot
    assert alloc.full_available_size() == alloc.swa_available_size() == 6
    assert alloc.full is alloc and alloc.full_size == 8
    alloc.check(owned=idx)


def test_free_swa_with_repeated_ids_frees_each_swa_slot_once() -> None:
    alloc = SWATokenAllocator(8, 8, page_size=1)
    idx = alloc.alloc(4)
    assert idx is not None
    alloc.free_swa(torch.cat((idx[:3], idx[1:2], idx[2:3])))  # ids 1 and 2 twice
    assert alloc.swa_available_size() == 4 + 3
    assert alloc.translate(idx).tolist() == [0, 0, 0, int(alloc.translate(idx[3:])[0])]
    alloc.check(owned=idx)
    alloc.free(idx)
    alloc.check(owned=torch.empty(0, dtype=torch.int64))
    assert alloc.available_size() == 8


def test_free_swa_of_an_already_free_swa_slot_raises_and_changes_nothing() -> None:
    alloc = SWATokenAllocator(8, 8, page_size=1)
    idx = alloc.alloc(3)
    assert idx is not None
    mapping = alloc.full_to_swa.clone()
    alloc.swa.free(alloc.translate(idx[1:2]))  # plant: the SWA slot is freed behind the map
    with pytest.raises(InvalidFree, match="double free"):
        alloc.free_swa(idx)
    assert torch.equal(alloc.full_to_swa, mapping)
