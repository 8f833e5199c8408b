"""Per-batch attention metadata: what each layer kind reads, built once per batch.

For request i, with new tokens at positions `[prefix_i, seq_i)` and slot-table row `row_i`:

    # full layers read positions [0, seq_i)            full ids:  slot_table.full[row_i]
    # SWA layers read positions  [kv_start_i, seq_i)   kv_start_i = max(0, prefix_i - W,
    #                                                              swa_floor_i)
    #   two pools:   SWA ids:  slot_table.swa[row_i] (translated by rank 0), window only
    #   single pool: full ids of the same range (the window mask still applies)

Key j of a request's read range sits at position `kv_start_i + j`; new token r of the request at
position `prefix_i + r`. Everything is planned from host ints (the batch's CPU lengths) and
gathered on the device, so building it never reads a device value back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.proto.kv_rules import cdiv
from swaserve.worker.attention.base import AttentionLayer, ForwardBatch
from swaserve.worker.host_tensors import int_tensor
from swaserve.worker.kv.kv_pool import KVPool, SWAKVPool


class MissingSWAKV(RuntimeError):
    """A position inside an SWA window has no SWA slot (`full_to_swa == 0`): its SWA KV was freed
    while still needed. That is a bug in whoever freed it; the backend refuses to read it."""


@dataclass(frozen=True, slots=True)
class KVReads:
    """The KV rows the layers of one kind read in this batch, request by request.

    Rows index the SWA pool when `swa_pool` (SWA layers, two pools), else the full / single pool.
    """

    sliding_window_size: int | None  # W of the layers that read this; None for full layers
    swa_pool: bool
    kv_start_pos: list[int]  # [B] position of each request's first key read
    kv_lens: list[int]  # [B] keys read: seq_i - kv_start_i
    kv_indptr: list[
        int
    ]  # [B+1] request i's keys are rows kv_indptr[i]:kv_indptr[i+1] of flat_slots()
    table: torch.Tensor  # [R, L] slot table these reads index (device)
    rows: list[int]  # [B] each request's table row
    decode_slots: (
        torch.Tensor
    )  # [Bd, Lmax] int64 rows of one-token requests, padded (_decode_table)
    decode_bias: torch.Tensor  # [Bd, Lmax] float32: 0 on a key, -inf on padding

    def request_slots(self, i: int) -> torch.Tensor:
        start = self.kv_start_pos[i]
        return self.table[self.rows[i], start : start + self.kv_lens[i]].to(torch.int64)

    def flat_slots(self) -> torch.Tensor:  # [sum kv_lens] int64 (device)
        """Every request's read rows, concatenated in batch order (gathered on the device)."""
        return _gather_ranges(self.table, self.rows, self.kv_start_pos, self.kv_lens)

    def page_table(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block table and key counts for paged kernels (flash-attn's `block_table`).

        Request i's table starts at the page holding its first key, so it covers positions
        `[floor_P(kv_start_i), seq_i)`. The extra leading keys (SWA reads only; full reads start
        at 0) are live — SWA KV is freed in whole pages — and lie before every query's window,
        so the kernel's bottom-right-aligned window mask hides them. Returns `block_table`
        [B, max_pages] int32 (padded with page 0) and `seqused_k` [B] int32 = seq_i -
        floor_P(kv_start_i).
        """
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        device = self.table.device
        first = [s // page_size * page_size for s in self.kv_start_pos]  # [B] page-floored start
        seqused = [
            s - f + n for s, f, n in zip(self.kv_start_pos, first, self.kv_lens, strict=True)
        ]
        num_pages = [cdiv(u, page_size) for u in seqused]
        max_pages = max(num_pages, default=0)
        b = len(first)
        page = torch.arange(max_pages, device=device)  # [max_pages] int64
        first_t = torch.tensor(first, dtype=torch.int64).to(device)  # [B] int64
        pages_t = torch.tensor(num_pages, dtype=torch.int64).to(device)  # [B] int64
        rows_t = torch.tensor(self.rows, dtype=torch.int64).to(device)  # [B] int64
        valid = page[None, :] < pages_t[:, None]  # [B, max_pages] bool
        pos = torch.where(valid, first_t[:, None] + page[None, :] * page_size, 0)  # [B, max_pages]
        if b and max_pages:
            slots = self.table[rows_t[:, None].expand(b, max_pages), pos].to(torch.int64)
            table = torch.where(valid, torch.div(slots, page_size, rounding_mode="floor"), 0)
        else:
            table = torch.zeros(b, max_pages, dtype=torch.int64, device=device)
        seqused_t = torch.tensor(seqused, dtype=torch.int32).to(device)  # [B] int32
        return table.to(torch.int32), seqused_t


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Built once per step by `build_attention_metadata`; read by every attention layer.

    Requests with one new token are "decodes" (batched together, padded); the others are
    prefill chunks (processed one request at a time).
    """

    prefix_lens: list[int]  # [B]
    seq_lens: list[int]  # [B]
    extend_starts: list[int]  # [B+1] request i's new tokens are rows [s[i], s[i+1]) of the batch
    decode_ids: list[int]  # requests with exactly one new token, in batch order
    prefill_ids: list[int]  # the others
    decode_rows: torch.Tensor  # [Bd] int64 batch row of each decode request's token
    out_full_loc: torch.Tensor  # [T] int64 full slots of the new tokens
    out_swa_loc: torch.Tensor | None  # [T] int64 their SWA slots (two pools only)
    full: KVReads
    swa: KVReads | None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    def reads(self, layer: AttentionLayer) -> KVReads:
        """What `layer` reads; raises if the layer's kind or window does not match the batch."""
        if not layer.is_swa:
            return self.full
        if self.swa is None or self.swa.sliding_window_size != layer.sliding_window_size:
            have = None if self.swa is None else self.swa.sliding_window_size
            raise ValueError(
                f"layer {layer.layer_id} has sliding_window_size={layer.sliding_window_size}, but "
                f"the backend was built for W={have}; pass the model's W to the backend"
            )
        return self.swa

    def write_kv(
        self, kv_pool: SWAKVPool | KVPool, layer_id: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store the new tokens' K/V of one layer: full slots for full layers and for every layer
        of a single pool, the batch's translated SWA slots for SWA layers of two pools."""
        if isinstance(kv_pool, SWAKVPool):
            if self.out_swa_loc is None:
                raise ValueError("a two-pool KV memory needs the batch's SWA slots (out_swa_loc)")
            kv_pool.set_kv_buffer(layer_id, self.out_full_loc, self.out_swa_loc, k, v)
        else:
            kv_pool.set_kv_buffer(layer_id, self.out_full_loc, k, v)


def build_attention_metadata(
    batch: ForwardBatch,
    sliding_window_size: int | None,
    *,
    two_pools: bool,
    check_swa_reads: bool | None = None,
) -> AttentionMetadata:
    """Turn the batch's slot-table rows into each layer kind's reads (see the module docstring).

    `sliding_window_size` is the model's W (None for a model without SWA layers); `two_pools`
    says whether SWA layers read the SWA table. `check_swa_reads` (default: on CPU, where it costs
    no device sync) raises `MissingSWAKV` when a position an SWA window needs has no SWA slot.
    """
    if sliding_window_size is not None and sliding_window_size < 0:
        raise ValueError(f"sliding_window_size must be >= 0, got {sliding_window_size}")
    if two_pools and sliding_window_size is None:
        raise ValueError("a two-pool KV memory serves SWA layers: pass sliding_window_size")
    table = batch.slot_table
    if two_pools and table.swa is None:
        raise ValueError("a two-pool KV memory needs a slot table with SWA ids")
    prefix_t, seq_t, rows_t = batch.prefix_lens, batch.seq_lens, batch.req_rows  # [B] int64 CPU
    extend_t = seq_t - prefix_t  # [B] int64
    is_decode = extend_t == 1  # [B] bool
    decode_t = torch.nonzero(is_decode).flatten()  # [Bd] int64
    prefix, seq = prefix_t.tolist(), seq_t.tolist()
    extend_starts = [0, *torch.cumsum(extend_t, 0).tolist()]
    decode_ids = decode_t.tolist()
    prefill_ids = torch.nonzero(~is_decode).flatten().tolist()
    device = batch.out_full_loc.device
    decode_rows = (torch.cumsum(extend_t, 0) - 1)[decode_t].to(device)  # [Bd] int64

    full = _reads(table.full, rows_t, torch.zeros_like(seq_t), seq_t, decode_t, None, False)
    swa = None
    if sliding_window_size is not None:
        starts_t = (prefix_t - sliding_window_size).clamp(min=0)  # [B] int64
        if batch.swa_floor is not None:  # a window repair sees nothing before its start
            starts_t = torch.maximum(starts_t, batch.swa_floor)
        swa_table = table.swa if two_pools and table.swa is not None else table.full
        swa = _reads(swa_table, rows_t, starts_t, seq_t, decode_t, sliding_window_size, two_pools)
        if check_swa_reads is None:
            check_swa_reads = device.type == "cpu"
        if two_pools and check_swa_reads:
            _check_swa_present(swa, table.full)
    return AttentionMetadata(
        prefix_lens=prefix,
        seq_lens=seq,
        extend_starts=extend_starts,
        decode_ids=decode_ids,
        prefill_ids=prefill_ids,
        decode_rows=decode_rows,
        out_full_loc=batch.out_full_loc,
        out_swa_loc=batch.out_swa_loc if two_pools else None,
        full=full,
        swa=swa,
    )


def _reads(
    table: torch.Tensor,
    rows: torch.Tensor,  # [B] int64 CPU
    starts: torch.Tensor,  # [B] int64 CPU
    seq: torch.Tensor,  # [B] int64 CPU
    decode_ids: torch.Tensor,  # [Bd] int64 CPU
    window: int | None,
    swa_pool: bool,
) -> KVReads:
    lens = seq - starts  # [B] int64
    decode_slots, decode_bias = _decode_table(
        table, rows[decode_ids], starts[decode_ids], lens[decode_ids]
    )
    return KVReads(
        window,
        swa_pool,
        starts.tolist(),
        lens.tolist(),
        [0, *torch.cumsum(lens, 0).tolist()],
        table,
        rows.tolist(),
        decode_slots,
        decode_bias,
    )


def _gather_ranges(
    table: torch.Tensor, rows: list[int], starts: list[int], lens: list[int]
) -> torch.Tensor:  # [sum lens] int64 (device)
    """`cat(table[rows[i], starts[i]:starts[i] + lens[i]])`, as one gather on the device."""
    device = table.device
    total = sum(lens)
    if total == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    meta = int_tensor([rows, starts, lens])  # [3, B] int64
    rows_t, starts_t, lens_t = meta[0], meta[1], meta[2]
    base = starts_t - (torch.cumsum(lens_t, 0) - lens_t)  # [B] key j of req i: base_i + flat j
    req = torch.repeat_interleave(torch.arange(len(lens)), lens_t, output_size=total)  # [total]
    pos = (base[req] + torch.arange(total)).to(device)  # [total] int64
    return table[rows_t[req].to(device), pos].to(torch.int64)


def _check_swa_present(reads: KVReads, full_table: torch.Tensor) -> None:
    swa_slots = reads.flat_slots()
    missing = swa_slots <= 0
    if not bool(missing.any()):
        return
    j = int(torch.nonzero(missing)[0])
    indptr, starts = reads.kv_indptr, reads.kv_start_pos
    i = next(r for r in range(len(starts)) if j < indptr[r + 1])
    pos = starts[i] + j - indptr[i]
    end = starts[i] + indptr[i + 1] - indptr[i]
    full_slot = int(full_table[reads.rows[i], pos])
    raise MissingSWAKV(
        f"request {i}: the SWA window [{starts[i]}, {end}) (W={reads.sliding_window_size}) needs "
        f"position {pos} (full slot {full_slot}), whose SWA KV was already freed (full_to_swa = 0)"
    )


def _decode_table(
    table: torch.Tensor,
    rows: torch.Tensor,  # [Bd] int64 CPU
    starts: torch.Tensor,  # [Bd] int64 CPU
    lens: torch.Tensor,  # [Bd] int64 CPU
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the one-token requests as a padded [Bd, Lmax] table, gathered on the device.

    Padding repeats the request's newest row (the token just written, always live), so a padded
    read never touches a freed or garbage row; its score is masked by the -inf bias.
    """
    device = table.device
    if rows.numel() == 0:
        return (
            torch.zeros(0, 0, dtype=torch.int64, device=device),  # [0, 0] int64
            torch.zeros(0, 0, dtype=torch.float32, device=device),  # [0, 0] float32
        )
    width = int(lens.max())  # host: the lengths are CPU tensors
    # Build the [Bd, Lmax] indices on the device from [Bd] copies (O(batch) traffic).
    row, first, n = (x.to(device) for x in (rows, starts, lens))
    col = torch.arange(width, dtype=torch.int64, device=device)  # [Lmax] int64
    pos = first[:, None] + torch.minimum(col[None, :], n[:, None] - 1)  # [Bd, Lmax] int64
    slots = table[row[:, None].expand_as(pos), pos].to(torch.int64)  # [Bd, Lmax] int64
    bias = torch.zeros(pos.shape, dtype=torch.float32, device=device)  # [Bd, Lmax] float32
    bias.masked_fill_(col[None, :] >= n[:, None], float("-inf"))
    return slots, bias
