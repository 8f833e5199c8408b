"""MXFP4 (OCP microscaling FP4), as GPT-OSS checkpoints store their expert weights.

A parameter `p` of shape [E, K, N] (our packed layout, e.g. gate_up_proj [E, D, 2I]) is stored
transposed and blocked along K:

    p_blocks  [E, N, K / 32, 16] uint8   two FP4 e2m1 codes per byte, low nibble first
    p_scales  [E, N, K / 32]     uint8   E8M0 exponent of each 32-value block, bias 127

    value[e, k, n] = FP4[code] · 2^(scale - 127)

`dequantize_mxfp4` does what transformers' `convert_moe_packed_tensors` does, op for op, so that
the results are equal bit for bit in every dtype; it takes one expert or many.
"""

from __future__ import annotations

import torch

VALUES_PER_BLOCK = 32
BYTES_PER_BLOCK = VALUES_PER_BLOCK // 2
SCALE_BIAS = 127
FP4_E2M1_VALUES = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip


def mxfp4_shapes(param_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks shape, scales shape) that store a parameter of `param_shape` [..., K, N]."""
    *lead, k, n = param_shape
    groups = k // VALUES_PER_BLOCK
    return (*lead, n, groups, BYTES_PER_BLOCK), (*lead, n, groups)


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [..., N, G, 16] uint8
    scales: torch.Tensor,  # [..., N, G] uint8
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., G·32, N] in dtype
    """The parameter that `blocks` and `scales` store (the last two dims transposed back)."""
    *lead, n, groups, width = blocks.shape
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=dtype, device=blocks.device)  # [16]
    codes = blocks.to(torch.uint8).reshape(-1, width)  # [rows, 16] uint8
    exponents = scales.to(torch.int32).reshape(-1, 1) - SCALE_BIAS  # [rows, 1] int32
    out = torch.empty(codes.shape[0], 2 * width, dtype=dtype, device=blocks.device)  # [rows, 32]
    out[:, 0::2] = lut[(codes & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(codes >> 4).to(torch.int)]
    torch.ldexp(out, exponents, out=out)
    out = out.view(*lead, n, groups * 2 * width)  # [..., N, K]
    return out.transpose(-1, -2).contiguous()


def random_mxfp4(
    param_shape: tuple[int, ...], generator: torch.Generator, exponents: tuple[int, int] = (-6, -3)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of random codes and random block exponents in [lo, hi] (2^-6..2^-3 keeps
    tiny models' activations in a sane range): an MXFP4 tensor as a checkpoint would hold it."""
    blocks_shape, scales_shape = mxfp4_shapes(param_shape)
    blocks = torch.randint(0, 256, blocks_shape, generator=generator, dtype=torch.uint8)
    lo, hi = exponents
    scales = torch.randint(
        SCALE_BIAS + lo, SCALE_BIAS + hi + 1, scales_shape, generator=generator, dtype=torch.uint8
    )  # [..., N, G] uint8
    return blocks, scales
