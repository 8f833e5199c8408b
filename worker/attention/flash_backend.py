"""The CUDA attention backend on vllm-flash-attn's `flash_attn_varlen_func`.

One varlen call per layer serves prefill chunks and decodes alike (flash-attn aligns the causal
mask and the window `(W, 0)` to the bottom right, so each request's keys may start anywhere before
its first query). Two ways to hand over the keys:

- paged (page_size a multiple of PAGED_PAGE_SIZE_MULTIPLE, K dim == V dim): the pool buffers
  viewed as `[pages, P, Hkv, D]` plus a block table per request — full pages for full layers,
  translated SWA pages of the window for SWA layers (`KVReads.page_table`);
- gathered (otherwise): the read rows copied into contiguous K/V, V zero-padded to the K dim.

Sinks are applied afterwards through the returned logsumexp: `out * sigmoid(lse - sink)`.
vllm_flash_attn is imported lazily, on the first forward: this module imports without it and
without CUDA.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from swaserve.worker.attention.base import AttentionBackend, AttentionLayer, ForwardBatch
from swaserve.worker.attention.metadata import AttentionMetadata, build_attention_metadata
from swaserve.worker.attention.torch_backend import check_shapes
from swaserve.worker.kv.kv_pool import KVPool, SWAKVPool

FLASH_DTYPES = (torch.float16, torch.bfloat16)


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
class PagedKVArgs:
    """Block-table arguments of one layer kind (`KVReads.page_table`)."""

    block_table: torch.Tensor  # [B, max_pages] int32
    seqused_k: torch.Tensor  # [B] int32 keys per request, from its first table page
    cu_seqlens_k: torch.Tensor  # [B+1] int32 cumsum of seqused_k (what the 2.6.x API takes)
    max_seqlen_k: int


@dataclass(frozen=True, slots=True)
class FlashKVArgs:
    """Key-side kernel arguments of one layer kind: gathered rows, and pages when usable."""

    slots: torch.Tensor  # [sum kv_lens] int64 gathered rows (KVReads.flat_slots)
    cu_seqlens_k: torch.Tensor  # [B+1] int32 offsets of the gathered rows (KVReads.kv_indptr)
    max_seqlen_k: int
    paged: PagedKVArgs | None


@dataclass(frozen=True, slots=True)
class FlashMetadata:
    base: AttentionMetadata
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    max_seqlen_q: int
    full: FlashKVArgs
    swa: FlashKVArgs | None


class FlashAttentionBackend(AttentionBackend):
    """flash-attn over the worker's KV memory. KV must be float16 or bfloat16."""

    name = "flash"
    PAGED_PAGE_SIZE_MULTIPLE = 16
    """vllm-flash-attn's FA2 paged kernel wants pages of a multiple of 16 tokens."""

    def __init__(
        self,
        kv_pool: SWAKVPool | KVPool,
        sliding_window_size: int | None = None,
        *,
        kernel: VarlenKernel | None = None,  # None: vllm-flash-attn, imported on first use
    ) -> None:
        dtype = _kv_dtype(kv_pool)
        if kernel is None and dtype not in FLASH_DTYPES:
            raise ValueError(
                f"flash-attn needs float16 or bfloat16 KV, the pool holds {dtype}; "
                "use the 'torch' backend"
            )
        self.kv_pool = kv_pool
        self.sliding_window_size = sliding_window_size
        self._kernel = kernel
        self.page_size = kv_pool.page_size
        self.paged = self.page_size % self.PAGED_PAGE_SIZE_MULTIPLE == 0

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        base = build_attention_metadata(
            batch, self.sliding_window_size, two_pools=isinstance(self.kv_pool, SWAKVPool)
        )
        device = base.out_full_loc.device
        ext = [s - p for p, s in zip(base.prefix_lens, base.seq_lens, strict=True)]
        batch.attn_metadata = FlashMetadata(
            base=base,
            cu_seqlens_q=torch.tensor(base.extend_starts, dtype=torch.int32).to(device),
            max_seqlen_q=max(ext, default=0),
            full=self._kv_args(base, swa=False),
            swa=None if base.swa is None else self._kv_args(base, swa=True),
        )

    def _kv_args(self, base: AttentionMetadata, *, swa: bool) -> FlashKVArgs:
        reads = base.swa if swa else base.full
        assert reads is not None
        device = reads.table.device
        cu_seqlens_k = torch.tensor(reads.kv_indptr, dtype=torch.int32).to(device)  # [B+1]
        paged = None
        if self.paged:
            table, seqused = reads.page_table(self.page_size)
            cu_paged = F.pad(torch.cumsum(seqused, 0, dtype=torch.int32), (1, 0))  # [B+1] int32
            p = self.page_size
            max_paged = max(
                (s % p + n for s, n in zip(reads.kv_start_pos, reads.kv_lens, strict=True)),
                default=0,
            )
            paged = PagedKVArgs(table, seqused, cu_paged, max_paged)
        return FlashKVArgs(reads.flat_slots(), cu_seqlens_k, max(reads.kv_lens, default=0), paged)

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
        if not isinstance(meta, FlashMetadata):
            raise ValueError(
                "batch.attn_metadata is not set by the flash backend: call "
                "init_forward_metadata(batch) once per step before the layers run"
            )
        check_shapes(q, k, v, layer, sinks)
        meta.base.reads(layer)  # raises if the layer does not match the batch
        kv = meta.swa if layer.is_swa else meta.full
        assert kv is not None  # reads() raised otherwise
        meta.base.write_kv(self.kv_pool, layer.layer_id, k, v)
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer.layer_id)  # [rows, Hkv, D]
        if self._kernel is None:
            self._kernel = load_flash_kernel()
        window = (-1, -1) if layer.sliding_window_size is None else (layer.sliding_window_size, 0)
        dv = layer.v_head_dim
        in_dtype = q.dtype
        q = q.to(k_buf.dtype)
        if kv.paged is not None and layer.head_dim == dv:
            keys = k_buf.view(-1, self.page_size, *k_buf.shape[1:])  # [pages, P, Hkv, Dk]
            values = v_buf.view(-1, self.page_size, *v_buf.shape[1:])  # [pages, P, Hkv, Dv]
            paged = kv.paged
            cu_k, max_k, seqused, table = (
                paged.cu_seqlens_k,
                paged.max_seqlen_k,
                paged.seqused_k,
                paged.block_table,
            )
        else:
            keys, values = k_buf[kv.slots], v_buf[kv.slots]  # [N, Hkv, Dk|Dv]
            q, keys, values = _same_head_dim(q, keys, values)
            cu_k, max_k, seqused, table = kv.cu_seqlens_k, kv.max_seqlen_k, None, None
        out, lse = self._kernel(
            q.contiguous(),
            keys,
            values,
            cu_seqlens_q=meta.cu_seqlens_q,
            max_seqlen_q=meta.max_seqlen_q,
            cu_seqlens_k=cu_k,
            seqused_k=seqused,
            max_seqlen_k=max_k,
            softmax_scale=layer.scaling,
            window_size=window,
            block_table=table,
        )
        out = out[..., :dv].to(in_dtype)  # [T, H, Dv]
        return out if sinks is None else apply_sinks(out, lse, sinks)


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
