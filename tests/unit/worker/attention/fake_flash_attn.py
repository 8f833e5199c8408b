"""Stand-ins for vllm-flash-attn's `flash_attn_varlen_func`, with the real signatures of both API
generations, for running the flash backend on CPU.

`FakeFlashAttn.v2_6` has 2.6.x's signature (`cu_seqlens_k` also with a block table; lse through
`return_attn_probs`), `FakeFlashAttn.newer` the later one (`seqused_k` with a block table,
`return_softmax_lse`). Both enforce what the CUDA kernel checks (dtypes, int32 index tensors,
contiguous last dims, one head dim for Q, K and V, blocks of a multiple of 16 tokens, shapes)
and compute what it computes: bottom-right-aligned causal attention with a left window, GQA,
keys read from the paged cache through the block table, lse [H, total_q] float32. Reads follow
the tensors' strides, so a strided view of a pool buffer is read exactly as the kernel would.

`compute=False` checks the call and returns empty outputs without reading a value (for tensors
on the meta device). `calls` records every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class KernelCall:
    paged: bool
    window: tuple[int, int]
    num_blocks: int  # blocks of the paged K/V view (0: gathered)
    head_dim: int
    seqused_k: bool  # called with seqused_k (newer API)


@dataclass
class FakeFlashAttn:
    dtypes: tuple[torch.dtype, ...] = (*KERNEL_DTYPES, torch.float32)
    compute: bool = True
    calls: list[KernelCall] = field(default_factory=list)

    def v2_6(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
        deterministic=False, return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        """vllm-flash-attn 2.6.x's flash_attn_varlen_func."""
        assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
        out, lse = self._attend(
            q, k, v, cu_seqlens_q, cu_seqlens_k, None, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal, tuple(window_size), block_table,
        )  # fmt: skip
        return (out, lse, None) if return_attn_probs else out

    def newer(
        self, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
        seqused_k=None, q_v=None, dropout_p=0.0, softmax_scale=None, causal=False,
        window_size=None, softcap=0.0, alibi_slopes=None, deterministic=False,
        return_attn_probs=False, block_table=None, return_softmax_lse=False, out=None,
        scheduler_metadata=None, q_descale=None, k_descale=None, v_descale=None, num_splits=0,
        fa_version=2, s_aux=None,
    ):  # fmt: skip
        """Later releases' flash_attn_varlen_func (FA2 path)."""
        assert cu_seqlens_k is not None or seqused_k is not None
        assert cu_seqlens_k is None or seqused_k is None
        assert block_table is None or seqused_k is not None
        assert q_v is None and dropout_p == 0.0 and s_aux is None and out is None
        window = (-1, -1) if window_size is None else tuple(window_size)
        result, lse = self._attend(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal, window, block_table,
        )  # fmt: skip
        return (result, lse) if return_softmax_lse else result

    def _attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [N, Hkv, D] or [blocks, block, Hkv, D]
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,  # [B+1] int32
        cu_seqlens_k: torch.Tensor | None,  # [B+1] int32
        seqused_k: torch.Tensor | None,  # [B] int32
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float | None,
        causal: bool,
        window: tuple[int, int],
        block_table: torch.Tensor | None,  # [B, max_blocks] int32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        paged = block_table is not None
        assert q.dtype in self.dtypes, f"FlashAttention only supports fp16 and bf16, got {q.dtype}"
        assert k.dtype == q.dtype and v.dtype == q.dtype
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous()
        for t in (q, k, v):
            assert t.stride(-1) == 1, "Input tensor must have contiguous last dimension"
        t_q, heads, dim = q.shape
        assert dim <= 256, "FlashAttention forward only supports head dimension at most 256"
        batch = cu_seqlens_q.numel() - 1
        if paged:
            assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
            assert block_table.shape[0] == batch
            num_blocks, block, heads_k = k.shape[0], k.shape[1], k.shape[2]
            assert block % 16 == 0, "Paged KV cache block size must be divisible by 16"
            assert tuple(k.shape) == (num_blocks, block, heads_k, dim)
            assert tuple(v.shape) == (num_blocks, block, heads_k, dim), "one head dim for Q, K, V"
        else:
            num_blocks, heads_k = 0, k.shape[1]
            assert tuple(k.shape[1:]) == (heads_k, dim)
            assert tuple(v.shape) == tuple(k.shape), "one head dim for Q, K, V"
        if cu_seqlens_k is not None:
            assert cu_seqlens_k.dtype == torch.int32 and cu_seqlens_k.shape == (batch + 1,)
        if seqused_k is not None:
            assert seqused_k.dtype == torch.int32 and seqused_k.shape == (batch,)
            assert seqused_k.is_contiguous()
        assert heads % heads_k == 0
        assert causal, "swaserve always calls the kernel causal"
        self.calls.append(KernelCall(paged, window, num_blocks, dim, seqused_k is not None))
        if not self.compute:
            lse = torch.empty(heads, t_q, dtype=torch.float32, device=q.device)  # [H, T]
            return q.new_empty(t_q, heads, dim), lse
        return self._reference(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, window, block_table,
        )  # fmt: skip

    def _reference(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, window, block_table,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        left = -1 if window[0] >= max_seqlen_k else window[0]
        cu_q = cu_seqlens_q.tolist()
        outs, lses = [], []
        for i in range(len(cu_q) - 1):
            qi = q[cu_q[i] : cu_q[i + 1]].double()  # [m, H, D]
            if block_table is not None:
                if seqused_k is not None:
                    n = int(seqused_k[i])
                else:  # 2.6.x: key counts are the differences of cu_seqlens_k
                    n = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
                blocks = block_table[i, : -(-n // k.shape[1])].long()
                ki = k[blocks].flatten(0, 1)[:n]  # [n, Hkv, D]
                vi = v[blocks].flatten(0, 1)[:n]
            else:
                a, b = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
                ki, vi, n = k[a:b], v[a:b], b - a
            m = qi.shape[0]
            assert m <= max_seqlen_q and n <= max_seqlen_k
            group = qi.shape[1] // ki.shape[1]
            ki = ki.double().repeat_interleave(group, 1)
            vi = vi.double().repeat_interleave(group, 1)
            scores = torch.einsum("mhd,nhd->hmn", qi, ki) * scale  # [H, m, n]
            row = torch.arange(m)[:, None] + n - m  # query r aligned to the bottom right
            col = torch.arange(n)[None, :]
            hidden = col > row
            if left >= 0:
                hidden |= col < row - left
            scores = scores.masked_fill(hidden, float("-inf"))
            lse = torch.logsumexp(scores, -1)  # [H, m]
            probs = torch.exp(scores - lse[..., None])
            outs.append(torch.einsum("hmn,nhd->mhd", probs, vi).to(q.dtype))
            lses.append(lse.float())
        return torch.cat(outs), torch.cat(lses, dim=1)


def kernel_api(fake: FakeFlashAttn, api: str) -> Any:
    """The fake's flash_attn_varlen_func of one API generation: "2.6" or "newer"."""
    return {"2.6": fake.v2_6, "newer": fake.newer}[api]
