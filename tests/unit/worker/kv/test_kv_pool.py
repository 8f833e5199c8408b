from __future__ import annotations

import pytest
import torch

from swaserve.worker.kv import KVLayout, KVPool, SWAKVPool, SWATokenAllocator

# MiMo-V2-Flash-like: full layers 4 KV heads, SWA layers 8; K dim 192, V dim 128 (scaled down).
FULL = KVLayout(num_kv_heads=4, head_dim=12, v_head_dim=8)
SWA = KVLayout(num_kv_heads=8, head_dim=12, v_head_dim=8)


def make_pool(page_size: int = 1, **scratch: object) -> SWAKVPool:
    return SWAKVPool(
        full_size=16,
        swa_size=8,
        full_layer_ids=[0, 3],
        swa_layer_ids=[1, 2, 4],
        full_layout=FULL,
        swa_layout=SWA,
        page_size=page_size,
        **scratch,  # type: ignore[arg-type]
    )


def test_layers_mapping_and_shapes() -> None:
    pool = make_pool()
    assert {k: (v.local_id, v.is_swa) for k, v in pool.layers_mapping.items()} == {
        0: (0, False),
        1: (0, True),
        2: (1, True),
        3: (1, False),
        4: (2, True),
    }
    k, v = pool.get_kv_buffer(3)
    assert tuple(k.shape) == (17, 4, 12) and tuple(v.shape) == (17, 4, 8)
    k, v = pool.get_kv_buffer(4)
    assert tuple(k.shape) == (9, 8, 12) and tuple(v.shape) == (9, 8, 8)
    assert pool.kv_bytes() == 17 * 2 * 4 * 20 * 4 + 9 * 3 * 8 * 20 * 4


def test_writes_go_to_full_or_translated_swa_slots() -> None:
    alloc = SWATokenAllocator(16, 8)
    pool = make_pool()
    spare = alloc.alloc(3)
    filler = alloc.alloc(5)
    assert spare is not None and filler is not None
    alloc.free_swa(spare)  # SWA slots 1..3 come back, full slots 1..3 stay taken
    alloc.free(filler)
    full_loc = alloc.alloc(2)
    assert full_loc is not None
    swa_loc = alloc.translate(full_loc)  # once per batch
    assert full_loc.tolist() == [9, 10] and swa_loc.tolist() == [1, 2]
    k_full = torch.randn(2, 4, 12)
    v_full = torch.randn(2, 4, 8)
    k_swa = torch.randn(2, 8, 12)
    v_swa = torch.randn(2, 8, 8)
    pool.set_kv_buffer(0, full_loc, swa_loc, k_full, v_full)
    pool.set_kv_buffer(2, full_loc, swa_loc, k_swa, v_swa)
    assert torch.equal(pool.get_kv_buffer(0)[0][full_loc], k_full)
    assert torch.equal(pool.get_kv_buffer(2)[1][swa_loc], v_swa)
    assert torch.count_nonzero(pool.get_kv_buffer(1)[0]) == 0  # other SWA layers untouched


def test_swa_write_needs_translated_locations() -> None:
    pool = make_pool()
    with pytest.raises(ValueError, match="swa_loc"):
        pool.set_kv_buffer(1, torch.tensor([1]), None, torch.zeros(1, 8, 12), torch.zeros(1, 8, 8))
    with pytest.raises(ValueError, match="no layer 7"):
        pool.get_kv_buffer(7)


def test_bad_layer_lists() -> None:
    with pytest.raises(ValueError, match="both full and SWA"):
        SWAKVPool(
            full_size=4,
            swa_size=4,
            full_layer_ids=[0, 1],
            swa_layer_ids=[1],
            full_layout=FULL,
            swa_layout=SWA,
        )
    with pytest.raises(ValueError, match="exactly once"):
        SWAKVPool(
            full_size=4,
            swa_size=4,
            full_layer_ids=[0],
            swa_layer_ids=[2],
            full_layout=FULL,
            swa_layout=SWA,
        )
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVLayout(num_kv_heads=0, head_dim=4, v_head_dim=4)


def test_single_pool_holds_mixed_layouts() -> None:
    pool = KVPool(8, [FULL, SWA, SWA], dtype=torch.bfloat16, page_size=4)
    assert tuple(pool.get_key_buffer(1).shape) == (12, 8, 12)
    assert pool.token_bytes() == (4 * 20 + 2 * 8 * 20) * 2
    with pytest.raises(ValueError, match="locations"):
        pool.set_kv_buffer(0, torch.tensor([4, 5]), torch.zeros(1, 4, 12), torch.zeros(1, 4, 8))


def test_scratch_rows_only_in_the_scratch_layers() -> None:
    """MTP draft steps' scratch pages (`engine.mtp`): past the slots and the padding page, in
    the buffers of the MTP layers alone (here global layer 4, the SWA pool's local layer 2)."""
    pool = make_pool(page_size=2, scratch_rows=6, scratch_layer_ids=frozenset({4}))
    assert pool.swa_pool.scratch_base == 10
    rows = {layer: pool.get_kv_buffer(layer)[0].shape[0] for layer in range(5)}
    assert rows == {0: 18, 1: 10, 2: 10, 3: 18, 4: 16}
    assert pool.kv_bytes() == make_pool(page_size=2).kv_bytes()  # the plan's bytes: no scratch
    pool.set_kv_buffer(
        4, torch.tensor([0]), torch.tensor([15]), torch.ones(1, 8, 12), torch.ones(1, 8, 8)
    )
    single = KVPool(8, [FULL, SWA], page_size=2, scratch_rows=4, scratch_layer_ids=frozenset({1}))
    assert [b.shape[0] for b in single.k_buffer] == [10, 14] and single.scratch_base == 10
