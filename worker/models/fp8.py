"""FP8 block-scaled weights, as DeepSeek-V3-style checkpoints (MiMo-V2-Flash among them) store
them: `<name>` in float8_e4m3fn and `<name>_scale_inv` in float32 (or bfloat16), one scale per
block of `weight_block_size = (bn, bk)` over the last two dimensions (edge blocks may be short):

    weight [..., R, C] float8_e4m3fn
    scale  [..., ceil(R / bn), ceil(C / bk)]
    value[..., r, c] = float(weight[..., r, c]) · scale[..., r // bn, c // bk]

Despite its name, `weight_scale_inv` multiplies: it is the inverse of the quantizer's scale.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def fp8_scale_shape(weight_shape: tuple[int, ...], block_size: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the block scales of a weight of `weight_shape` [..., R, C]."""
    *lead, rows, cols = weight_shape
    bn, bk = block_size
    return (*lead, -(-rows // bn), -(-cols // bk))


def dequantize_fp8(
    weight: torch.Tensor,  # [..., R, C] float8_e4m3fn
    scale_inv: torch.Tensor,  # [..., ceil(R/bn), ceil(C/bk)] float
    block_size: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., R, C] in dtype
    """Multiply each block by its scale in float32, then round once to `dtype`."""
    rows, cols = weight.shape[-2:]
    bn, bk = block_size
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(bn, dim=-2)[..., :rows, :]  # [..., R, ceil(C/bk)]
    scale = scale.repeat_interleave(bk, dim=-1)[..., :cols]  # [..., R, C] float32
    return (weight.to(torch.float32) * scale).to(dtype)


def quantize_fp8(
    value: torch.Tensor,  # [..., R, C]
    block_size: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight float8_e4m3fn, scale_inv float32): each block scaled so that its largest
    magnitude maps to FP8's largest finite value; what the tiny-model maker writes."""
    rows, cols = value.shape[-2:]
    bn, bk = block_size
    lead = value.shape[:-2]
    pad_r, pad_c = -rows % bn, -cols % bk
    padded = torch.nn.functional.pad(value.float(), (0, pad_c, 0, pad_r))  # [..., R', C'] float32
    blocks = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [..., R'/bn, bn, C'/bk, bk]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., R'/bn, C'/bk] float32
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [..., nr, nc]
    full = scale_inv.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)  # [..., R', C']
    weight = (padded / full)[..., :rows, :cols].to(FP8_DTYPE)  # [..., R, C] float8_e4m3fn
    return weight.reshape(*lead, rows, cols), scale_inv
