from __future__ import annotations

import pytest
import torch
from attention_scenario import Scenario, Shape, make_layers, make_memory

from swaserve.worker.attention import (
    MissingSWAKV,
    TorchAttentionBackend,
    build_attention_metadata,
)
from swaserve.worker.attention.base import ForwardBatch
from swaserve.worker.kv import KVMemory

INF = float("-inf")


def scenario(single_pool: bool, *, window: int = 2, full_tokens: int = 24) -> Scenario:
    """Full pool 24 tokens, SWA pool 12 (P = 1): R0 prefills 6 tokens and R2 2 tokens. With two
    pools the caller then frees R0's out-of-window SWA slots (positions [0, 4) for W = 2)."""
    layers = make_layers(Shape(), window, "FS")
    memory = make_memory(
        layers, window, page_size=1, single_pool=single_pool, full_tokens=full_tokens
    )
    sc = Scenario(TorchAttentionBackend(memory.kv_pool, window), memory, layers, sinks=False)
    for rid in range(3):
        sc.add_request(rid, 12)
    sc.step({0: 6, 2: 2})
    return sc


def mixed_batch(sc: Scenario) -> ForwardBatch:
    """R1 prefills 3 tokens (full 9..11), R0 and R2 decode one token each (full 12, 13)."""
    return sc.batch({1: 3, 0: 1, 2: 1})


def test_two_pools_translate_the_window_once_and_full_layers_read_everything() -> None:
    sc = scenario(single_pool=False)
    assert sc.free_out_of_window(2) == 4  # R0's positions [0, 4) → SWA slots 1..4 freed
    meta = build_attention_metadata(mixed_batch(sc), 2, two_pools=sc.memory.two_pools)

    assert (meta.prefix_lens, meta.seq_lens) == ([0, 6, 2], [3, 7, 3])
    assert meta.extend_starts == [0, 3, 4, 5]
    assert (meta.prefill_ids, meta.decode_ids, meta.decode_rows.tolist()) == ([0], [1, 2], [3, 4])
    assert meta.out_full_loc.tolist() == [9, 10, 11, 12, 13]
    # SWA free list after the free: [9, 10, 11, 12, 1, 2, 3, 4]; R2's decode gets SWA slot 1.
    assert meta.out_swa_loc is not None and meta.out_swa_loc.tolist() == [9, 10, 11, 12, 1]

    full = meta.full
    assert not full.swa_pool and full.sliding_window_size is None
    assert (full.kv_start_pos, full.kv_lens, full.kv_indptr) == (
        [0, 0, 0],
        [3, 7, 3],
        [0, 3, 10, 13],
    )
    assert full.flat_slots().tolist() == [9, 10, 11, 1, 2, 3, 4, 5, 6, 12, 7, 8, 13]
    # Decodes padded to the longest read with the request's newest slot, masked by -inf.
    assert full.decode_slots.tolist() == [[1, 2, 3, 4, 5, 6, 12], [7, 8, 13, 13, 13, 13, 13]]
    assert full.decode_bias.tolist() == [[0.0] * 7, [0.0] * 3 + [INF] * 4]

    swa = meta.swa
    assert swa is not None and swa.swa_pool and swa.sliding_window_size == 2
    # Windows: R1 [0, 3), R0 [max(0, 6 - 2), 7) = [4, 7), R2 [0, 3).
    assert (swa.kv_start_pos, swa.kv_lens, swa.kv_indptr) == ([0, 4, 0], [3, 3, 3], [0, 3, 6, 9])
    assert swa.flat_slots().tolist() == [9, 10, 11, 5, 6, 12, 7, 8, 1]  # SWA slot ids
    assert swa.request_slots(1).tolist() == [5, 6, 12]
    assert swa.decode_slots.tolist() == [[5, 6, 12], [7, 8, 1]]
    assert swa.decode_bias.tolist() == [[0.0] * 3, [0.0] * 3]


def test_single_pool_swa_layers_read_full_slots_of_the_window() -> None:
    sc = scenario(single_pool=True)
    meta = build_attention_metadata(mixed_batch(sc), 2, two_pools=sc.memory.two_pools)
    assert meta.out_swa_loc is None
    assert meta.full.flat_slots().tolist() == [9, 10, 11, 1, 2, 3, 4, 5, 6, 12, 7, 8, 13]
    swa = meta.swa
    assert swa is not None and not swa.swa_pool
    assert swa.kv_start_pos == [0, 4, 0]
    assert swa.flat_slots().tolist() == [9, 10, 11, 5, 6, 12, 7, 8, 13]  # full slot ids
    assert swa.decode_slots.tolist() == [[5, 6, 12], [7, 8, 13]]


def test_window_larger_than_the_sequence_reads_from_position_zero() -> None:
    sc = scenario(single_pool=False, window=10, full_tokens=48)
    meta = build_attention_metadata(mixed_batch(sc), 10, two_pools=sc.memory.two_pools)
    assert meta.swa is not None
    assert meta.swa.kv_start_pos == [0, 0, 0]
    assert meta.swa.kv_lens == meta.full.kv_lens == [3, 7, 3]


def test_a_freed_slot_inside_the_window_raises() -> None:
    sc = scenario(single_pool=False)
    sc.free_out_of_window(2)
    alloc = sc.memory.allocator
    # R0's window for this step is [4, 7); free the SWA KV of position 4 (full slot 5) too early.
    alloc.free_swa(sc.requests[0].slots[4:5])  # type: ignore[union-attr]
    batch = mixed_batch(sc)
    with pytest.raises(MissingSWAKV, match=r"request 1: .*\[4, 7\).*position 4 \(full slot 5\)"):
        build_attention_metadata(batch, 2, two_pools=sc.memory.two_pools)


def test_freed_slots_before_the_window_are_fine() -> None:
    sc = scenario(single_pool=False)
    alloc = sc.memory.allocator
    alloc.free_swa(sc.requests[0].slots[:4])  # type: ignore[union-attr]
    meta = build_attention_metadata(mixed_batch(sc), 2, two_pools=sc.memory.two_pools)
    assert meta.swa is not None and meta.swa.kv_start_pos[1] == 4


def test_bad_input_is_rejected() -> None:
    sc = scenario(single_pool=False)
    sc.free_out_of_window(2)
    batch = mixed_batch(sc)
    with pytest.raises(ValueError, match="pass sliding_window_size"):
        build_attention_metadata(batch, None, two_pools=sc.memory.two_pools)
    with pytest.raises(ValueError, match="sliding_window_size must be >= 0"):
        build_attention_metadata(batch, -1, two_pools=sc.memory.two_pools)
    slots = [batch.request_slots(i) for i in range(batch.batch_size)]
    with pytest.raises(ValueError, match="request 0: req_token_slots holds 2 slots, fewer than"):
        ForwardBatch.from_slots(
            input_ids=batch.input_ids,
            positions=batch.positions,
            prefix_lens=batch.prefix_lens,
            seq_lens=batch.seq_lens,
            req_token_slots=[slots[0][:2], *slots[1:]],
            out_full_loc=batch.out_full_loc,
        )
    meta = build_attention_metadata(batch, 2, two_pools=sc.memory.two_pools)
    other_window = make_layers(Shape(), 3, "FS")[1]
    with pytest.raises(
        ValueError, match="sliding_window_size=3, but the backend was built for W=2"
    ):
        meta.reads(other_window)


def page_scenario(single_pool: bool) -> tuple[Scenario, KVMemory]:
    """P = 4, W = 5: R0 prefills 11 tokens and frees its out-of-window pages; then R0 decodes and
    R1 prefills 6 tokens."""
    layers = make_layers(Shape(), 5, "FS")
    memory = make_memory(layers, 5, page_size=4, single_pool=single_pool, full_tokens=64)
    sc = Scenario(TorchAttentionBackend(memory.kv_pool, 5), memory, layers, sinks=False)
    sc.add_request(0, 16)
    sc.add_request(1, 16)
    sc.step({0: 11})
    if not single_pool:
        assert sc.free_out_of_window(5) == 4  # floor_4(11 - 5) = 4: positions [0, 4)
    return sc, memory


@pytest.mark.parametrize("single_pool", [False, True])
def test_page_table_rebuilds_every_read_slot(single_pool: bool) -> None:
    sc, memory = page_scenario(single_pool)
    meta = build_attention_metadata(sc.batch({0: 1, 1: 6}), 5, two_pools=memory.two_pools)
    for reads in (meta.full, meta.swa):
        assert reads is not None
        table, seqused = reads.page_table(4)
        assert table.dtype == torch.int32 and seqused.dtype == torch.int32
        for i in range(2):
            start, n = reads.kv_start_pos[i], reads.kv_lens[i]
            first = start // 4 * 4
            assert int(seqused[i]) == start + n - first
            pos = torch.arange(start, start + n) - first  # offsets into the table's pages
            rebuilt = table[i].long()[pos // 4] * 4 + pos % 4
            assert torch.equal(rebuilt, reads.request_slots(i))


def test_page_table_exact_for_two_pools() -> None:
    sc, memory = page_scenario(single_pool=False)
    meta = build_attention_metadata(sc.batch({0: 1, 1: 6}), 5, two_pools=memory.two_pools)
    # Full pool: R0 holds pages 1, 2, 3 (positions 0..11); R1 takes pages 4, 5.
    table, seqused = meta.full.page_table(4)
    assert table.tolist() == [[1, 2, 3], [4, 5, 0]] and seqused.tolist() == [12, 6]
    # SWA: R0's window starts at position 11 - 5 = 6, inside its second page; page 1 of the SWA
    # pool was freed and went to the back of the free list, so R1 got SWA pages 4 and 5.
    assert meta.swa is not None
    table, seqused = meta.swa.page_table(4)
    assert table.tolist() == [[2, 3], [4, 5]] and seqused.tolist() == [8, 6]
    assert meta.swa.kv_start_pos == [6, 0]
