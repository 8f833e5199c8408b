"""The attention-backend interface between the model code and the KV memory.

Per model step the runner builds one `ForwardBatch` (which tokens are new, where their KV goes,
which slots each request already holds). The backend's `init_forward_metadata(batch)` turns the
full slot ids into what each layer kind reads — translating full → SWA ids once for all SWA
layers and cutting SWA reads to the window — and stores it on `batch.attn_metadata`. Each
attention layer then calls `backend.forward(q, k, v, layer, batch)`, which writes the new K/V
into the pool and returns the attention output. Nothing is global: the batch is passed down.

Shapes: T = new tokens in the batch, B = requests, H = query heads (this TP shard), Hkv = KV
heads, Dk / Dv = K / V head dims.

Window convention (DESIGN §2): a query at position p of an SWA layer with window W sees key
positions `[p - W, p]` (W tokens before it and itself); a full layer sees `[0, p]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


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

    @property
    def is_swa(self) -> bool:
        return self.sliding_window_size is not None


@dataclass(slots=True)
class ForwardBatch:
    """One model step over B requests; prefill chunks and decodes may be mixed in any order.

    Request i contributes tokens at positions `[prefix_lens[i], seq_lens[i])`; its KV for
    positions `[0, prefix_lens[i])` is already in the pool (a cached prefix or earlier chunks).
    `req_token_slots[i]` holds the full slot id of every position `[0, seq_lens[i])`, new
    tokens included; SWA KV of positions before `prefix_lens[i] - W` may be gone (0 in the
    mapping) and is never read.
    """

    input_ids: torch.Tensor  # [T] int64, new tokens of all requests, request by request
    positions: torch.Tensor  # [T] int64, absolute positions of those tokens
    prefix_lens: torch.Tensor  # [B] int64 (CPU)
    seq_lens: torch.Tensor  # [B] int64 (CPU)
    req_token_slots: list[torch.Tensor]  # B × [seq_lens[i]] int64 full slot ids
    out_full_loc: torch.Tensor  # [T] int64, full slot ids of the new tokens
    logits_positions: str = "last"  # "last": one row per request; "all": one row per new token
    attn_metadata: Any = field(default=None)  # set by AttentionBackend.init_forward_metadata

    def __post_init__(self) -> None:
        batch = self.prefix_lens.numel()
        if self.seq_lens.numel() != batch or len(self.req_token_slots) != batch:
            raise ValueError(
                "prefix_lens, seq_lens and req_token_slots must have one entry per request"
            )
        extend = self.seq_lens - self.prefix_lens
        if batch and int(extend.min()) < 1:
            raise ValueError("every request in a batch must add at least one token")
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

    @property
    def batch_size(self) -> int:
        return self.prefix_lens.numel()

    @property
    def extend_lens(self) -> torch.Tensor:
        return self.seq_lens - self.prefix_lens  # [B] int64

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def logits_indices(self) -> torch.Tensor:
        """Rows of the [T, hidden] output that produce logits."""
        if self.logits_positions == "all":
            return torch.arange(self.num_tokens, device=self.input_ids.device)
        return (torch.cumsum(self.extend_lens, 0) - 1).to(self.input_ids.device)  # [B] int64


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
