"""The attention-backend interface between the model code and the KV memory.

Per model step the runner builds one `ForwardBatch` on the model's device from the step's
`ModelInput` (which tokens are new, where their KV goes, which slot-table row each request reads).
The backend's `init_forward_metadata(batch)` turns the rows into what each layer kind reads —
full ids for full layers, SWA ids (translated once per batch on rank 0) cut to the window for SWA
layers — and stores it on `batch.attn_metadata`. Each attention layer then calls
`backend.forward(q, k, v, layer, batch)`, which writes the new K/V into the pool and returns the
attention output. Nothing is global: the batch is passed down.

Shapes: T = new tokens in the batch, B = requests, H = query heads (this TP shard), Hkv = KV
heads, Dk / Dv = K / V head dims.

Window convention (architecture §2): a query at position p of an SWA layer with window W sees key
positions `[p - W, p]` (W tokens before it and itself); a full layer sees `[0, p]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from swaserve.worker.kv.slot_table import DeviceSlotTable
from swaserve.worker.runner.host_tensors import to_device


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """What a backend needs to know about one attention layer (static per model)."""

    layer_id: int  # global layer index, as in the KV pool's layers_mapping
    num_heads: int  # query heads on this TP shard
    num_kv_heads: int  # KV heads on this TP shard
    head_dim: int  # Dk (q and k)
    v_head_dim: int  # Dv
    scaling: float  # softmax scale, usually Dk ** -0.5
    sliding_window_size: int | None = None  # W for SWA layers, None for full layers
    # C of a chunked local layer (then W = C - 1): a query at p sees [floor(p / C)·C, p]
    attention_chunk_size: int | None = None
    # A KV-shared layer (Gemma 4) writes no KV and reads this earlier layer's (same kind)
    kv_layer_id: int | None = None

    @property
    def is_swa(self) -> bool:
        return self.sliding_window_size is not None

    @property
    def kv_source(self) -> int:
        """The layer whose KV buffers this layer reads."""
        return self.layer_id if self.kv_layer_id is None else self.kv_layer_id

    @property
    def writes_kv(self) -> bool:
        return self.kv_layer_id is None


class SlotTranslator(Protocol):
    def translate(self, full_idx: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class ForwardBatch:
    """One model step over B requests; prefill chunks and decodes may be mixed in any order.

    Request i contributes tokens at positions `[prefix_lens[i], seq_lens[i])`; its KV for
    positions `[0, prefix_lens[i])` is already in the pool (a cached prefix or earlier chunks).
    Row `req_rows[i]` of `slot_table` holds the slot of every position `[0, seq_lens[i])`, new
    tokens included; SWA ids of positions before `prefix_lens[i] - W` may be stale and are never
    read. `swa_floor[i]` (a window repair's start) cuts request i's SWA reads further: its SWA
    layers see no key before that position. Host tensors (`prefix_lens`, `seq_lens`, `req_rows`) are what the metadata build plans
    with, so it never reads a device value back.
    """

    input_ids: torch.Tensor  # [T] int64 (device), new tokens of all requests, request by request
    positions: torch.Tensor  # [T] int64 (device), absolute positions of those tokens
    prefix_lens: torch.Tensor  # [B] int64 (CPU)
    seq_lens: torch.Tensor  # [B] int64 (CPU)
    req_rows: torch.Tensor  # [B] int64 (CPU), each request's row of `slot_table`
    slot_table: DeviceSlotTable
    out_full_loc: torch.Tensor  # [T] int64 (device), full slot ids of the new tokens
    out_swa_loc: torch.Tensor | None = None  # [T] int64 (device), their SWA ids (two pools)
    logits_positions: str = "last"  # "last": one row per request; "all": one row per new token
    logits_rows: torch.Tensor | None = (
        None  # [N] int64 (device): explicit rows; overrides the above
    )
    swa_floor: torch.Tensor | None = None  # [B] int64 (CPU): SWA layers read no key before it
    # Only local (SWA) layers run over it (an MTP depth's forward): full layers read nothing
    local_only: bool = False
    attn_metadata: Any = field(default=None)  # set by AttentionBackend.init_forward_metadata

    def __post_init__(self) -> None:
        batch = self.prefix_lens.numel()
        if self.seq_lens.numel() != batch or self.req_rows.numel() != batch:
            raise ValueError("prefix_lens, seq_lens and req_rows must have one entry per request")
        extend = self.seq_lens - self.prefix_lens
        if batch and int(extend.min()) < 1:
            raise ValueError("every request in a batch must add at least one token")
        if batch and int(self.seq_lens.max()) > self.slot_table.max_len:
            raise ValueError(
                f"a request has {int(self.seq_lens.max())} positions; the slot table holds "
                f"{self.slot_table.max_len}"
            )
        total = int(extend.sum())
        if (
            self.input_ids.numel() != total
            or self.positions.numel() != total
            or self.out_full_loc.numel() != total
        ):
            raise ValueError(
                f"input_ids / positions / out_full_loc must hold sum(seq_lens - prefix_lens) = {total} tokens"
            )
        if self.logits_positions not in ("last", "all"):
            raise ValueError(
                f"logits_positions must be 'last' or 'all', got {self.logits_positions!r}"
            )

    @classmethod
    def from_slots(
        cls,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        req_token_slots: list[torch.Tensor],
        out_full_loc: torch.Tensor,
        allocator: SlotTranslator | None = None,
        logits_positions: str = "last",
    ) -> ForwardBatch:
        """A batch over a fresh slot table made from each request's full slot list (B × [>=
        seq_lens[i]] int64): for tests and benchmarks that drive a model without an engine.
        `allocator` translates full → SWA ids (two pools); None for one pool."""
        device = out_full_loc.device
        seq = [int(s) for s in seq_lens]
        if len(req_token_slots) != len(seq):
            raise ValueError("req_token_slots must have one entry per request")
        for i, (s, slots) in enumerate(zip(seq, req_token_slots, strict=True)):
            if slots.numel() < s:
                raise ValueError(
                    f"request {i}: req_token_slots holds {slots.numel()} slots, fewer than "
                    f"seq_len={s}"
                )
        table = DeviceSlotTable(
            max(1, len(seq)), max([1, *seq]), with_swa=allocator is not None, device=device
        )
        for row, (s, slots) in enumerate(zip(seq, req_token_slots, strict=True)):
            full = slots[:s].to(torch.int64).cpu()  # [s] int64
            table.full[row, :s] = to_device(full, device).to(table.dtype)
            if table.swa is not None and allocator is not None:
                swa = allocator.translate(full)  # [s] int64
                table.swa[row, :s] = to_device(swa, device).to(table.dtype)
        out_swa = (
            to_device(allocator.translate(out_full_loc.cpu()), device)
            if allocator is not None
            else None
        )
        return cls(
            input_ids=input_ids,
            positions=positions,
            prefix_lens=torch.as_tensor(prefix_lens, dtype=torch.int64).cpu(),
            seq_lens=torch.as_tensor(seq_lens, dtype=torch.int64).cpu(),
            req_rows=torch.arange(len(seq), dtype=torch.int64),
            slot_table=table,
            out_full_loc=out_full_loc,
            out_swa_loc=out_swa,
            logits_positions=logits_positions,
        )

    @property
    def batch_size(self) -> int:
        return self.prefix_lens.numel()

    @property
    def extend_lens(self) -> torch.Tensor:
        return self.seq_lens - self.prefix_lens  # [B] int64 (CPU)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def request_slots(self, i: int) -> torch.Tensor:
        """Full slot ids of request i's positions `[0, seq_lens[i])` ([seq_i] int64, device)."""
        row, seq = int(self.req_rows[i]), int(self.seq_lens[i])
        return self.slot_table.full[row, :seq].to(torch.int64)

    def logits_indices(self) -> torch.Tensor:
        """Rows of the [T, hidden] output that produce logits (device)."""
        if self.logits_rows is not None:
            return self.logits_rows
        if self.logits_positions == "all":
            return torch.arange(self.num_tokens, device=self.input_ids.device)
        last = torch.cumsum(self.extend_lens, 0) - 1  # [B] int64 (CPU)
        return to_device(last, self.input_ids.device)


class AttentionBackend(ABC):
    """Reads and writes KV through the worker's pools. One instance per model runner."""

    name: str = "base"

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build the per-batch metadata (once per step, before the model runs) and store it on
        `batch.attn_metadata`: translated SWA output locations and each layer kind's reads."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, Dk]
        k: torch.Tensor,  # [T, Hkv, Dk]
        v: torch.Tensor,  # [T, Hkv, Dv]
        layer: AttentionLayer,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,  # [H] float32 per-head sink logits, or None
    ) -> torch.Tensor:  # [T, H, Dv]
        """Write k/v of the new tokens into the pool, then attend (causal; windowed for SWA
        layers; with sinks, each head's softmax denominator also holds exp(sink))."""
