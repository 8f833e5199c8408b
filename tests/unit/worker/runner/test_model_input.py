"""`ModelInput` packing for the TP broadcast: two flat int64 tensors and back, exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from swaserve.worker.runner.model_input import (
    COMMAND_FIELD,
    HEADER_LEN,
    SlotWrites,
    build_model_input,
    pack_model_input,
    payload_len,
    unpack_model_input,
)


def translate(full: torch.Tensor) -> torch.Tensor:
    return full * 10


@pytest.mark.parametrize("two_pools", [True, False])
def test_pack_unpack_round_trip(two_pools: bool) -> None:
    writes = SlotWrites(
        torch.tensor([3, 3]),
        torch.tensor([0, 1]),
        torch.tensor([7, 8]),
        torch.tensor([70, 80]) if two_pools else None,
    )
    inp = build_model_input(
        token_ids=[5, 6, 7, 9],
        prefix_lens=[2, 10],
        extend_lens=[3, 1],
        req_rows=[3, 0],
        samples=[True, True],
        out_full_loc=torch.tensor([11, 12, 13, 20]),
        writes=writes,
        translate=translate if two_pools else None,
        sliding_window_size=4 if two_pools else None,
    )
    assert inp.positions.tolist() == [2, 3, 4, 10]
    assert inp.seq_lens.tolist() == [5, 11]
    assert inp.logits_indices.tolist() == [2, 3]
    header, payload = pack_model_input(inp)
    assert header.numel() == HEADER_LEN and int(header[COMMAND_FIELD]) == 0
    assert payload.numel() == payload_len(header)
    back = unpack_model_input(header, payload)
    for name in ("input_ids", "positions", "req_rows", "prefix_lens", "seq_lens", "out_full_loc"):
        assert torch.equal(getattr(back, name), getattr(inp, name)), name
    assert torch.equal(back.logits_indices, inp.logits_indices)
    assert torch.equal(back.writes.full, writes.full)
    assert torch.equal(back.writes.positions, writes.positions)
    assert back.sliding_window_size == inp.sliding_window_size
    if two_pools:
        assert back.out_swa_loc is not None and back.out_swa_loc.tolist() == [110, 120, 130, 200]
        assert back.writes.swa is not None and back.writes.swa.tolist() == [70, 80]
    else:
        assert back.out_swa_loc is None and back.writes.swa is None


def test_mismatched_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="one entry per new token"):
        build_model_input(
            token_ids=[1, 2],
            prefix_lens=[0],
            extend_lens=[2],
            req_rows=[0],
            samples=[True],
            out_full_loc=torch.tensor([1]),
            writes=SlotWrites.empty(False),
            translate=None,
            sliding_window_size=None,
        )


def test_a_window_repair_travels_and_names_its_tokens() -> None:
    inp = build_model_input(
        token_ids=[5, 6, 7, 8, 9, 1],
        prefix_lens=[4, 10],
        extend_lens=[5, 1],
        req_rows=[2, 0],
        samples=[True, True],
        out_full_loc=torch.tensor([11, 12, 13, 14, 15, 20]),
        writes=SlotWrites.empty(True),
        translate=translate,
        sliding_window_size=4,
        window_repair=[(4, 7), (0, 0)],  # request 0 recomputes [4, 7) for their SWA KV only
    )
    assert inp.window_repair is not None and inp.window_repair.tolist() == [[4, 0], [7, 0]]
    assert inp.swa_floor() is not None and inp.swa_floor().tolist() == [4, 0]
    # Positions 4, 5, 6 keep the cached prefix's full slots in the device table.
    assert inp.full_table_tokens().tolist() == [3, 4, 5]
    header, payload = pack_model_input(inp)
    assert payload.numel() == payload_len(header)
    back = unpack_model_input(header, payload)
    assert back.window_repair is not None and torch.equal(back.window_repair, inp.window_repair)
    plain = unpack_model_input(*pack_model_input(replace(inp, window_repair=None)))
    assert plain.window_repair is None and plain.full_table_tokens() is None
    with pytest.raises(ValueError, match="window_repair"):
        replace(inp, window_repair=torch.zeros(2, 3, dtype=torch.int64))
