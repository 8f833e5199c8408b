"""The torch attention backend: CPU first, and the fallback on CUDA without vllm-flash-attn.

Per layer: write the new K/V into the pool, then read it back from the pool through the batch's
metadata. One-token requests (decodes) run together, padded to the longest read; prefill chunks
run one request at a time in query tiles, each tile reading only the keys it can see (causal,
and the window for SWA layers). The math lives in `sdpa.attention`.
"""

from __future__ import annotations

import torch

from swaserve.worker.attention import cpu_kernels
from swaserve.worker.attention.base import AttentionBackend, AttentionLayer, ForwardBatch
from swaserve.worker.attention.metadata import (
    AttentionMetadata,
    KVReads,
    build_attention_metadata,
)
from swaserve.worker.attention.sdpa import attention, decode_attention_loops
from swaserve.worker.attention.static_decode import DecodeMetadata
from swaserve.worker.kv.kv_pool import KVPool, SWAKVPool

QUERY_TILE_TOKENS = 128
"""Prefill queries per attention call: a tile reads only the keys it can see (up to its last
position; from its first position - W for SWA layers), which skips most masked work."""

SCORE_BUDGET_ELEMENTS = 1 << 24
"""Upper bound on query-head × key pairs of one attention call (bounds the mask and, off the fused
kernel, the score matrix): long contexts get smaller query tiles, big decode batches are split."""


class TorchAttentionBackend(AttentionBackend):
    """Attention in plain torch over the worker's KV memory (one pool or two).

    `kv_pool` is this rank's KV buffers (one pool or two); `sliding_window_size` is the model's W
    (None when it has no SWA layers); every SWA layer must use it. `attention_chunk_size` C:
    the SWA layers are chunked (Llama 4: W = C - 1, reads start at the query's chunk).
    """

    name = "torch"

    def __init__(
        self,
        kv_pool: SWAKVPool | KVPool,
        sliding_window_size: int | None = None,
        *,
        attention_chunk_size: int | None = None,
    ) -> None:
        self.kv_pool = kv_pool
        self.sliding_window_size = sliding_window_size
        self.attention_chunk_size = attention_chunk_size
        pool = kv_pool.full_pool if isinstance(kv_pool, SWAKVPool) else kv_pool
        if pool.device.type == "cpu":
            cpu_kernels.load()  # the decodes' attention (`decode_attention`); once a process

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = build_attention_metadata(
            batch,
            self.sliding_window_size,
            two_pools=isinstance(self.kv_pool, SWAKVPool),
            attention_chunk_size=self.attention_chunk_size,
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, H, Dk]
        k: torch.Tensor,  # [T, Hkv, Dk]
        v: torch.Tensor,  # [T, Hkv, Dv]
        layer: AttentionLayer,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,  # [H]
    ) -> torch.Tensor:  # [T, H, Dv]
        if isinstance(batch.attn_metadata, DecodeMetadata):
            return static_decode(self.kv_pool, q, k, v, layer, batch.attn_metadata, sinks)
        meta = metadata_of(batch)
        check_shapes(q, k, v, layer, sinks)
        reads = meta.reads(layer)
        if layer.writes_kv:
            meta.write_kv(self.kv_pool, layer.layer_id, k, v)
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer.kv_source)  # [rows, Hkv, D]
        if len(meta.decode_ids) == q.shape[0]:  # decodes only: rows are already in order
            return self._decode(q, k_buf, v_buf, reads, layer, sinks)
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)  # [T, H, Dv]
        if meta.decode_ids:
            out[meta.decode_rows] = self._decode(
                q[meta.decode_rows], k_buf, v_buf, reads, layer, sinks
            )
        for i in meta.prefill_ids:
            a, b = meta.extend_starts[i], meta.extend_starts[i + 1]
            out[a:b] = self._prefill(
                q[a:b], k_buf, v_buf, reads, i, meta.prefix_lens[i], layer, sinks
            )
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [Bd, H, Dk]
        k_buf: torch.Tensor,  # [rows, Hkv, Dk]
        v_buf: torch.Tensor,  # [rows, Hkv, Dv]
        reads: KVReads,
        layer: AttentionLayer,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:  # [Bd, H, Dv]
        """All one-token requests at once: the read window of each is exactly what it sees, so
        the only mask is the padding."""
        assert reads.decode_slots is not None and reads.decode_bias is not None  # decode_table
        return decode_attention(
            q, k_buf, v_buf, reads.decode_slots, reads.decode_bias, layer, sinks
        )

    def _prefill(
        self,
        q: torch.Tensor,  # [E, H, Dk]
        k_buf: torch.Tensor,  # [rows, Hkv, Dk]
        v_buf: torch.Tensor,  # [rows, Hkv, Dv]
        reads: KVReads,
        i: int,
        prefix_len: int,
        layer: AttentionLayer,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:  # [E, H, Dv]
        """One request's chunk, in query tiles; tile [t0, t1) reads keys at positions
        `[max(kv_start, prefix + t0 - W), prefix + t1)` (W = ∞ for full layers)."""
        slots = reads.request_slots(i)  # [L] int64
        keys = gather_rows(k_buf, slots).to(q.dtype)  # [L, Hkv, Dk]
        values = gather_rows(v_buf, slots).to(q.dtype)  # [L, Hkv, Dv]
        kv_start, window = reads.kv_start_pos[i], layer.sliding_window_size
        extend = q.shape[0]
        tile = query_tile(layer.num_heads, extend, slots.numel(), window)
        outs = []
        for t0 in range(0, extend, tile):
            t1 = min(extend, t0 + tile)
            lo = 0 if window is None else max(0, prefix_len + t0 - window - kv_start)
            hi = prefix_len + t1 - kv_start
            bias = window_bias(
                prefix_len + t0, prefix_len + t1, kv_start + lo, kv_start + hi, window, q.device
            )  # [t1 - t0, hi - lo]
            out = attention(
                q[None, t0:t1],
                keys[None, lo:hi],
                values[None, lo:hi],
                bias[None],
                layer.scaling,
                sinks,
            )
            outs.append(out[0])
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def decode_attention(
    q: torch.Tensor,  # [Bd, H, Dk]
    k_buf: torch.Tensor,  # [rows, Hkv, Dk]
    v_buf: torch.Tensor,  # [rows, Hkv, Dv]
    slots: torch.Tensor,  # [Bd, Lmax] int64 pool rows each one-token request reads
    bias: torch.Tensor,  # [Bd, Lmax] float32: 0 on a key, -inf on padding
    layer: AttentionLayer,
    sinks: torch.Tensor | None,
    *,
    split: bool = True,
) -> torch.Tensor:  # [Bd, H, Dv]
    """One-token requests over their padded reads. On CPU in float32, once `cpu_kernels` is
    loaded (every CPU attention backend loads it), our C++ kernel over the pool rows: no
    gathered copy of the keys, and each row's result is the same whatever else the batch holds,
    so a verified draft row attends as the plain decode of its position does, bit for bit (the
    compiled step runs the same kernel). Otherwise one gathered attention call (more only when
    the batch's scores would pass SCORE_BUDGET_ELEMENTS and `split`; a fixed-shape step does not
    split, so that its batch and width stay symbolic)."""
    kernel = cpu_kernels.decode_attention_for(q, k_buf, v_buf)
    if kernel is not None:
        return kernel(q, k_buf, v_buf, slots, bias, layer.scaling, sinks)

    def attend(qs: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keys = gather_rows(k_buf, rows).to(q.dtype)  # [b, Lmax, Hkv, Dk]
        values = gather_rows(v_buf, rows).to(q.dtype)  # [b, Lmax, Hkv, Dv]
        return attention(qs[:, None], keys, values, mask[:, None, :], layer.scaling, sinks)[:, 0]

    if not split:
        return attend(q, slots, bias)
    num, width = slots.shape
    group = max(1, SCORE_BUDGET_ELEMENTS // (layer.num_heads * max(width, 1)))
    outs = [
        attend(q[a : a + group], slots[a : a + group], bias[a : a + group])
        for a in range(0, num, group)
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def static_decode(
    kv_pool: SWAKVPool | KVPool,
    q: torch.Tensor,  # [Bp, H, Dk]
    k: torch.Tensor,  # [Bp, Hkv, Dk]
    v: torch.Tensor,  # [Bp, Hkv, Dv]
    layer: AttentionLayer,
    meta: DecodeMetadata,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # [Bp, H, Dv]
    """A layer of a fixed-shape decode step (`static_decode.DecodeMetadata`): write the new
    K/V, then attend over the padded reads; no host work, no host read (any backend's decode
    step of a compiled or captured graph runs this). Traced by torch.compile, float32: our C++
    kernel over the pool rows (`cpu_kernels`) once the step has built it, else loops over the
    pool rows (`decode_attention_loops`); captured eager, as gathers and the attention kernels."""
    if layer.writes_kv:
        meta.write_kv(kv_pool, layer.layer_id, k, v)
    k_buf, v_buf = kv_pool.get_kv_buffer(layer.kv_source)  # [rows, Hkv, D]
    reads = meta.reads(layer)
    if torch.compiler.is_compiling():
        kernel = cpu_kernels.decode_attention_for(q, k_buf, v_buf)
        if kernel is not None:
            return kernel(q, k_buf, v_buf, reads.slots, reads.bias, layer.scaling, sinks)
        return decode_attention_loops(
            q, k_buf, v_buf, reads.slots, reads.bias, layer.scaling, sinks
        )
    return decode_attention(q, k_buf, v_buf, reads.slots, reads.bias, layer, sinks, split=False)


def gather_rows(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`buf[rows]` for a pool buffer [N, Hkv, D] (index_select is the faster gather on CPU)."""
    return buf.index_select(0, rows.reshape(-1)).view(*rows.shape, *buf.shape[1:])


def metadata_of(batch: ForwardBatch) -> AttentionMetadata:
    meta = batch.attn_metadata
    if not isinstance(meta, AttentionMetadata):
        raise ValueError(
            "batch.attn_metadata is not set by this backend: call init_forward_metadata(batch) "
            "once per step before the layers run"
        )
    return meta


def check_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: AttentionLayer,
    sinks: torch.Tensor | None,
) -> None:
    t = q.shape[0]
    want = {
        "q": (t, layer.num_heads, layer.head_dim),
        "k": (t, layer.num_kv_heads, layer.head_dim),
        "v": (t, layer.num_kv_heads, layer.v_head_dim),
    }
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tuple(tensor.shape) != want[name]:
            raise ValueError(
                f"layer {layer.layer_id}: {name} has shape {tuple(tensor.shape)}, "
                f"expected {want[name]}"
            )
    if layer.num_heads % layer.num_kv_heads:
        raise ValueError(
            f"layer {layer.layer_id}: {layer.num_heads} heads are not a multiple of "
            f"{layer.num_kv_heads} KV heads"
        )
    if sinks is not None and tuple(sinks.shape) != (layer.num_heads,):
        raise ValueError(
            f"layer {layer.layer_id}: sinks have shape {tuple(sinks.shape)}, "
            f"expected ({layer.num_heads},)"
        )


def query_tile(num_heads: int, extend: int, kv_len: int, window: int | None) -> int:
    """Queries per prefill tile: QUERY_TILE_TOKENS, fewer when heads × tile × keys would pass
    SCORE_BUDGET_ELEMENTS (a tile reads at most kv_len keys, or tile + W for SWA layers)."""
    tile = min(extend, QUERY_TILE_TOKENS)
    keys = kv_len if window is None else min(kv_len, tile + window)
    return max(1, min(tile, SCORE_BUDGET_ELEMENTS // (num_heads * max(keys, 1))))


def window_bias(
    q_start: int, q_end: int, k_start: int, k_end: int, window: int | None, device: torch.device
) -> torch.Tensor:  # [q_end - q_start, k_end - k_start] float32
    """0 where the query at position p sees the key at position j (j <= p, and j >= p - W for
    a window), -inf elsewhere."""
    q_pos = torch.arange(q_start, q_end, device=device)[:, None]  # [n, 1] int64
    k_pos = torch.arange(k_start, k_end, device=device)[None, :]  # [1, m] int64
    hidden = k_pos > q_pos  # [n, m] bool
    if window is not None:
        hidden |= k_pos < q_pos - window
    bias = torch.zeros(hidden.shape, dtype=torch.float32, device=device)  # [n, m] float32
    return bias.masked_fill_(hidden, float("-inf"))
