"""Where one parameter (or one slice of it) comes from in a checkpoint: a plain tensor, an FP8
block-scaled pair, an MXFP4 blocks/scales pair, or (for a weight kept in FP8) the block scales
expanded as the resident weight holds them. Each source checks its header entries against
the parameter before any data is read (`check`), then fills the parameter (`read_into`),
one leading index (one expert) at a time for 3-D and larger tensors, so that peak host memory
stays near one expert's tensor however large the checkpoint.

A TP rank passes `region` (one slice per dimension, in the parameter's dequantized coordinates;
see `param_shard.py`) and reads only that part: plain tensors as a safetensors slice, FP8 and
MXFP4 as the slice of the blocks that cover the region (dequantization is elementwise, so the
values are those of the whole tensor's dequantization). A parameter kept quantized reads its
stored tensors as `PlainSource`s of that exact dtype, cut along the stored form's dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.proto.kv_rules import cdiv
from swaserve.worker.models.checkpoint import Checkpoint, TensorInfo
from swaserve.worker.models.errors import QuantizedTensorError, TensorShapeError
from swaserve.worker.models.fp8 import dequantize_fp8, expanded_scale_shape, fp8_scale_shape
from swaserve.worker.models.mxfp4 import (
    BYTES_PER_BLOCK,
    VALUES_PER_BLOCK,
    dequantize_mxfp4,
    mxfp4_shapes,
)
from swaserve.worker.models.param_shard import Region
from swaserve.worker.models.quantization import (
    DEFAULT_FP8_BLOCK_SIZE,
    FP8,
    MXFP4,
    QuantizationConfig,
)

MXFP4_BLOCKS, MXFP4_SCALES, FP8_SCALE = "_blocks", "_scales", "_scale_inv"
FLOAT8_DTYPES = ("F8_E4M3", "F8_E5M2")
FP8_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")


def _where(info: TensorInfo) -> str:
    return f"tensor {info.name!r} in {info.path.name}"


def _check_shape(info: TensorInfo, expected: tuple[int, ...]) -> None:
    if info.shape != expected:
        raise TensorShapeError(f"{_where(info)}: expected shape {expected}, got {info.shape}")


def _rows(shape: torch.Size | tuple[int, ...], region: Region | None = None) -> range | None:
    """Leading indices of the tensor to stream over (None: read whole)."""
    if len(shape) < 3:
        return None
    return range(shape[0]) if region is None else range(region[0].start, region[0].stop)


@dataclass(frozen=True, slots=True)
class PlainSource:
    """A tensor copied (and cast) as it is. `stored_dtype`: the parameter holds the checkpoint's
    own bytes (a quantized tensor kept quantized), so the tensor must be of exactly that dtype."""

    info: TensorInfo
    stored_dtype: str | None = None  # safetensors' dtype name, e.g. "F8_E4M3", "U8"

    @property
    def names(self) -> tuple[str, ...]:
        return (self.info.name,)

    @property
    def num_bytes(self) -> int:
        return self.info.num_bytes

    def check(self, expected: tuple[int, ...]) -> None:
        if self.stored_dtype is not None:
            if self.info.dtype != self.stored_dtype:
                raise QuantizedTensorError(
                    f"{_where(self.info)}: kept quantized, so it must be {self.stored_dtype}, "
                    f"got {self.info.dtype}"
                )
        elif self.info.dtype in FLOAT8_DTYPES:
            raise QuantizedTensorError(
                f"{_where(self.info)} is {self.info.dtype} but has no {self.info.name + FP8_SCALE!r} "
                "(or config.json has no fp8 quantization_config, or lists it in modules_to_not_convert)"
            )
        _check_shape(self.info, expected)

    def read_into(
        self, out: torch.Tensor, checkpoint: Checkpoint, region: Region | None = None
    ) -> None:
        name = self.info.name
        rows = _rows(out.shape, region)
        if rows is None:
            out.copy_(checkpoint.read(name, region))
            return
        for i, e in enumerate(rows):
            out[i].copy_(checkpoint.read(name, e if region is None else (e, *region[1:])))


@dataclass(frozen=True, slots=True)
class Fp8Source:
    weight: TensorInfo
    scale_inv: TensorInfo
    block_size: tuple[int, int]

    @property
    def names(self) -> tuple[str, ...]:
        return (self.weight.name, self.scale_inv.name)

    @property
    def num_bytes(self) -> int:
        return self.weight.num_bytes + self.scale_inv.num_bytes

    def check(self, expected: tuple[int, ...]) -> None:
        _check_shape(self.weight, expected)
        if self.weight.dtype != "F8_E4M3":
            raise QuantizedTensorError(
                f"{_where(self.weight)}: an fp8 weight must be F8_E4M3, got {self.weight.dtype}"
            )
        want = fp8_scale_shape(expected, self.block_size)
        if self.scale_inv.shape != want:
            raise QuantizedTensorError(
                f"{_where(self.scale_inv)}: expected block scales of shape {want} (weight "
                f"{expected} in blocks of {self.block_size}), got {self.scale_inv.shape}"
            )
        if self.scale_inv.dtype not in FP8_SCALE_DTYPES:
            raise QuantizedTensorError(
                f"{_where(self.scale_inv)}: scales must be one of {FP8_SCALE_DTYPES}, "
                f"got {self.scale_inv.dtype}"
            )

    def read_into(
        self, out: torch.Tensor, checkpoint: Checkpoint, region: Region | None = None
    ) -> None:
        rows = _rows(out.shape, region)
        if rows is None:
            out.copy_(self._read(checkpoint, (), region, out.dtype))
            return
        for i, e in enumerate(rows):
            part = None if region is None else region[1:]
            out[i].copy_(self._read(checkpoint, (e,), part, out.dtype))

    def _read(
        self,
        checkpoint: Checkpoint,
        lead: tuple[int, ...],
        region: Region | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # [R, C] in dtype (or the region's rows and columns)
        """weight[lead][region] dequantized, reading only the blocks that cover the region:

        # rows  [r0 // bn · bn, r1)  read (block-aligned start), scales [r0 // bn, ceil(r1 / bn))
        # rows  [r0, r1)            kept
        """
        w, s = self.weight.name, self.scale_inv.name
        if region is None:
            index = lead or None
            return dequantize_fp8(
                checkpoint.read(w, index), checkpoint.read(s, index), self.block_size, dtype
            )
        (bn, bk), (rows, cols) = self.block_size, region
        br, bc = rows.start // bn, cols.start // bk
        weight = checkpoint.read(w, (*lead, slice(br * bn, rows.stop), slice(bc * bk, cols.stop)))
        scale = checkpoint.read(
            s, (*lead, slice(br, cdiv(rows.stop, bn)), slice(bc, cdiv(cols.stop, bk)))
        )
        value = dequantize_fp8(weight, scale, self.block_size, dtype)
        return value[rows.start - br * bn :, cols.start - bc * bk :]


@dataclass(frozen=True, slots=True)
class Mxfp4Source:
    blocks: TensorInfo
    scales: TensorInfo

    @property
    def names(self) -> tuple[str, ...]:
        return (self.blocks.name, self.scales.name)

    @property
    def num_bytes(self) -> int:
        return self.blocks.num_bytes + self.scales.num_bytes

    def check(self, expected: tuple[int, ...]) -> None:
        want_blocks, want_scales = mxfp4_shapes(expected)
        got = self.blocks.shape
        if len(expected) < 3 or expected[-2] % (2 * BYTES_PER_BLOCK):
            raise QuantizedTensorError(
                f"{_where(self.blocks)}: MXFP4 stores [experts, K, N] parameters with K a "
                f"multiple of 32; the parameter is {expected}"
            )
        if self.blocks.dtype != "U8" or self.scales.dtype != "U8":
            raise QuantizedTensorError(
                f"{_where(self.blocks)}: MXFP4 blocks and scales must be U8, got "
                f"{self.blocks.dtype} and {self.scales.dtype}"
            )
        if (
            len(got) == len(want_blocks)
            and got[:-2] == want_blocks[:-2]
            and got[-1] == want_blocks[-1]
        ):
            if got[-2] != want_blocks[-2]:
                raise QuantizedTensorError(
                    f"{_where(self.blocks)}: {got[-2]} blocks of 32 values per row, but the "
                    f"parameter {expected} needs {want_blocks[-2]} (K = {expected[-2]})"
                )
        elif got != want_blocks:
            raise TensorShapeError(
                f"{_where(self.blocks)}: expected MXFP4 blocks of shape {want_blocks} for the "
                f"parameter {expected}, got {got}"
            )
        if self.scales.shape != want_scales:
            raise QuantizedTensorError(
                f"{_where(self.scales)}: expected one scale per block, shape {want_scales}, "
                f"got {self.scales.shape}"
            )

    def read_into(
        self, out: torch.Tensor, checkpoint: Checkpoint, region: Region | None = None
    ) -> None:
        """One expert at a time; with a region [experts, K, N], only its N rows of blocks and
        the groups of 32 that cover its K range:

        # K  [k0 // 32 · 32, ceil(k1 / 32) · 32)  dequantized, [k0, k1) kept
        """
        rows = range(out.shape[0]) if region is None else range(region[0].start, region[0].stop)
        for i, e in enumerate(rows):
            if region is None:
                blocks = checkpoint.read(self.blocks.name, e)  # [N, G, 16] uint8
                scales = checkpoint.read(self.scales.name, e)  # [N, G] uint8
                out[i].copy_(dequantize_mxfp4(blocks, scales, out.dtype))
                continue
            k, n = region[1], region[2]
            g0, g1 = k.start // VALUES_PER_BLOCK, cdiv(k.stop, VALUES_PER_BLOCK)
            blocks = checkpoint.read(self.blocks.name, (e, n, slice(g0, g1)))  # [n, g, 16] uint8
            scales = checkpoint.read(self.scales.name, (e, n, slice(g0, g1)))  # [n, g] uint8
            value = dequantize_mxfp4(blocks, scales, out.dtype)  # [g · 32, n]
            first = g0 * VALUES_PER_BLOCK
            out[i].copy_(value[k.start - first : k.stop - first])


@dataclass(frozen=True, slots=True)
class Fp8ScaleSource:
    """The block scales of an FP8 weight, read into the resident scale of a weight kept in FP8:
    expanded along `expand_dim` (`fp8.expanded_scale_shape`). A region (in the resident scale's
    coordinates) reads only the blocks that cover it:

    # expanded dim  [r0, r1)  ← scale blocks [r0 // b, ceil(r1 / b)), repeated b times, cut
    """

    weight: TensorInfo
    scale_inv: TensorInfo
    block_size: tuple[int, int]
    expand_dim: int  # -2 or -1

    @property
    def names(self) -> tuple[str, ...]:
        return (self.scale_inv.name,)

    @property
    def num_bytes(self) -> int:
        return self.scale_inv.num_bytes

    def check(self, expected: tuple[int, ...]) -> None:
        Fp8Source(self.weight, self.scale_inv, self.block_size).check(self.weight.shape)
        want = expanded_scale_shape(self.weight.shape, self.block_size, self.expand_dim)
        if want != tuple(expected):
            raise TensorShapeError(
                f"{_where(self.weight)}: its scales expand to {want}, the parameter's to {expected}"
            )

    def read_into(
        self, out: torch.Tensor, checkpoint: Checkpoint, region: Region | None = None
    ) -> None:
        rows = _rows(out.shape, region)
        if rows is None:
            out.copy_(self._read(checkpoint, (), region))
            return
        for i, e in enumerate(rows):
            out[i].copy_(self._read(checkpoint, (e,), None if region is None else region[1:]))

    def _read(
        self, checkpoint: Checkpoint, lead: tuple[int, ...], region: Region | None
    ) -> torch.Tensor:  # the expanded scale (of the region), float32
        dim = self.expand_dim
        size = self.weight.shape[dim]
        block = self.block_size[0] if dim == -2 else self.block_size[1]
        cut = slice(0, size) if region is None else region[dim]
        b0, b1 = cut.start // block, cdiv(cut.stop, block)
        blocked = slice(None) if region is None else region[-1 if dim == -2 else -2]
        index = (*lead, slice(b0, b1), blocked) if dim == -2 else (*lead, blocked, slice(b0, b1))
        scale = checkpoint.read(self.scale_inv.name, index).to(torch.float32)
        expanded = scale.repeat_interleave(block, dim=dim)
        return expanded.narrow(dim, cut.start - b0 * block, cut.stop - cut.start)


Source = PlainSource | Fp8Source | Mxfp4Source | Fp8ScaleSource


def resolve_source(
    name: str, checkpoint: Checkpoint, quantization: QuantizationConfig | None
) -> Source | None:
    """How checkpoint tensor `name` is stored, or None when it is not there in any form."""
    tensors = checkpoint.tensors
    module = name.removesuffix(".weight")
    converts = quantization is not None and quantization.converts(module)
    if converts and quantization.method == MXFP4 and name + MXFP4_BLOCKS in tensors:
        blocks = tensors[name + MXFP4_BLOCKS]
        scales = tensors.get(name + MXFP4_SCALES)
        if scales is None:
            raise QuantizedTensorError(
                f"{_where(blocks)} has no {name + MXFP4_SCALES!r} (the MXFP4 block exponents)"
            )
        return Mxfp4Source(blocks, scales)
    if converts and quantization.method == FP8 and name + FP8_SCALE in tensors and name in tensors:
        block = quantization.weight_block_size or DEFAULT_FP8_BLOCK_SIZE
        return Fp8Source(tensors[name], tensors[name + FP8_SCALE], block)
    if name in tensors:
        return PlainSource(tensors[name])
    return None
