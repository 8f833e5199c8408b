"""Dense attention over gathered K/V with an additive mask, GQA and per-head sinks.

Sinks (GPT-OSS, MiMo SWA layers): head h's softmax denominator also holds exp(s_h), and the sink
column is dropped, exactly like transformers' eager attention. With lse = logsumexp of the masked
scores, that is the plain softmax output times `sigmoid(lse - s_h)`:

    exp(x_j) / (sum_j exp(x_j) + exp(s)) = softmax(x)_j * 1 / (1 + exp(s - lse))

On CPU the fused flash kernel behind torch's SDPA (`_scaled_dot_product_flash_attention_for_cpu`,
which also returns lse) does the work; elsewhere, or for other dtypes, a matmul version does.
"""

from __future__ import annotations

from typing import Any

import torch

_FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _find_fused_cpu_op() -> Any:
    """torch's CPU flash kernel, if this torch has it with a mask argument (private API)."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    schema = getattr(getattr(op, "default", None), "_schema", None)
    names = {arg.name for arg in getattr(schema, "arguments", [])}
    return op if {"attn_mask", "scale"} <= names else None


_FUSED_CPU_OP = _find_fused_cpu_op()


def fused_available(q: torch.Tensor) -> bool:
    """Whether the fused CPU kernel serves `q`'s device and dtype on this torch."""
    return _FUSED_CPU_OP is not None and q.device.type == "cpu" and q.dtype in _FUSED_DTYPES


def attention(
    q: torch.Tensor,  # [B, Lq, H, Dk]
    k: torch.Tensor,  # [B, L, Hkv, Dk]
    v: torch.Tensor,  # [B, L, Hkv, Dv]
    bias: torch.Tensor,  # [B, Lq, L] additive: 0 where a query sees a key, -inf elsewhere
    scaling: float,
    sinks: torch.Tensor | None = None,  # [H] sink logits
    *,
    fused: bool | None = None,  # None: the fused CPU kernel when it applies
) -> torch.Tensor:  # [B, Lq, H, Dv]
    """softmax(q k^T * scaling + bias [, sink]) v for each head; query head h reads KV head
    h // (H / Hkv). Every query must see at least one key."""
    b, lq, h, dk = q.shape
    hkv, dv, width = k.shape[2], v.shape[-1], k.shape[1]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} KV heads")
    g = h // hkv
    # Group the G query heads of one KV head into the query axis: no K/V copy per head.
    if lq == 1:  # decode: plain views
        qg = q.reshape(b, hkv, g, dk)
        mask = bias.to(q.dtype).view(b, 1, 1, width).expand(b, 1, g, width)  # [B, 1, G, L]
    else:
        qg = q.reshape(b, lq, hkv, g, dk).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * lq, dk)
        mask = bias.to(q.dtype)[:, None, None].expand(b, 1, g, lq, width)
        mask = mask.reshape(b, 1, g * lq, width)  # [B, 1, G*Lq, L]
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D] views
    if fused if fused is not None else fused_available(q):
        out, lse = _fused(qg, kh, vh, mask, scaling)  # [B, Hkv, G*Lq, Dv], [B, Hkv, G*Lq]
    else:
        out, lse = _matmul(qg, kh, vh, mask, scaling)
    if lq == 1:
        out, lse = out.reshape(b, 1, h, dv), lse.reshape(b, 1, h)
    else:
        out = out.view(b, hkv, g, lq, dv).permute(0, 3, 1, 2, 4).reshape(b, lq, h, dv)
        lse = lse.view(b, hkv, g, lq).permute(0, 3, 1, 2).reshape(b, lq, h)
    if sinks is None:
        return out
    return out * torch.sigmoid(lse - sinks.to(lse.dtype)).to(out.dtype)[..., None]


def _fused(
    q: torch.Tensor,  # [B, Hkv, M, Dk]
    k: torch.Tensor,  # [B, Hkv, L, Dk]
    v: torch.Tensor,  # [B, Hkv, L, Dv]
    mask: torch.Tensor,  # [B, 1, M, L]
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, Hkv, M, Dv], [B, Hkv, M] float32
    assert _FUSED_CPU_OP is not None  # callers check fused_available
    dk, dv = q.shape[-1], v.shape[-1]
    # The kernel wants one head size: zero-pad the smaller side (scores and outputs unchanged).
    if dv < dk:
        v = torch.nn.functional.pad(v, (0, dk - dv))  # [B, Hkv, L, Dk]
    elif dk < dv:
        q = torch.nn.functional.pad(q, (0, dv - dk))  # [B, Hkv, M, Dv]
        k = torch.nn.functional.pad(k, (0, dv - dk))  # [B, Hkv, L, Dv]
    out, lse = _FUSED_CPU_OP(q, k, v, attn_mask=mask, scale=scaling)
    return (out if out.shape[-1] == dv else out[..., :dv]), lse


def _matmul(
    q: torch.Tensor,  # [B, Hkv, M, Dk]
    k: torch.Tensor,  # [B, Hkv, L, Dk]
    v: torch.Tensor,  # [B, Hkv, L, Dv]
    mask: torch.Tensor,  # [B, 1, M, L]
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, Hkv, M, Dv], [B, Hkv, M] float32 (or float64)
    scores = torch.matmul(q, k.transpose(-1, -2))  # [B, Hkv, M, L]
    acc = torch.float64 if scores.dtype == torch.float64 else torch.float32
    scores = scores.to(acc).mul_(scaling).add_(mask)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [B, Hkv, M, 1]
    probs = scores.sub_(lse).exp_().to(v.dtype)  # [B, Hkv, M, L]
    return torch.matmul(probs, v), lse.squeeze(-1)


def decode_attention_loops(
    q: torch.Tensor,  # [B, H, Dk]
    k_buf: torch.Tensor,  # [rows, Hkv, Dk] a pool's K buffer
    v_buf: torch.Tensor,  # [rows, Hkv, Dv]
    slots: torch.Tensor,  # [B, L] int64 pool rows each one-token query reads
    bias: torch.Tensor,  # [B, L] float32: 0 on a key, -inf on padding
    scaling: float,
    sinks: torch.Tensor | None = None,  # [H]
) -> torch.Tensor:  # [B, H, Dv]
    """`attention` of one-token queries written as products and reductions over the pool rows
    themselves, for torch.compile: inductor fuses the row gathers into its score and output loops,
    so no [B, L] copy of K/V (nor its transpose, nor MiMo's Dv padding) is written. In float32
    whatever the pool holds. Eager, it would materialise the [B, L, Hkv, G, D] products: only a
    compiled step calls it."""
    b, h, dk = q.shape
    hkv = k_buf.shape[1]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} KV heads")
    keys = k_buf[slots].float()  # [B, L, Hkv, Dk] (fused into the loops below)
    values = v_buf[slots].float()  # [B, L, Hkv, Dv]
    qg = q.float().view(b, 1, hkv, h // hkv, dk)  # [B, 1, Hkv, G, Dk]
    scores = (qg * keys[:, :, :, None, :]).sum(-1) * scaling  # [B, L, Hkv, G]
    scores = scores + bias[:, :, None, None]
    lse = torch.logsumexp(scores, dim=1, keepdim=True)  # [B, 1, Hkv, G]
    probs = torch.exp(scores - lse)  # [B, L, Hkv, G]
    out = (probs[..., None] * values[:, :, :, None, :]).sum(1).reshape(b, h, -1)  # [B, H, Dv]
    if sinks is not None:
        out = out * torch.sigmoid(lse.reshape(b, h) - sinks.float())[..., None]
    return out.to(q.dtype)
