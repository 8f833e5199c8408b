"""Per-batch attention metadata: what each layer kind reads, built once per batch.

For request i, with new tokens at positions `[prefix_i, seq_i)` and slot-table row `row_i`:

    # full layers read positions [0, seq_i)            full ids:  slot_table.full[row_i]
    # SWA layers read positions  [kv_start_i, seq_i)   kv_start_i = max(0, prefix_i - W,
    #                                                              swa_floor_i)
    #   two pools:   SWA ids:  slot_table.swa[row_i] (translated by rank 0), window only
    #   single pool: full ids of the same range (the window mask still applies)
    # chunked SWA layers (`attention_chunk_size` C, W = C - 1): kv_start_i = floor(prefix_i / C)·C;
    #   an extend never crosses a multiple of C (the scheduler cuts it there), so every query of
    #   it reads its own chunk and the window mask of C - 1 hides nothing inside the read range

Key j of a request's read range sits at position `kv_start_i + j`; new token r of the request at
position `prefix_i + r`.

Host and device: the plan (rows, read ranges, which requests decode) is made from the batch's
CPU lengths, O(B) host work, and copied to the device once (`pack_to_device`: 4B + 1 + 2·Bd
int64, pinned and non-blocking). Every index over keys — a request's read slots
(`KVReads.flat_slots`), the torch backend's padded decode table, a paged kernel's block table
(`KVReads.block_table`) — is gathered from the device slot table on the device. So a step's
host work and host → device bytes grow with the batch, never with the sequence lengths, and
nothing is read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from swaserve.proto.kv_rules import cdiv
from swaserve.worker.attention.base import AttentionLayer, ForwardBatch
from swaserve.worker.attention.static_decode import padded_reads, write_new_kv
from swaserve.worker.kv.kv_pool import KVPool, SWAKVPool
from swaserve.worker.runner.host_tensors import pack_to_device


class MissingSWAKV(RuntimeError):
    """A position inside an SWA window has no SWA slot (`full_to_swa == 0`): its SWA KV was freed
    while still needed. That is a bug in whoever freed it; the backend refuses to read it."""


@dataclass(frozen=True, slots=True)
class BlockTable:
    """Key-side arguments of a paged kernel (flash-attn's `block_table`) for one layer kind.

    Request i's keys are positions `[floor_b(kv_start_i), seq_i)`, b = `block_tokens`: block j
    of its table holds positions `[floor_b(kv_start_i) + j·b, ... + b)`. Entries are the blocks'
    index in the pool buffer viewed as `[rows / b, b, ...]`, less `skip_blocks`; 0 past a
    request's last block.
    """

    block_table: torch.Tensor  # [B, max_blocks] int32 (device)
    seqused_k: torch.Tensor  # [B] int32 (device): keys per request, from its first block
    cu_seqlens_k: torch.Tensor  # [B+1] int32 (device): cumsum of seqused_k (flash-attn 2.6.x)
    max_seqlen_k: int


@dataclass(frozen=True, slots=True)
class KVReads:
    """The KV rows the layers of one kind read in this batch, request by request.

    Rows index the SWA pool when `swa_pool` (SWA layers, two pools), else the full / single pool.
    The host lists are the plan; the `*_dev` tensors are the same numbers on the device.
    """

    sliding_window_size: int | None  # W of the layers that read this; None for full layers
    swa_pool: bool
    kv_start_pos: list[int]  # [B] position of each request's first key read
    kv_lens: list[int]  # [B] keys read: seq_i - kv_start_i
    kv_indptr: list[int]  # [B+1] request i's keys: flat_slots()[kv_indptr[i]:kv_indptr[i+1]]
    table: torch.Tensor  # [R, L] slot table these reads index (device)
    rows: list[int]  # [B] each request's table row
    rows_dev: torch.Tensor  # [B] int64 (device)
    starts_dev: torch.Tensor  # [B] int64 (device), kv_start_pos
    ends_dev: torch.Tensor  # [B] int64 (device), kv_start_pos + kv_lens = seq_lens
    decode_slots: torch.Tensor | None  # [Bd, Lmax] int64 one-token requests' rows, padded
    decode_bias: torch.Tensor | None  # [Bd, Lmax] float32: 0 on a key, -inf on padding

    def request_slots(self, i: int) -> torch.Tensor:  # [kv_lens[i]] int64 (device)
        start = self.kv_start_pos[i]
        return self.table[self.rows[i], start : start + self.kv_lens[i]].to(torch.int64)

    def flat_slots(self) -> torch.Tensor:  # [sum kv_lens] int64 (device)
        """Every request's read rows, concatenated in batch order, gathered on the device (the
        index is built there too: O(1) host work whatever the lengths)."""
        device, total, batch = self.table.device, self.kv_indptr[-1], len(self.rows)
        lens = self.ends_dev - self.starts_dev  # [B] int64
        req = torch.repeat_interleave(
            torch.arange(batch, device=device), lens, output_size=total
        )  # [total] int64, the request of each key
        offset = torch.arange(total, device=device) - (torch.cumsum(lens, 0) - lens)[req]
        return self.table[self.rows_dev[req], self.starts_dev[req] + offset].to(torch.int64)

    def block_table(self, block_tokens: int, *, skip_blocks: int = 0) -> BlockTable:
        """The block table of these reads for blocks of `block_tokens` (see `BlockTable`).

        A block must be contiguous in the pool: `block_tokens` must divide the page size. Block
        0 of a request is looked up at its first key (always live), the others at their first
        position. The extra leading keys `[floor_b(kv_start_i), kv_start_i)` (SWA reads only;
        full reads start at 0) lie in the first key's page, so they are live (SWA KV is freed
        in whole pages) and before every query's window: the kernel's bottom-right-aligned
        window mask hides them. A window repair's start (`swa_floor`) is page-aligned, so it is
        a block boundary and no key before it is read.
        """
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        b, device, batch = block_tokens, self.table.device, len(self.rows)
        starts = np.asarray(self.kv_start_pos, dtype=np.int64)  # [B] int64 (host)
        seqused = starts + np.asarray(self.kv_lens, dtype=np.int64) - starts // b * b  # [B]
        max_seqlen = int(seqused.max()) if batch else 0
        first = torch.div(self.starts_dev, b, rounding_mode="floor") * b  # [B] int64
        col = torch.arange(cdiv(max_seqlen, b), device=device) * b  # [max_blocks] int64
        pos = torch.maximum(first[:, None] + col[None, :], self.starts_dev[:, None])
        valid = pos < self.ends_dev[:, None]  # [B, max_blocks] bool: the block has keys
        pos = torch.where(valid, pos, self.starts_dev[:, None])  # never past a row's end
        slots = self.table[self.rows_dev[:, None], pos]  # [B, max_blocks] slot ids
        blocks = torch.div(slots, b, rounding_mode="floor") - skip_blocks
        used = (self.ends_dev - first).to(torch.int32)  # [B] int32
        return BlockTable(
            block_table=torch.where(valid, blocks, 0).to(torch.int32),
            seqused_k=used,
            cu_seqlens_k=F.pad(torch.cumsum(used, 0, dtype=torch.int32), (1, 0)),
            max_seqlen_k=max_seqlen,
        )

    def page_table(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`block_table(page_size)` as (block_table [B, max_pages] int32, seqused_k [B] int32):
        one block per pool page."""
        table = self.block_table(page_size)
        return table.block_table, table.seqused_k


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Built once per step by `build_attention_metadata`; read by every attention layer.

    Requests with one new token are "decodes" (batched together, padded); the others are
    prefill chunks (processed one request at a time).
    """

    prefix_lens: list[int]  # [B]
    seq_lens: list[int]  # [B]
    extend_starts: list[int]  # [B+1] request i's new tokens are rows [s[i], s[i+1]) of the batch
    extend_starts_dev: torch.Tensor  # [B+1] int64 (device), the same
    decode_ids: list[int]  # requests with exactly one new token, in batch order
    prefill_ids: list[int]  # the others
    decode_rows: torch.Tensor  # [Bd] int64 batch row of each decode request's token (device)
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
        write_new_kv(kv_pool, layer_id, self.out_full_loc, self.out_swa_loc, k, v)


def build_attention_metadata(
    batch: ForwardBatch,
    sliding_window_size: int | None,
    *,
    two_pools: bool,
    check_swa_reads: bool | None = None,
    decode_table: bool = True,
    attention_chunk_size: int | None = None,
) -> AttentionMetadata:
    """Turn the batch's slot-table rows into each layer kind's reads (see the module docstring).

    `sliding_window_size` is the model's W (None for a model without SWA layers); `two_pools`
    says whether SWA layers read the SWA table. `check_swa_reads` (default: on CPU, where it costs
    no device sync) raises `MissingSWAKV` when a position an SWA window needs has no SWA slot.
    `decode_table`: also gather the padded decode table (`KVReads.decode_slots`; the torch
    backend reads it, a paged kernel does not). `attention_chunk_size`: the SWA layers are
    chunked (raises ValueError for an extend that crosses a chunk boundary).
    """
    if sliding_window_size is not None and sliding_window_size < 0:
        raise ValueError(f"sliding_window_size must be >= 0, got {sliding_window_size}")
    if two_pools and sliding_window_size is None:
        raise ValueError("a two-pool KV memory serves SWA layers: pass sliding_window_size")
    table = batch.slot_table
    if two_pools and table.swa is None:
        raise ValueError("a two-pool KV memory needs a slot table with SWA ids")
    # The plan, on the host: O(B) numpy.
    prefix = batch.prefix_lens.numpy()  # [B] int64
    seq = batch.seq_lens.numpy()  # [B] int64
    rows = batch.req_rows.numpy()  # [B] int64
    extend = seq - prefix  # [B] int64
    ends = np.cumsum(extend)  # [B] int64
    decode_ids = np.flatnonzero(extend == 1)  # [Bd] int64
    swa_starts = np.zeros_like(seq)  # [B] int64
    if sliding_window_size is not None and attention_chunk_size:
        c = attention_chunk_size
        swa_starts = prefix // c * c
        crossing = np.flatnonzero((seq > prefix) & ((seq - 1) // c * c != swa_starts))
        if crossing.size:
            i = int(crossing[0])
            raise ValueError(
                f"request {i}: the extend [{prefix[i]}, {seq[i]}) crosses a multiple of the "
                f"attention chunk C={c}; chunked layers read one chunk per extend"
            )
    elif sliding_window_size is not None:
        swa_starts = np.maximum(prefix - sliding_window_size, 0)
        if batch.swa_floor is not None:  # a window repair sees nothing before its start
            swa_starts = np.maximum(swa_starts, batch.swa_floor.numpy())
    # One copy to the device.
    device = batch.out_full_loc.device
    rows_d, seq_d, swa_starts_d, extend_starts_d, decode_ids_d, decode_rows_d = pack_to_device(
        [rows, seq, swa_starts, np.concatenate(([0], ends)), decode_ids, ends[decode_ids] - 1],
        device,
    )
    zeros_d = torch.zeros_like(seq_d)  # [B] int64: full reads start at 0
    plan = _DecodePlan(decode_ids_d, decode_ids) if decode_table else None

    if batch.local_only:  # only local layers run (MTP depths): the full layers read nothing
        full = _reads(table.full, rows, rows_d, seq, seq_d, seq, seq_d, None, False, plan)
    else:
        full = _reads(
            table.full, rows, rows_d, np.zeros_like(seq), zeros_d, seq, seq_d, None, False, plan
        )
    swa = None
    if sliding_window_size is not None:
        swa_table = table.swa if two_pools and table.swa is not None else table.full
        swa = _reads(
            swa_table,
            rows,
            rows_d,
            swa_starts,
            swa_starts_d,
            seq,
            seq_d,
            sliding_window_size,
            two_pools,
            plan,
        )
        if check_swa_reads is None:
            check_swa_reads = device.type == "cpu"
        if two_pools and check_swa_reads:
            _check_swa_present(swa, table.full)
    return AttentionMetadata(
        prefix_lens=prefix.tolist(),
        seq_lens=seq.tolist(),
        extend_starts=[0, *ends.tolist()],
        extend_starts_dev=extend_starts_d,
        decode_ids=decode_ids.tolist(),
        prefill_ids=np.flatnonzero(extend != 1).tolist(),
        decode_rows=decode_rows_d,
        out_full_loc=batch.out_full_loc,
        out_swa_loc=batch.out_swa_loc if two_pools else None,
        full=full,
        swa=swa,
    )


@dataclass(frozen=True, slots=True)
class _DecodePlan:
    ids_dev: torch.Tensor  # [Bd] int64 (device): batch index of each one-token request
    ids: np.ndarray  # [Bd] int64 (host), the same


def _reads(
    table: torch.Tensor,
    rows: np.ndarray,  # [B] int64
    rows_dev: torch.Tensor,  # [B] int64 (device)
    starts: np.ndarray,  # [B] int64
    starts_dev: torch.Tensor,  # [B] int64 (device)
    seq: np.ndarray,  # [B] int64
    seq_dev: torch.Tensor,  # [B] int64 (device)
    window: int | None,
    swa_pool: bool,
    decodes: _DecodePlan | None,
) -> KVReads:
    lens = seq - starts  # [B] int64
    decode_slots = decode_bias = None
    if decodes is not None:
        decode_slots, decode_bias = _decode_table(
            table,
            rows_dev[decodes.ids_dev],
            starts_dev[decodes.ids_dev],
            seq_dev[decodes.ids_dev],
            int(lens[decodes.ids].max()) if decodes.ids.size else 0,
        )
    return KVReads(
        sliding_window_size=window,
        swa_pool=swa_pool,
        kv_start_pos=starts.tolist(),
        kv_lens=lens.tolist(),
        kv_indptr=[0, *np.cumsum(lens).tolist()],
        table=table,
        rows=rows.tolist(),
        rows_dev=rows_dev,
        starts_dev=starts_dev,
        ends_dev=seq_dev,
        decode_slots=decode_slots,
        decode_bias=decode_bias,
    )


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
    rows: torch.Tensor,  # [Bd] int64 (device)
    starts: torch.Tensor,  # [Bd] int64 (device)
    ends: torch.Tensor,  # [Bd] int64 (device)
    width: int,  # Lmax: the longest read (host)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the one-token requests as a padded [Bd, Lmax] table, gathered on the device
    (`static_decode.padded_reads`: padding repeats the newest row, masked with -inf)."""
    cols = torch.arange(width, dtype=torch.int64, device=table.device)  # [Lmax] int64
    reads = padded_reads(table, rows, starts, ends, cols)
    return reads.slots, reads.bias
