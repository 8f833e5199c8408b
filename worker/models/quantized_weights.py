"""Quantized checkpoints stay quantized in memory: `keep_quantized` turns, on a model built on the
meta device, every parameter the checkpoint stores quantized into the form it is stored in, so
that the loader copies the checkpoint's bytes and nothing is dequantized at load.

    MXFP4 expert [E, K, N]  → <name>_blocks [E, N, G, 16] uint8 + <name>_scales [E, N, G] uint8
    FP8 weight   [..., R, C] → <name> float8_e4m3fn + <name>_scale_inv float32, the block scales
                               expanded along one dimension (see `fp8.expanded_scale_shape`)

What is converted is what transformers converts: MoE experts (MXFP4 or FP8) and the linear
projections (FP8), unless `modules_to_not_convert` names them. Experts are dequantized per layer
and step, only those a batch selects (`BatchedExperts.expert_weight`); FP8 linears run through
`fp8.fp8_linear` (block-scaled `_scaled_mm` where the device has one, else dequantized per call).

Tensor parallelism: each rank holds its shard of the stored form. A cut along N (MXFP4) or
along the expanded dimension (FP8) is exact. An MXFP4 cut along K keeps the 32-value groups
that cover the rank's K range, both edge groups whole (a group's values share one scale), and
drops the rows outside after dequantizing:

    K rows    [k0, k1)                       this rank's share
    groups    [k0 // 32, ceil(k1 / 32))      held: [g0 · 32, g1 · 32) dequantized
    kept      [k0 - 32 · g0, k1 - 32 · g0)   of the dequantized rows
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from swaserve.proto.kv_rules import cdiv
from swaserve.worker.models.fp8 import (
    FP8_DTYPE,
    dequantize_fp8_expanded,
    expanded_scale_shape,
    fp8_linear,
    scaled_mm_block_scale,
)
from swaserve.worker.models.layers import BatchedExperts
from swaserve.worker.models.mxfp4 import (
    BYTES_PER_BLOCK,
    VALUES_PER_BLOCK,
    dequantize_mxfp4,
    mxfp4_shapes,
)
from swaserve.worker.models.param_shard import ParamShard
from swaserve.worker.models.quantization import FP8, MXFP4, QuantizationConfig
from swaserve.worker.models.tp_layers import ColumnParallelLinear, RowParallelLinear
from swaserve.worker.models.weight_sources import FP8_SCALE, MXFP4_BLOCKS, MXFP4_SCALES
from swaserve.worker.runner.parallel import TPGroup


@dataclass(frozen=True, slots=True)
class Mxfp4Weight:
    """Parameter `name` [E, K_r, N_r] of a module, held as its MXFP4 blocks and scales; the
    dequantized groups' rows [k_offset, k_offset + k_size) are this rank's K rows."""

    name: str
    k_offset: int
    k_size: int
    dtype: torch.dtype

    def dequantize(self, module: nn.Module, experts: torch.Tensor | None) -> torch.Tensor:
        blocks = getattr(module, self.name + MXFP4_BLOCKS)  # [E, N, G, 16] uint8
        scales = getattr(module, self.name + MXFP4_SCALES)  # [E, N, G] uint8
        if experts is not None:
            blocks, scales = blocks[experts], scales[experts]  # [n, N, G, 16], [n, N, G]
        value = dequantize_mxfp4(blocks, scales, self.dtype)  # [n, G·32, N]
        if self.k_offset == 0 and value.shape[-2] == self.k_size:
            return value
        return value[:, self.k_offset : self.k_offset + self.k_size]


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """Parameter `name` [..., R, C] of a module, held in float8_e4m3fn with its block scales
    `<name>_scale_inv` expanded along `expand_dim`."""

    name: str
    block_size: tuple[int, int]
    expand_dim: int  # -2 or -1
    dtype: torch.dtype

    def dequantize(self, module: nn.Module, experts: torch.Tensor | None = None) -> torch.Tensor:
        weight = getattr(module, self.name)  # [..., R, C] float8_e4m3fn
        scale = getattr(module, self.name + FP8_SCALE)  # expanded, float32
        if experts is not None:
            weight, scale = weight[experts], scale[experts]
        return dequantize_fp8_expanded(weight, scale, self.block_size, self.expand_dim, self.dtype)


QuantizedWeight = Mxfp4Weight | Fp8Weight


class Fp8Linear(nn.Module):
    """A column- or row-parallel linear whose weight stays in FP8 (`fp8.fp8_linear`); same
    parameter names (weight, bias) and shards as the layer it replaces, plus
    `weight_scale_inv`. Row-parallel: partial outputs all-reduced, the bias added once after."""

    def __init__(
        self, linear: ColumnParallelLinear | RowParallelLinear, block_size: tuple[int, int]
    ) -> None:
        super().__init__()
        weight = linear.weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tp: TPGroup | None = linear.tp if isinstance(linear, RowParallelLinear) else None
        self.param_shards: dict[str, ParamShard] = dict(linear.param_shards)
        shard = self.param_shards.get("weight")
        fp8 = Fp8Weight("weight", block_size, _expand_dim(shard, weight.dim()), weight.dtype)
        self.quantized: dict[str, QuantizedWeight] = {"weight": fp8}
        self.weight = _stored(weight.shape, FP8_DTYPE)  # [O_r, I_r] float8_e4m3fn
        scale_shape = expanded_scale_shape(tuple(weight.shape), block_size, fp8.expand_dim)
        self.weight_scale_inv = _stored(scale_shape, torch.float32)
        if shard is not None and not shard.is_whole:
            self.param_shards["weight" + FP8_SCALE] = _fp8_scale_shard(shard, fp8)
        self.bias = linear.bias
        self._block_scale: torch.Tensor | None = None  # for `_scaled_mm`; found at first use
        self._block_scale_known = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8 = self.quantized["weight"]
        assert isinstance(fp8, Fp8Weight)
        if not self._block_scale_known:
            self._block_scale = scaled_mm_block_scale(
                self.weight, self.weight_scale_inv, fp8.block_size, fp8.expand_dim
            )
            self._block_scale_known = True
        reduces = self.tp is not None and self.tp.world_size > 1
        y = fp8_linear(
            x,
            self.weight,
            self.weight_scale_inv,
            fp8.block_size,
            fp8.expand_dim,
            None if reduces else self.bias,
            self._block_scale,
        )
        if not reduces:
            return y
        assert self.tp is not None
        y = self.tp.all_reduce(y)  # [T, O], summed over ranks
        return y if self.bias is None else y + self.bias


def keep_quantized(model: nn.Module, quantization: QuantizationConfig) -> list[str]:
    """Give every parameter of meta-built `model` that the checkpoint stores quantized its
    stored form (see the module docstring); returns the converted parameter names. Raises
    `ValueError` for a TP cut it cannot hold quantized (MXFP4 over experts or a padded dim)."""
    converted: list[str] = []
    for name, module in list(model.named_modules()):
        if isinstance(module, BatchedExperts):
            for key in module.expert_weight_names:
                if quantization.converts(f"{name}.{key}"):
                    _quantize_expert(module, key, quantization)
                    converted.append(f"{name}.{key}")
        elif (
            quantization.method == FP8
            and isinstance(module, ColumnParallelLinear | RowParallelLinear)
            and quantization.converts(name)
        ):
            parent_name, _, child = name.rpartition(".")
            block = _fp8_block(quantization)
            setattr(model.get_submodule(parent_name), child, Fp8Linear(module, block))
            converted.append(f"{name}.weight")
    return converted


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of `model`, each tensor once (a tied LM head is the
    embedding): what its weights hold in memory (on the meta device: what they will)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.nbytes
    return total


def _fp8_block(quantization: QuantizationConfig) -> tuple[int, int]:
    assert quantization.weight_block_size is not None, "parse_quantization_config sets it"
    return quantization.weight_block_size


def _quantize_expert(module: BatchedExperts, key: str, quantization: QuantizationConfig) -> None:
    weight = getattr(module, key)  # [E, K_r, N_r] (meta)
    shard = module.param_shards.get(key)
    if shard is not None and shard.is_padded:
        raise ValueError(f"{type(module).__name__}.{key}: a padded shard cannot stay quantized")
    delattr(module, key)
    module.param_shards.pop(key, None)
    if quantization.method == MXFP4:
        mx, blocks_shape, scales_shape, shards = _mxfp4_layout(key, weight, shard)
        module.quantized[key] = mx
        setattr(module, key + MXFP4_BLOCKS, _stored(blocks_shape, torch.uint8))
        setattr(module, key + MXFP4_SCALES, _stored(scales_shape, torch.uint8))
        module.param_shards.update(shards)
        return
    fp8 = Fp8Weight(key, _fp8_block(quantization), _expand_dim(shard, weight.dim()), weight.dtype)
    module.quantized[key] = fp8
    setattr(module, key, _stored(weight.shape, FP8_DTYPE))
    scale_shape = expanded_scale_shape(tuple(weight.shape), fp8.block_size, fp8.expand_dim)
    setattr(module, key + FP8_SCALE, _stored(scale_shape, torch.float32))
    if shard is not None and not shard.is_whole:
        module.param_shards[key] = shard
        module.param_shards[key + FP8_SCALE] = _fp8_scale_shard(shard, fp8)


def _mxfp4_layout(
    key: str, weight: torch.Tensor, shard: ParamShard | None
) -> tuple[Mxfp4Weight, tuple[int, ...], tuple[int, ...], dict[str, ParamShard]]:
    """(how to dequantize, local blocks shape, local scales shape, their shards) of the MXFP4
    form of expert parameter `weight` [E, K_r, N_r] cut by `shard` (see the module docstring)."""
    *lead, k_local, n_local = weight.shape
    nd = weight.dim()
    if shard is None or shard.is_whole:
        blocks, scales = mxfp4_shapes(tuple(weight.shape))
        return Mxfp4Weight(key, 0, k_local, weight.dtype), blocks, scales, {}
    full_blocks, full_scales = mxfp4_shapes(shard.full_shape)
    k_full = shard.full_shape[-2]
    if k_full % VALUES_PER_BLOCK:
        raise ValueError(f"{key}: MXFP4 needs K = {k_full} to be a multiple of 32")
    if shard.dim == nd - 1:  # N: blocks and scales cut along their N dim, exactly
        blocks_shard = ParamShard(full_blocks, nd - 2, shard.segments, shard.local_size)
        scales_shard = ParamShard(full_scales, nd - 2, shard.segments, shard.local_size)
        blocks, scales = mxfp4_shapes((*lead, k_local, n_local))
        mx = Mxfp4Weight(key, 0, k_local, weight.dtype)
    elif shard.dim == nd - 2 and len(shard.segments) == 1:  # K: the groups that cover it
        ((k0, k1),) = shard.segments
        g0, g1 = k0 // VALUES_PER_BLOCK, cdiv(k1, VALUES_PER_BLOCK)
        blocks_shard = ParamShard(full_blocks, nd - 1, ((g0, g1),), g1 - g0)
        scales_shard = ParamShard(full_scales, nd - 1, ((g0, g1),), g1 - g0)
        blocks = (*lead, n_local, g1 - g0, BYTES_PER_BLOCK)
        scales = (*lead, n_local, g1 - g0)
        mx = Mxfp4Weight(key, k0 - g0 * VALUES_PER_BLOCK, k1 - k0, weight.dtype)
    else:
        raise ValueError(f"{key}: MXFP4 experts cannot stay quantized under the cut {shard}")
    return mx, blocks, scales, {key + MXFP4_BLOCKS: blocks_shard, key + MXFP4_SCALES: scales_shard}


def _expand_dim(shard: ParamShard | None, ndim: int) -> int:
    """The scale of an FP8 weight is expanded along the dimension a TP rank cuts, or the rows."""
    if shard is None or shard.is_whole:
        return -2
    dim = shard.dim - ndim
    if dim not in (-2, -1):
        raise ValueError(f"an FP8 weight cut along dim {shard.dim} cannot stay quantized")
    return dim


def _fp8_scale_shard(shard: ParamShard, fp8: Fp8Weight) -> ParamShard:
    """The expanded scale's shard: the weight's cut, along the same (expanded) dimension."""
    full = expanded_scale_shape(shard.full_shape, fp8.block_size, fp8.expand_dim)
    return ParamShard(full, shard.dim, shard.segments, shard.local_size)


def _stored(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> nn.Parameter:
    """A parameter of the stored form, on the meta device (the model is materialized later)."""
    return nn.Parameter(torch.empty(tuple(shape), dtype=dtype, device="meta"), requires_grad=False)
