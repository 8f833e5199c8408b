"""MXFP4 (OCP microscaling FP4), as GPT-OSS checkpoints store their expert weights.

A parameter `p` of shape [E, K, N] (our packed layout, e.g. gate_up_proj [E, D, 2I]) is stored
transposed and blocked along K:

    p_blocks  [E, N, K / 32, 16] uint8   two FP4 e2m1 codes per byte, low nibble first
    p_scales  [E, N, K / 32]     uint8   E8M0 exponent of each 32-value block, bias 127

    value[e, k, n] = FP4[code] · 2^(scale - 127)

`dequantize_mxfp4` gives what transformers' `convert_moe_packed_tensors` gives, bit for bit in
every dtype; it takes one expert or many. The loader calls it once per expert with
`dequantize_weights`; otherwise the experts stay blocks + scales in memory and the MoE layers
call it each step on the experts the step selects (`quantized_weights`).
"""

from __future__ import annotations

import functools

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
    """The parameter that `blocks` and `scales` store (the last two dims transposed back).

    Each byte's two values are looked up at once (`fp4_pairs`) and each block is multiplied by
    2^(scale - 127) computed once per block, in float32: the products transformers' `ldexp`
    computes, rounded once to `dtype`, so the values are equal bit for bit, in less than half
    the time (for every finite scale; E8M0's NaN, 255, gives NaN for a zero code where `ldexp`
    gives 0)."""
    *lead, n, groups, width = blocks.shape
    codes = blocks.reshape(-1).int()  # [rows · 16] int32
    rows = codes.numel() // width
    pairs = fp4_pairs(torch.float32, blocks.device)  # [256, 2] float32
    values = pairs.index_select(0, codes).view(rows, 2 * width)  # [rows, 32] float32
    exponents = scales.to(torch.int32).reshape(rows, 1) - SCALE_BIAS  # [rows, 1] int32
    values.mul_(torch.pow(2.0, exponents))  # · 2^exponent, in float32
    out = values.to(dtype).view(*lead, n, groups * 2 * width)  # [..., N, K], rounded once
    return out.transpose(-1, -2).contiguous()


@functools.cache
def fp4_pairs(dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # [256, 2] in dtype
    """Byte → its (low nibble, high nibble) FP4 e2m1 values, made once per dtype and device
    (experts kept in MXFP4 are dequantized every step: no host-to-device copy of it each time)."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=dtype)  # [16]
    pairs = torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=1)  # [256, 2]
    return pairs.to(device)


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
