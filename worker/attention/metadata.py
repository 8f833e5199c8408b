"""Per-batch attention metadata: what each layer kind reads, translated once per batch.

For request i, with new tokens at positions `[prefix_i, seq_i)`:

    # full layers read positions [0, seq_i)            full slot ids (full pool)
    # SWA layers read positions  [kv_start_i, seq_i)   kv_start_i = max(0, prefix_i - W)
    #   two pools:   SWA slot ids = translate(full slot ids), once per batch, window only
    #   single pool: full slot ids of the same range (the window mask still applies)

Key j of a request's read range sits at position `kv_start_i + j`; new token r of the request at
position `prefix_i + r`. Everything here is built once per step and shared by all layers of a kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.worker.attention.base import AttentionLayer, ForwardBatch
from swaserve.worker.kv.allocator import SWATokenAllocator
from swaserve.worker.kv.kv_pool import KVPool, SWAKVPool
from swaserve.worker.kv.memory import KVMemory


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
    kv_indptr: list[int]  # [B+1] request i's rows are kv_slots[kv_indptr[i]:kv_indptr[i+1]]
    kv_slots: torch.Tensor  # [sum kv_lens] int64 pool rows
    decode_slots: (
        torch.Tensor
    )  # [Bd, Lmax] int64 rows of one-token requests, padded (_decode_table)
    decode_bias: torch.Tensor  # [Bd, Lmax] float32: 0 on a key, -inf on padding

    def request_slots(self, i: int) -> torch.Tensor:
        return self.kv_slots[self.kv_indptr[i] : self.kv_indptr[i + 1]]  # [kv_lens[i]] int64

    def page_table(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block table and key counts for paged kernels (flash-attn's `block_table`).

        Request i's table starts at the page holding its first key, so it covers positions
        `[floor_P(kv_start_i), seq_i)`. The extra leading keys (SWA reads only; full reads start
        at 0) are live — SWA KV is freed in whole pages — and lie before every query's window,
        so the kernel's bottom-right-aligned window mask hides them. Returns `block_table` [B, max_pages] int32
        (padded with page 0) and `seqused_k` [B] int32 = seq_i - floor_P(kv_start_i).
        """
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        device = self.kv_slots.device
        starts = torch.tensor(self.kv_start_pos, dtype=torch.int64)  # [B] int64
        lens = torch.tensor(self.kv_lens, dtype=torch.int64)  # [B] int64
        indptr = torch.tensor(self.kv_indptr[:-1], dtype=torch.int64)  # [B] int64
        lead = starts % page_size  # keys of the first page before kv_start
        seqused = lead + lens  # [B] int64
        num_pages = -(-seqused // page_size)  # [B] int64
        max_pages = int(num_pages.max()) if num_pages.numel() else 0
        page = torch.arange(max_pages, dtype=torch.int64)  # [max_pages] int64
        # Key offset (in the read range) of the first key of page k: page k starts at position
        # floor_P(kv_start) + k P, i.e. offset k P - lead; page 0 is found through its first key.
        offset = (page[None, :] * page_size - lead[:, None]).clamp(min=0)  # [B, max_pages]
        valid = page[None, :] < num_pages[:, None]  # [B, max_pages] bool
        rows = torch.where(valid, indptr[:, None] + offset, 0).to(device)  # [B, max_pages] int64
        if self.kv_slots.numel():
            table = torch.div(self.kv_slots[rows], page_size, rounding_mode="floor")
            table = torch.where(valid.to(device), table, 0)
        else:
            table = torch.zeros(rows.shape, dtype=torch.int64, device=device)
        return table.to(torch.int32), seqused.to(device=device, dtype=torch.int32)


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
            kv_pool.set_kv_buffer(layer_id, self.out_full_loc, self.out_swa_loc, k, v)
        else:
            kv_pool.set_kv_buffer(layer_id, self.out_full_loc, k, v)


def build_attention_metadata(
    batch: ForwardBatch, memory: KVMemory, sliding_window_size: int | None
) -> AttentionMetadata:
    """Turn the batch's full slot ids into each layer kind's reads (see the module docstring).

    `sliding_window_size` is the model's W (None for a model without SWA layers). Raises
    `MissingSWAKV` when a position an SWA window needs has no SWA slot, and `ValueError` for a
    batch that does not fit the memory (slot lists shorter than seq_lens, W missing).
    """
    if sliding_window_size is not None and sliding_window_size < 0:
        raise ValueError(f"sliding_window_size must be >= 0, got {sliding_window_size}")
    if memory.hybrid and sliding_window_size is None:
        raise ValueError("a two-pool KV memory serves SWA layers: pass sliding_window_size")
    prefix = [int(x) for x in batch.prefix_lens.tolist()]
    seq = [int(x) for x in batch.seq_lens.tolist()]
    slots = batch.req_token_slots
    for i, (s, req) in enumerate(zip(seq, slots, strict=True)):
        if req.numel() < s:
            raise ValueError(
                f"request {i}: req_token_slots holds {req.numel()} slots, fewer than seq_len={s}"
            )
    extend_starts = [0]
    for p, s in zip(prefix, seq, strict=True):
        extend_starts.append(extend_starts[-1] + s - p)
    decode_ids = [i for i in range(len(seq)) if seq[i] - prefix[i] == 1]
    prefill_ids = [i for i in range(len(seq)) if seq[i] - prefix[i] > 1]
    device = batch.out_full_loc.device
    decode_rows = torch.tensor(
        [extend_starts[i] for i in decode_ids], dtype=torch.int64, device=device
    )  # [Bd] int64

    full = _reads(slots, [0] * len(seq), seq, decode_ids, None, None, device)
    swa = None
    out_swa_loc = None
    if sliding_window_size is not None:
        starts = [max(0, p - sliding_window_size) for p in prefix]
        allocator = memory.allocator if isinstance(memory.allocator, SWATokenAllocator) else None
        swa = _reads(slots, starts, seq, decode_ids, sliding_window_size, allocator, device)
        if allocator is not None:
            out_swa_loc = allocator.translate(batch.out_full_loc).to(device)  # [T] int64
    return AttentionMetadata(
        prefix_lens=prefix,
        seq_lens=seq,
        extend_starts=extend_starts,
        decode_ids=decode_ids,
        prefill_ids=prefill_ids,
        decode_rows=decode_rows,
        out_full_loc=batch.out_full_loc,
        out_swa_loc=out_swa_loc,
        full=full,
        swa=swa,
    )


def _reads(
    slots: list[torch.Tensor],
    starts: list[int],
    seq: list[int],
    decode_ids: list[int],
    window: int | None,
    allocator: SWATokenAllocator | None,
    device: torch.device,
) -> KVReads:
    """Rows of positions `[starts[i], seq[i))` of each request; translated to SWA slots (and
    checked for freed SWA KV) when `allocator` is given."""
    lens = [s - a for a, s in zip(starts, seq, strict=True)]
    indptr = [0]
    for n in lens:
        indptr.append(indptr[-1] + n)
    parts = [req[a:s] for req, a, s in zip(slots, starts, seq, strict=True)]
    kv_slots = (
        torch.cat(parts).to(device=device, dtype=torch.int64)
        if parts
        else torch.empty(0, dtype=torch.int64, device=device)
    )  # [sum lens] int64
    if allocator is not None:
        full_slots = kv_slots
        kv_slots = allocator.translate(full_slots).to(device)  # [sum lens] int64
        _check_swa_present(kv_slots, full_slots, starts, indptr, window)
    decode_slots, decode_bias = _decode_table(kv_slots, indptr, lens, decode_ids)
    return KVReads(
        window, allocator is not None, starts, lens, indptr, kv_slots, decode_slots, decode_bias
    )


def _check_swa_present(
    swa_slots: torch.Tensor,
    full_slots: torch.Tensor,
    starts: list[int],
    indptr: list[int],
    window: int | None,
) -> None:
    missing = swa_slots <= 0
    if not bool(missing.any()):
        return
    j = int(torch.nonzero(missing)[0])
    i = next(r for r in range(len(starts)) if j < indptr[r + 1])
    pos = starts[i] + j - indptr[i]
    end = starts[i] + indptr[i + 1] - indptr[i]
    raise MissingSWAKV(
        f"request {i}: the SWA window [{starts[i]}, {end}) (W={window}) needs position {pos} "
        f"(full slot {int(full_slots[j])}), whose SWA KV was already freed (full_to_swa = 0)"
    )


def _decode_table(
    kv_slots: torch.Tensor, indptr: list[int], lens: list[int], decode_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the one-token requests as a padded [Bd, Lmax] table.

    Padding repeats the request's newest row (the token just written, always live), so a padded
    read never touches a freed or garbage row; its score is masked by the -inf bias.
    """
    device = kv_slots.device
    if not decode_ids:
        return (
            torch.zeros(0, 0, dtype=torch.int64, device=device),  # [0, 0] int64
            torch.zeros(0, 0, dtype=torch.float32, device=device),  # [0, 0] float32
        )
    n = torch.tensor([lens[i] for i in decode_ids], dtype=torch.int64)  # [Bd] int64
    first = torch.tensor([indptr[i] for i in decode_ids], dtype=torch.int64)  # [Bd] int64
    col = torch.arange(int(n.max()), dtype=torch.int64)  # [Lmax] int64
    rows = first[:, None] + torch.minimum(col[None, :], n[:, None] - 1)  # [Bd, Lmax] int64
    bias = torch.zeros(rows.shape, dtype=torch.float32)  # [Bd, Lmax] float32
    bias.masked_fill_(col[None, :] >= n[:, None], float("-inf"))
    return kv_slots[rows.to(device)], bias.to(device)
