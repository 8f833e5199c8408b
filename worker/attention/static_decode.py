"""The metadata of a pure-decode step of fixed shapes: what a compiled or captured decode step
(`worker/decode_step.py`) hands the attention layers instead of `AttentionMetadata`.

Every tensor has a shape fixed by the step's bucket — Bp requests (the batch padded up), Lf
columns for the full layers' keys, W + 1 for the SWA layers' — and every value is computed on the
device from the device slot table: no host list, no host read, so that `torch.compile` traces it
into one graph and a CUDA graph replays it over new inputs.

For decode row b (its new token at position p_b, slot-table row r_b):

    # full layers read positions [0, p_b]              slot_table.full[r_b], padded to Lf
    # SWA layers read positions  [max(0, p_b - W), p_b] the SWA (or single-pool) row, W + 1 wide
    #   (chunked layers, W = C - 1: [floor(p_b / C)·C, p_b], C wide)

A padded column repeats the row's newest position (the token just written, always live) and is
masked with -inf; a padded request (b >= B) reads row 0 at position 0 and writes its K/V into the
padding slot 0 of each pool, which no request reads. Its logits are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.worker.attention.base import AttentionLayer
from swaserve.worker.kv.kv_pool import KVPool, SWAKVPool


@dataclass(frozen=True, slots=True)
class DecodeReads:
    """The keys one layer kind reads: a [Bp, L] table of pool rows and its additive mask."""

    slots: torch.Tensor  # [Bp, L] int64 pool rows
    bias: torch.Tensor  # [Bp, L] float32: 0 on a key, -inf on padding


@dataclass(frozen=True, slots=True)
class DecodeMetadata:
    """One decode token per row; see the module docstring."""

    out_full_loc: torch.Tensor  # [Bp] int64 full slot of each new token (0 on padded rows)
    out_swa_loc: torch.Tensor | None  # [Bp] int64 its SWA slot (two pools), else None
    full: DecodeReads
    swa: DecodeReads | None
    sliding_window_size: int | None
    positions: torch.Tensor  # [Bp] int64 the new token's position (0 on padded rows)
    attention_chunk_size: int | None = None  # chunked SWA layers: reads start at the chunk

    def reads(self, layer: AttentionLayer) -> DecodeReads:
        if not layer.is_swa:
            return self.full
        if self.swa is None or self.sliding_window_size != layer.sliding_window_size:
            raise ValueError(
                f"layer {layer.layer_id} has sliding_window_size={layer.sliding_window_size}; "
                f"the decode step was built for W={self.sliding_window_size}"
            )
        return self.swa

    def write_kv(
        self, kv_pool: SWAKVPool | KVPool, layer_id: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        write_new_kv(kv_pool, layer_id, self.out_full_loc, self.out_swa_loc, k, v)


def write_new_kv(
    kv_pool: SWAKVPool | KVPool,
    layer_id: int,
    out_full_loc: torch.Tensor,  # [T] int64
    out_swa_loc: torch.Tensor | None,  # [T] int64 (two pools)
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store the new tokens' K/V of one layer: full slots for full layers and for every layer
    of a single pool, the step's translated SWA slots for SWA layers of two pools."""
    if isinstance(kv_pool, SWAKVPool):
        if out_swa_loc is None:
            raise ValueError("a two-pool KV memory needs the batch's SWA slots (out_swa_loc)")
        kv_pool.set_kv_buffer(layer_id, out_full_loc, out_swa_loc, k, v)
    else:
        kv_pool.set_kv_buffer(layer_id, out_full_loc, k, v)


@dataclass(slots=True)
class DecodeBatch:
    """What `HybridCausalLM.forward` reads of a batch, for a pure-decode step of fixed shape:
    one token per row, logits of every row (a padded row's are dropped by the caller)."""

    input_ids: torch.Tensor  # [Bp] int64
    positions: torch.Tensor  # [Bp] int64
    attn_metadata: DecodeMetadata

    def logits_indices(self) -> None:
        return None


def padded_reads(
    table: torch.Tensor,  # [R, L] slot table (int32 on CUDA, int64 on CPU)
    rows: torch.Tensor,  # [Bp] int64
    starts: torch.Tensor,  # [Bp] int64 first position read
    ends: torch.Tensor,  # [Bp] int64 one past the last (the new token's position + 1)
    cols: torch.Tensor,  # [Lp] int64 0 .. Lp - 1: the read's width
) -> DecodeReads:
    """Positions [starts_b, ends_b) of row rows_b as a [Bp, Lp] table of pool rows, padded with
    the newest position and masked (see the module docstring). Device ops only."""
    n = ends - starts  # [Bp] int64, >= 1
    pos = starts[:, None] + torch.minimum(cols[None, :], n[:, None] - 1)  # [Bp, Lp] int64
    slots = table[rows[:, None].expand_as(pos), pos].to(torch.int64)  # [Bp, Lp] int64
    bias = torch.zeros(pos.shape, dtype=torch.float32, device=table.device)
    bias = bias.masked_fill(cols[None, :] >= n[:, None], float("-inf"))  # [Bp, Lp] float32
    return DecodeReads(slots, bias)


def decode_metadata(
    *,
    full_table: torch.Tensor,  # [R, L]
    swa_table: torch.Tensor | None,  # [R, L] SWA ids (two pools), the full table (one pool), or
    # None (no SWA layers)
    rows: torch.Tensor,  # [Bp] int64
    positions: torch.Tensor,  # [Bp] int64 the new token's position
    out_full_loc: torch.Tensor,  # [Bp] int64
    out_swa_loc: torch.Tensor | None,  # [Bp] int64 (two pools)
    full_cols: torch.Tensor,  # [Lf] int64, Lf >= every positions_b + 1
    sliding_window_size: int | None,
    attention_chunk_size: int | None = None,
) -> DecodeMetadata:
    """The step's metadata from its fixed-shape inputs, on the device (see the module docstring)."""
    ends = positions + 1  # [Bp] int64
    full = padded_reads(full_table, rows, torch.zeros_like(positions), ends, full_cols)
    swa = None
    if sliding_window_size is not None:
        assert swa_table is not None
        window = sliding_window_size
        if attention_chunk_size:
            starts = torch.div(positions, attention_chunk_size, rounding_mode="floor")
            starts = starts * attention_chunk_size  # [Bp] int64
        else:
            starts = torch.clamp(positions - window, min=0)  # [Bp] int64
        cols = torch.arange(window + 1, dtype=torch.int64, device=full_cols.device)  # [W + 1]
        swa = padded_reads(swa_table, rows, starts, ends, cols)
    return DecodeMetadata(
        out_full_loc,
        out_swa_loc,
        full,
        swa,
        sliding_window_size,
        positions,
        attention_chunk_size if swa is not None else None,
    )
