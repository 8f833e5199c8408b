"""FP8 block-scaled weights, as DeepSeek-V3-style checkpoints (MiMo-V2-Flash among them) store
them: `<name>` in float8_e4m3fn and `<name>_scale_inv` in float32 (or bfloat16), one scale per
block of `weight_block_size = (bn, bk)` over the last two dimensions (edge blocks may be short):

    weight [..., R, C] float8_e4m3fn
    scale  [..., ceil(R / bn), ceil(C / bk)]
    value[..., r, c] = float(weight[..., r, c]) · scale[..., r // bn, c // bk]

Despite its name, `weight_scale_inv` multiplies: it is the inverse of the quantizer's scale.

Kept in memory (the engine's default), a weight stays float8_e4m3fn with its scales expanded
along one dimension (below), and linears run through `fp8_linear`: a block-scaled
`F.scaled_mm` (or `torch._scaled_mm`) where the device has one, else the weight dequantized
for the call.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

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


# ---- resident FP8 weights --------------------------------------------------------------------
#
# A weight kept in FP8 holds its block scales *expanded along one of its last two dimensions*,
# `expand_dim`, and blocked along the other:
#
#     expand_dim -2:  scale [..., R, ceil(C / bk)]   one scale per row and column block
#     expand_dim -1:  scale [..., ceil(R / bn), C]   one scale per row block and column
#
# The expanded dimension is the one a TP rank cuts (or the rows, uncut): its scales then shard
# exactly like the weight, whatever the cut and however the checkpoint stacks parts along it
# (MiMo's per-expert gate and up blocks, which a packed [2I, D] scale cannot hold when
# I % bn != 0). It costs 4 / bk (or 4 / bn) bytes per weight byte: 3 % at 128.


def expanded_scale_shape(
    weight_shape: tuple[int, ...], block_size: tuple[int, int], expand_dim: int
) -> tuple[int, ...]:
    """Shape of the resident scale of a weight of `weight_shape` [..., R, C]."""
    *lead, rows, cols = weight_shape
    bn, bk = block_size
    if expand_dim == -2:
        return (*lead, rows, -(-cols // bk))
    return (*lead, -(-rows // bn), cols)


def dequantize_fp8_expanded(
    weight: torch.Tensor,  # [..., R, C] float8_e4m3fn
    scale: torch.Tensor,  # expanded_scale_shape(...) float32
    block_size: tuple[int, int],
    expand_dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., R, C] in dtype
    """`dequantize_fp8` from a resident (expanded) scale: the same float32 products, rounded
    once, so the values are equal bit for bit. Runs every step: each byte is decoded through a
    256-entry table (4x faster than torch's float8 cast on CPU), and a scale is broadcast over
    its block rather than repeated where the dimension is a whole number of blocks."""
    *lead, rows, cols = weight.shape
    bn, bk = block_size
    codes = weight.view(torch.uint8).reshape(-1).int()  # [R·C·...] int32
    value = fp8_values(weight.device).index_select(0, codes).view(weight.shape)  # float32
    if expand_dim == -2 and cols % bk == 0:
        blocked = value.view(*lead, rows, cols // bk, bk) * scale.unsqueeze(-1)
    elif expand_dim == -1 and rows % bn == 0:
        blocked = value.view(*lead, rows // bn, bn, cols) * scale.unsqueeze(-2)
    elif expand_dim == -2:
        blocked = value * scale.repeat_interleave(bk, dim=-1)[..., :cols]
    else:
        blocked = value * scale.repeat_interleave(bn, dim=-2)[..., :rows, :]
    return blocked.view(weight.shape).to(dtype)


@functools.cache
def fp8_values(device: torch.device) -> torch.Tensor:  # [256] float32
    """Every float8_e4m3fn byte's value (NaN for its two NaN codes), once per device."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # [256] uint8
    return codes.view(FP8_DTYPE).to(torch.float32).to(device)


def fp8_linear(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [R, C] float8_e4m3fn
    scale: torch.Tensor,  # expanded scale, float32
    block_size: tuple[int, int],
    expand_dim: int,
    bias: torch.Tensor | None = None,  # [R]
    block_scale: torch.Tensor | None = None,  # [R / 128, ceil_4(C / 128)] float32, see below
) -> torch.Tensor:  # [T, R] in x.dtype
    """x · weightᵀ + bias: the one seam where resident FP8 linears run. Given `block_scale`
    (`scaled_mm_block_scale`: the device has FP8 tensor cores and the weight fits them), one
    `torch._scaled_mm` with 1×128 activation and 128×128 weight block scales (DeepSeek-V3's
    recipe; activations quantized per token and 128 columns); else the weight is dequantized
    for this call only (per layer and step, nothing kept). A fused kernel goes here too."""
    if block_scale is not None and x.dtype in SCALED_MM_DTYPES:
        return scaled_mm_block_linear(x, weight, block_scale, bias)
    return F.linear(
        x, dequantize_fp8_expanded(weight, scale, block_size, expand_dim, x.dtype), bias
    )


SCALED_MM_BLOCK = (128, 128)
SCALED_MM_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and later
SCALED_MM_DTYPES = (torch.bfloat16, torch.float16)


def scaled_mm_block_scale(
    weight: torch.Tensor,  # [R, C] float8_e4m3fn
    scale: torch.Tensor,  # expanded scale, float32
    block_size: tuple[int, int],
    expand_dim: int,
) -> torch.Tensor | None:  # [R / 128, ceil_4(C / 128)] float32
    """The block scales `scaled_mm_block_linear` takes for this weight, or None where it cannot
    run it: not a CUDA device with block-scaled `_scaled_mm` (`scaled_mm_block_supported`),
    blocks other than 128×128, a dimension not a multiple of 128, or rows of one block that do
    not share their scales (parts stacked at a boundary that is not a block's). Reads the scales
    back once: call it once per weight, not per step."""
    rows, cols = weight.shape
    bn, bk = SCALED_MM_BLOCK
    if (
        expand_dim != -2
        or block_size != SCALED_MM_BLOCK
        or rows % bn
        or cols % bk
        or not scaled_mm_block_supported(weight.device)
    ):
        return None
    blocks = scale[::bn].contiguous()  # [R / bn, C / bk] float32
    if not torch.equal(blocks.repeat_interleave(bn, dim=0), scale):
        return None
    return pad_block_scale(blocks)


def pad_block_scale(blocks: torch.Tensor) -> torch.Tensor:  # [R / 128, ceil_4(C / 128)]
    """A weight's block scales [R / 128, C / 128] with their K blocks padded to a multiple of 4
    (with ones): cuBLAS reads the weight's scales with a leading dimension of a multiple of 4
    and, given fewer, multiplies by the wrong scales without an error (measured on an H100:
    products off by 100× at C / 128 = 2 or 5). `scaled_mm_block_linear` passes the padded
    scales whole; the padding is never read against a column of the weight."""
    k_blocks = blocks.shape[1]
    return F.pad(blocks, (0, -k_blocks % 4), value=1.0).contiguous()


def scaled_mm_block_linear(
    x: torch.Tensor,  # [T, C] bfloat16 / float16
    weight: torch.Tensor,  # [R, C] float8_e4m3fn
    block_scale: torch.Tensor,  # [R / 128, ceil_4(C / 128)] float32 (`pad_block_scale`)
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, R] in x.dtype
    """x · weightᵀ in one block-scaled FP8 matmul (CUDA only): x quantized per token and 128
    columns (scales [T, C / 128], outer-dimension-major as cuBLAS wants them), the weight's
    scales transposed to [ceil_4(C / 128), R / 128]. Through `F.scaled_mm` with explicit
    1×128 / 128×128 recipes where torch has it (2.10 and later), else `torch._scaled_mm`,
    which infers the recipes from the scales' shapes."""
    t, cols = x.shape
    bk = SCALED_MM_BLOCK[1]
    padded = -(-t // 16) * 16  # the kernel takes rows in multiples of 16
    xb = F.pad(x, (0, 0, 0, padded - t)).float().view(padded, cols // bk, bk)  # [T', C/bk, bk]
    amax = xb.abs().amax(dim=-1).clamp(min=1e-12)  # [T', C / bk] float32
    x_scale = amax / FP8_MAX  # [T', C / bk] float32
    xq = (xb / x_scale.unsqueeze(-1)).view(padded, cols).to(FP8_DTYPE)  # [T', C] float8
    scale_a = x_scale.t().contiguous().t()  # [T', C / bk], token-major
    scaled_mm = getattr(F, "scaled_mm", None)
    if scaled_mm is not None:
        recipes = F.ScalingType
        out = scaled_mm(
            xq,
            weight.t(),
            scale_a,
            recipes.BlockWise1x128,
            block_scale.t(),
            recipes.BlockWise128x128,
            output_dtype=x.dtype,
        )  # [T', R]
    else:
        out = torch._scaled_mm(
            xq,
            weight.t(),
            scale_a=scale_a,
            scale_b=block_scale.t(),
            out_dtype=x.dtype,
        )  # [T', R]
    out = out[:t]
    return out if bias is None else out + bias


@functools.cache
def scaled_mm_block_supported(device: torch.device) -> bool:
    """Whether `scaled_mm_block_linear` runs, and is right, on `device`: CUDA with compute
    capability >= 8.9 and a torch whose `_scaled_mm` takes 1×128 / 128×128 block scales, checked
    once per device against dequantization on small problems of 2, 4 and 5 K blocks (cuBLAS
    pads the weight's scales to 4 blocks; an older torch that passes them unpadded computes
    garbage without an error), off with a log line if any is wrong."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) < SCALED_MM_MIN_CAPABILITY:
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    for rows, cols in SCALED_MM_PROBE_SHAPES:
        x = torch.randn(rows, cols, device=device, generator=gen).to(torch.bfloat16)  # [T, C]
        value = torch.randn(256, cols, device=device, generator=gen)  # [256, C] float32
        weight, scale_inv = quantize_fp8(value, SCALED_MM_BLOCK)
        try:
            got = scaled_mm_block_linear(x, weight, pad_block_scale(scale_inv)).float()
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.info(
                "FP8 block-scaled _scaled_mm unavailable on %s (%s); dequantizing", device, exc
            )
            return False
        want = x.float() @ dequantize_fp8(weight, scale_inv, SCALED_MM_BLOCK, torch.float32).t()
        error = float((got - want).abs().max() / want.abs().max())
        if error > SCALED_MM_PROBE_TOLERANCE:
            logger.warning(
                "FP8 block-scaled _scaled_mm on %s is off by %.3g of the largest value at "
                "%d × %d; dequantizing",
                device,
                error,
                rows,
                cols,
            )
            return False
    return True


SCALED_MM_PROBE_SHAPES = ((16, 256), (7, 512), (16, 640))
"""(tokens, columns) of the probe's products: 2, 4 and 5 blocks of 128 columns."""
# FP8 activations carry 3 mantissa bits: about 2^-4 relative error per value, far less summed.
SCALED_MM_PROBE_TOLERANCE = 0.05
