"""The CUDA attention backend on vllm-flash-attn's `flash_attn_varlen_func`.

One varlen call per layer serves prefill chunks and decodes alike (flash-attn aligns the causal
mask and the window `(W, 0)` to the bottom right, so each request's keys may start anywhere before
its first query). Two ways to hand over the keys:

- paged (page size P a multiple of 16: serve with `page_size=16` on CUDA): the kernel reads the
  pool buffers in place through a block table. Kernel blocks are BLOCK_TOKENS = 16 tokens, whatever P: the
  kernel wants blocks of a multiple of 16 tokens, and a block must be contiguous in the pool,
  which a P-token page is (P = 16k: k blocks). A P = 1 pool hands out single slots, so 16
  consecutive positions are 16 scattered slots and no block view exists; P < 16 or P not a
  multiple of 16 take the gathered path. The buffers are viewed as `[rows / 16 - 1, 16, Hkv,
  D]` from the second block on (the first is padding: slot 0's page), and the block table
  comes from the device slot table, on the device (`KVReads.block_table`): the per-step host
  work and host → device bytes are O(batch).
- gathered (P not a multiple of 16, or V wider than K): each layer copies its read rows into
  contiguous K/V on the device (the index is built there too, `KVReads.flat_slots`), V
  zero-padded to the K dim.

MiMo-V2-Flash (K dim 192 > V dim 128; FA2 wants one head dim) stays paged and copies nothing:
V is handed over as an overlapping strided view of its own buffer, Dk wide, that starts
Dk - Dv elements before each head's V. Its columns `[Dk - Dv, Dk)` are that head's V, the first
ones hold the tail of the previous head (or token) and only feed output columns that are
dropped. The skipped first block gives the first row's lead-in memory to read. Padding V to
Dk in the pool instead would cost 20% more KV bytes per MiMo token (192 + 192 vs 192 + 128)
and a change of the pool's layout and budget; two kernel calls cannot split a softmax.

A fixed-shape decode step (`DecodeMetadata`, the CUDA-graph step) calls the same paged kernel
with block tables made on the device from its padded reads (`decode_block_table`), so a
captured graph reads the pool in place too; on a gathered pool it runs the torch backend's
`static_decode`.

Sinks are applied afterwards through the returned logsumexp: `out * sigmoid(lse - sink)`.
vllm_flash_attn is imported lazily, on the first forward: this module imports without it and
without CUDA.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from swaserve.proto.kv_rules import cdiv
from swaserve.worker.attention.base import AttentionBackend, AttentionLayer, ForwardBatch
from swaserve.worker.attention.metadata import AttentionMetadata, KVReads, build_attention_metadata
from swaserve.worker.attention.static_decode import DecodeMetadata, DecodeReads
from swaserve.worker.attention.torch_backend import (
    TorchAttentionBackend,
    check_shapes,
    static_decode,
)
from swaserve.worker.kv.kv_pool import KVPool, SWAKVPool

logger = logging.getLogger(__name__)

FLASH_DTYPES = (torch.float16, torch.bfloat16)
BLOCK_TOKENS = 16
"""Tokens of one kernel block: vllm-flash-attn's paged kernel wants a multiple of 16."""


class VarlenKernel(Protocol):
    """flash_attn_varlen_func under one calling convention; returns (out [T, H, D], lse [H, T])."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens_q: torch.Tensor,
        max_seqlen_q: int,
        cu_seqlens_k: torch.Tensor,
        seqused_k: torch.Tensor | None,
        max_seqlen_k: int,
        softmax_scale: float,
        window_size: tuple[int, int],
        block_table: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def adapt_varlen(fn: Callable[..., Any]) -> VarlenKernel:
    """Wrap a `flash_attn_varlen_func` of either API generation: 2.6.x takes `cu_seqlens_k` with a
    block table and returns lse via `return_attn_probs`; later releases take `seqused_k` with a
    block table and have `return_softmax_lse`."""
    params = inspect.signature(fn).parameters
    paged_by_seqused = "seqused_k" in params
    lse_flag = "return_softmax_lse" if "return_softmax_lse" in params else "return_attn_probs"

    def varlen(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens_q: torch.Tensor,
        max_seqlen_q: int,
        cu_seqlens_k: torch.Tensor,
        seqused_k: torch.Tensor | None,
        max_seqlen_k: int,
        softmax_scale: float,
        window_size: tuple[int, int],
        block_table: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs: dict[str, Any] = {
            "cu_seqlens_q": cu_seqlens_q,
            "max_seqlen_q": max_seqlen_q,
            "max_seqlen_k": max_seqlen_k,
            "softmax_scale": softmax_scale,
            "causal": True,
            "window_size": window_size,
            "block_table": block_table,
            lse_flag: True,
        }
        if block_table is not None and paged_by_seqused:
            kwargs["seqused_k"] = seqused_k
        else:
            kwargs["cu_seqlens_k"] = cu_seqlens_k
        result = fn(q, k, v, **kwargs)
        return result[0], result[1]

    return varlen


def load_flash_kernel() -> VarlenKernel:
    """Import vllm-flash-attn; raises ImportError with the install hint when it is missing."""
    try:
        from vllm_flash_attn import flash_attn_varlen_func
    except ImportError as err:
        raise ImportError(
            "the 'flash' attention backend needs vllm-flash-attn (pip install 'swaserve[gpu]'); "
            "use the 'torch' backend otherwise"
        ) from err
    return adapt_varlen(flash_attn_varlen_func)


def apply_sinks(
    out: torch.Tensor,  # [T, H, Dv]
    lse: torch.Tensor,  # [H, T] logsumexp of the scaled, masked scores
    sinks: torch.Tensor,  # [H]
) -> torch.Tensor:  # [T, H, Dv]
    """Put exp(sink_h) into each head's softmax denominator after the fact."""
    t, h = out.shape[0], out.shape[1]
    if tuple(lse.shape) != (h, t):
        raise RuntimeError(
            f"flash-attn returned lse of shape {tuple(lse.shape)}, expected {(h, t)}"
        )
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    scale = torch.sigmoid(lse.to(acc).t() - sinks.to(acc)[None, :])  # [T, H]
    return out * scale[..., None].to(out.dtype)


@dataclass(frozen=True, slots=True)
class PagedKV:
    """One layer's pool buffers as the paged kernel reads them (views, made once)."""

    keys: torch.Tensor  # [blocks, 16, Hkv, Dk] view of the K buffer from its second block
    values: torch.Tensor  # [blocks, 16, Hkv, Dk] view of the V buffer (overlapping if Dv < Dk)
    v_column: int  # V's first column in the kernel's output: Dk - Dv


def paged_kv(k_buf: torch.Tensor, v_buf: torch.Tensor) -> PagedKV | None:
    """K/V buffers [rows, Hkv, Dk|Dv] as kernel blocks of BLOCK_TOKENS rows, skipping the first
    block, so kernel block b is rows `[(b + 1)·16, (b + 2)·16)` (see the module docstring for V
    when Dv < Dk). None when V is wider than K or a buffer is not contiguous."""
    rows, hkv, dk = k_buf.shape
    dv = v_buf.shape[-1]
    block = BLOCK_TOKENS
    blocks = rows // block - 1
    if blocks < 1 or dv > dk or not (k_buf.is_contiguous() and v_buf.is_contiguous()):
        return None
    if dk - dv > block * hkv * dv:  # the lead-in would reach before the buffer
        return None
    end = (blocks + 1) * block
    keys = k_buf[block:end].view(blocks, block, hkv, dk)
    if dv == dk:
        values = v_buf[block:end].view(blocks, block, hkv, dk)
    else:
        values = v_buf.as_strided(
            (blocks, block, hkv, dk),
            (block * hkv * dv, hkv * dv, dv, 1),
            v_buf.storage_offset() + block * hkv * dv - (dk - dv),
        )
    return PagedKV(keys, values, dk - dv)


@dataclass(frozen=True, slots=True)
class FlashKeys:
    """Key-side kernel arguments of one layer kind: a block table, or gathered rows."""

    cu_seqlens_k: torch.Tensor  # [B+1] int32 (device)
    max_seqlen_k: int
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32 (paged)
    seqused_k: torch.Tensor | None = None  # [B] int32 (paged)
    slots: torch.Tensor | None = None  # [sum kv_lens] int64 rows to gather (not paged)


FLASH_MAX_HEAD_DIM = 256
"""The widest head flash-attn's kernels take; a layer with wider heads (Gemma 4's global layers,
512) runs through the torch backend's path over the same pools."""


@dataclass(slots=True)
class FlashMetadata:
    base: AttentionMetadata
    cu_seqlens_q: torch.Tensor  # [B+1] int32 (device)
    max_seqlen_q: int
    full: FlashKeys
    swa: FlashKeys | None
    # the torch path's metadata (with its decode table), built once per step on the first
    # layer whose heads are wider than FLASH_MAX_HEAD_DIM
    wide: AttentionMetadata | None = None


class FlashAttentionBackend(AttentionBackend):
    """flash-attn over the worker's KV memory. KV must be float16 or bfloat16, unless `kernel`
    (a stand-in for vllm-flash-attn's `flash_attn_varlen_func`, of either API generation) is
    given: tests run the backend on CPU with one."""

    name = "flash"

    def __init__(
        self,
        kv_pool: SWAKVPool | KVPool,
        sliding_window_size: int | None = None,
        *,
        kernel: Callable[..., Any] | None = None,  # None: vllm-flash-attn, imported on first use
        attention_chunk_size: int | None = None,  # chunked SWA layers (W = C - 1)
    ) -> None:
        dtype = _kv_dtype(kv_pool)
        if kernel is None and dtype not in FLASH_DTYPES:
            raise ValueError(
                f"flash-attn needs float16 or bfloat16 KV, the pool holds {dtype}; "
                "use the 'torch' backend"
            )
        self.kv_pool = kv_pool
        self.sliding_window_size = sliding_window_size
        self.attention_chunk_size = attention_chunk_size
        self._torch = TorchAttentionBackend(
            kv_pool, sliding_window_size, attention_chunk_size=attention_chunk_size
        )
        self._kernel = None if kernel is None else adapt_varlen(kernel)
        self.page_size = kv_pool.page_size
        self._paged = self._paged_views() if self.page_size % BLOCK_TOKENS == 0 else None
        self._decode_cache: tuple[DecodeMetadata, dict[bool, FlashKeys]] | None = None
        if self._paged is None:
            logger.warning(
                "flash attention copies each layer's K/V out of the pool every step: the "
                "paged kernel needs page_size a multiple of %d (got %d) and V no wider than K",
                BLOCK_TOKENS,
                self.page_size,
            )

    @property
    def paged(self) -> bool:
        """Whether the kernel reads the pool in place (else it reads gathered copies)."""
        return self._paged is not None

    def _paged_views(self) -> dict[int, PagedKV] | None:
        pool = self.kv_pool
        ids = sorted(pool.layers_mapping) if isinstance(pool, SWAKVPool) else pool.layer_ids
        views = {i: paged_kv(*pool.get_kv_buffer(i)) for i in ids}
        if any(v is None for v in views.values()):
            return None
        return views  # type: ignore[return-value]

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        base = build_attention_metadata(
            batch,
            self.sliding_window_size,
            two_pools=isinstance(self.kv_pool, SWAKVPool),
            decode_table=False,
            attention_chunk_size=self.attention_chunk_size,
        )
        ext = [s - p for p, s in zip(base.prefix_lens, base.seq_lens, strict=True)]
        batch.attn_metadata = FlashMetadata(
            base=base,
            cu_seqlens_q=base.extend_starts_dev.to(torch.int32),
            max_seqlen_q=max(ext, default=0),
            full=self._keys(base.full),
            swa=None if base.swa is None else self._keys(base.swa),
        )

    def _keys(self, reads: KVReads) -> FlashKeys:
        if self.paged:
            table = reads.block_table(BLOCK_TOKENS, skip_blocks=1)
            return FlashKeys(
                table.cu_seqlens_k, table.max_seqlen_k, table.block_table, table.seqused_k
            )
        lens = (reads.ends_dev - reads.starts_dev).to(torch.int32)  # [B] int32
        cu_k = F.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))  # [B+1] int32
        return FlashKeys(cu_k, max(reads.kv_lens, default=0), slots=reads.flat_slots())

    def forward(
        self,
        q: torch.Tensor,  # [T, H, Dk]
        k: torch.Tensor,  # [T, Hkv, Dk]
        v: torch.Tensor,  # [T, Hkv, Dv]
        layer: AttentionLayer,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,  # [H]
    ) -> torch.Tensor:  # [T, H, Dv]
        meta = batch.attn_metadata
        wide = max(layer.head_dim, layer.v_head_dim) > FLASH_MAX_HEAD_DIM
        if isinstance(meta, DecodeMetadata):  # a captured decode step: no host-planned varlen
            if self._paged is None or wide:
                return static_decode(self.kv_pool, q, k, v, layer, meta, sinks)
            if layer.writes_kv:
                meta.write_kv(self.kv_pool, layer.layer_id, k, v)
            cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)  # [Bp + 1]
            return self._attend(q, layer, self._decode_keys(meta, layer), cu_q, 1, sinks)
        if not isinstance(meta, FlashMetadata):
            raise ValueError(
                "batch.attn_metadata is not set by the flash backend: call "
                "init_forward_metadata(batch) once per step before the layers run"
            )
        if wide:
            return self._wide_forward(q, k, v, layer, batch, meta, sinks)
        check_shapes(q, k, v, layer, sinks)
        meta.base.reads(layer)  # raises if the layer does not match the batch
        kv = meta.swa if layer.is_swa else meta.full
        assert kv is not None  # reads() raised otherwise
        if layer.writes_kv:
            meta.base.write_kv(self.kv_pool, layer.layer_id, k, v)
        return self._attend(q, layer, kv, meta.cu_seqlens_q, meta.max_seqlen_q, sinks)

    def _wide_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
        meta: FlashMetadata,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:  # [T, H, Dv]
        """A layer whose heads the kernel does not take: the torch backend's path."""
        if meta.wide is None:
            meta.wide = build_attention_metadata(
                batch,
                self.sliding_window_size,
                two_pools=isinstance(self.kv_pool, SWAKVPool),
                attention_chunk_size=self.attention_chunk_size,
            )
        batch.attn_metadata = meta.wide
        try:
            return self._torch.forward(q, k, v, layer, batch, sinks)
        finally:
            batch.attn_metadata = meta

    def _attend(
        self,
        q: torch.Tensor,  # [T, H, Dk]
        layer: AttentionLayer,
        kv: FlashKeys,
        cu_seqlens_q: torch.Tensor,  # [B+1] int32
        max_seqlen_q: int,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:  # [T, H, Dv]
        """One kernel call over this layer's K/V (written already): paged or gathered."""
        if self._kernel is None:
            self._kernel = load_flash_kernel()
        window = (-1, -1) if layer.sliding_window_size is None else (layer.sliding_window_size, 0)
        dv = layer.v_head_dim
        in_dtype = q.dtype
        if self._paged is not None:
            view = self._paged[layer.kv_source]
            q = q.to(view.keys.dtype)
            keys, values, column = view.keys, view.values, view.v_column
        else:
            k_buf, v_buf = self.kv_pool.get_kv_buffer(layer.kv_source)  # [rows, Hkv, D]
            assert kv.slots is not None
            q = q.to(k_buf.dtype)
            keys, values = k_buf[kv.slots], v_buf[kv.slots]  # [N, Hkv, Dk|Dv]
            q, keys, values = _same_head_dim(q, keys, values)
            column = 0
        out, lse = self._kernel(
            q.contiguous(),
            keys,
            values,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            cu_seqlens_k=kv.cu_seqlens_k,
            seqused_k=kv.seqused_k,
            max_seqlen_k=kv.max_seqlen_k,
            softmax_scale=layer.scaling,
            window_size=window,
            block_table=kv.block_table,
        )
        out = out[..., column : column + dv].to(in_dtype)  # [T, H, Dv]
        return out if sinks is None else apply_sinks(out, lse, sinks)

    def _decode_keys(self, meta: DecodeMetadata, layer: AttentionLayer) -> FlashKeys:
        """The block tables of a fixed-shape decode step, one per layer kind, built on the
        first layer of each kind and reused by the others (`decode_block_table`)."""
        cached = self._decode_cache
        if cached is None or cached[0] is not meta:
            cached = self._decode_cache = (meta, {})
        keys = cached[1].get(layer.is_swa)
        if keys is None:
            reads = meta.reads(layer)
            window = meta.sliding_window_size if layer.is_swa else None
            chunk = meta.attention_chunk_size if layer.is_swa else None
            keys = cached[1][layer.is_swa] = decode_block_table(
                reads, meta.positions, window, chunk
            )
        return keys


def decode_block_table(
    reads: DecodeReads,
    positions: torch.Tensor,  # [Bp] int64 the new token's position
    window: int | None,  # W for an SWA layer, None for a full one
    chunk: int | None = None,  # C of a chunked SWA layer (W = C - 1)
) -> FlashKeys:
    """The paged kernel's keys for a decode step of fixed shapes, from its padded reads, on
    the device: block j of row b starts at position `first_b + 16·j`, `first_b` = 0 (full) or
    `floor_16(max(0, p_b - W))` (SWA; the lead-in keys before the window share the window's
    first page, so they are live, and the kernel's window mask hides them). The block id is
    the pool row of the block's first read position // 16 - 1 (the paged views skip block 0).
    Shapes depend on the read's width only: Lf / 16 blocks for full layers (Lf a multiple of
    16), cdiv(W + 16, 16) for SWA ones; `max_seqlen_k` is their token span. A chunked layer's
    reads start at its chunk, `floor(p_b / C)·C`, a block boundary: no lead-in keys."""
    block = BLOCK_TOKENS
    width = reads.slots.shape[1]  # Lf, or W + 1
    if window is None:
        if width % block:
            raise ValueError(f"a paged decode reads a multiple of {block} keys, not {width}")
        first = torch.zeros_like(positions)  # [Bp] int64
        cols = torch.arange(0, width, block, device=positions.device)  # [Lf / 16] int64
        columns = cols[None, :].expand(positions.shape[0], -1)  # [Bp, Lf / 16] int64
    else:
        if chunk:  # the chunk's first key (C is a multiple of the page, so of the block)
            start = torch.div(positions, chunk, rounding_mode="floor") * chunk  # [Bp] int64
        else:
            start = torch.clamp(positions - window, min=0)  # [Bp] int64 the window's first key
        first = torch.div(start, block, rounding_mode="floor") * block  # [Bp] int64
        cols = torch.arange(cdiv(window + block, block), device=positions.device) * block
        columns = torch.clamp(first[:, None] - start[:, None] + cols[None, :], 0, width - 1)
    slots = torch.gather(reads.slots, 1, columns)  # [Bp, blocks] int64 pool rows
    block_table = torch.clamp(torch.div(slots, block, rounding_mode="floor") - 1, min=0)
    used = (positions + 1 - first).to(torch.int32)  # [Bp] int32
    return FlashKeys(
        cu_seqlens_k=F.pad(torch.cumsum(used, 0, dtype=torch.int32), (1, 0)),
        max_seqlen_k=columns.shape[1] * block,
        block_table=block_table.to(torch.int32),
        seqused_k=used,
    )


def _same_head_dim(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-pad V (or Q and K) to one head dim; scores are unchanged, extra output columns are 0."""
    dk, dv = k.shape[-1], v.shape[-1]
    if dv < dk:
        v = F.pad(v, (0, dk - dv))  # [..., Dk]
    elif dk < dv:
        q, k = F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk))  # [..., Dv]
    return q, k, v


def _kv_dtype(pool: SWAKVPool | KVPool) -> torch.dtype:
    return pool.full_pool.dtype if isinstance(pool, SWAKVPool) else pool.dtype
