"""A naive, test-only `AttentionBackend`: dense K/V per layer indexed by full slot id, and
attention computed request by request from an explicit mask. It follows the window convention
of `AttentionLayer` (an SWA query at p sees keys [p - W, p]) and HF's eager sink softmax, and
serves as the oracle backend for model tests until the paged backends are compared against it."""

from __future__ import annotations

import torch

from swaserve.worker.attention.base import AttentionBackend, AttentionLayer, ForwardBatch


class RefBackend(AttentionBackend):
    name = "ref"

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}  # layer id → [slots, Hkv, Dk]
        self.v: dict[int, torch.Tensor] = {}  # layer id → [slots, Hkv, Dv]

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens  # [B] int64
        batch.attn_metadata = starts.tolist()

    def _write(
        self, layer: AttentionLayer, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        rows = int(loc.max()) + 1
        for store, new in ((self.k, k), (self.v, v)):
            buf = store.get(layer.layer_id)
            if buf is None or buf.shape[0] < rows:
                grown = torch.zeros(rows, *new.shape[1:], dtype=new.dtype)  # [rows, Hkv, D]
                if buf is not None:
                    grown[: buf.shape[0]] = buf
                store[layer.layer_id] = buf = grown
            buf[loc] = new

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if layer.writes_kv:
            self._write(layer, batch.out_full_loc, k, v)
        out = torch.empty(
            q.shape[0], layer.num_heads, layer.v_head_dim, dtype=q.dtype
        )  # [T, H, Dv]
        group = layer.num_heads // layer.num_kv_heads
        for i, start in enumerate(batch.attn_metadata):
            pre, seq = int(batch.prefix_lens[i]), int(batch.seq_lens[i])
            slots = batch.request_slots(i)
            keys = self.k[layer.kv_source][slots].repeat_interleave(group, 1)  # [S, H, Dk]
            values = self.v[layer.kv_source][slots].repeat_interleave(group, 1)  # [S, H, Dv]
            qi = q[start : start + seq - pre]  # [n, H, Dk]
            logits = torch.einsum("nhd,shd->hns", qi, keys) * layer.scaling  # [H, n, S]
            q_pos = torch.arange(pre, seq)[:, None]  # [n, 1]
            k_pos = torch.arange(seq)[None, :]  # [1, S]
            visible = k_pos <= q_pos
            if layer.sliding_window_size is not None:
                visible &= k_pos >= q_pos - layer.sliding_window_size
            if layer.attention_chunk_size:
                c = layer.attention_chunk_size
                visible &= k_pos // c == q_pos // c
            logits = logits.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                sink = sinks.to(logits.dtype)[:, None, None].expand(-1, seq - pre, 1)  # [H, n, 1]
                logits = torch.cat([logits, sink], dim=-1)  # [H, n, S + 1]
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = torch.softmax(logits, dim=-1)[..., :seq]  # [H, n, S]
            out[start : start + seq - pre] = torch.einsum(
                "hns,shd->nhd", probs.to(values.dtype), values
            )
        return out


def prefill_batch(prompts: list[torch.Tensor], logits_positions: str = "all") -> ForwardBatch:
    """One step that prefills each prompt from position 0, on disjoint full slots (from 1)."""
    lens = [p.numel() for p in prompts]
    slots, start = [], 1  # slot 0 is padding
    for n in lens:
        slots.append(torch.arange(start, start + n))  # [n] int64
        start += n
    return ForwardBatch.from_slots(
        input_ids=torch.cat(prompts),  # [T] int64
        positions=torch.cat([torch.arange(n) for n in lens]),  # [T] int64
        prefix_lens=torch.zeros(len(lens), dtype=torch.int64),  # [B] int64
        seq_lens=torch.tensor(lens),  # [B] int64
        req_token_slots=slots,
        out_full_loc=torch.cat(slots),  # [T] int64
        logits_positions=logits_positions,
    )
