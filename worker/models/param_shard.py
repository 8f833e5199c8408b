"""`ParamShard`: which part of a full (unsharded) parameter one TP rank holds, and how the pieces
of a checkpoint tensor land in it.

A sharded parameter is cut along one dimension `dim`. Along it, the local tensor is the
concatenation of the full tensor's `segments` (half-open, in order), then zero padding up to
`local_size` (a vocabulary that does not split evenly):

    full  dim: [0 ............................................ size)
                  [s0, e0)              [s1, e1)
    local dim: [0, e0 - s0)[e0 - s0, e0 - s0 + e1 - s1)[padding, zero)

One segment is an even split or a KV head; two are a fused projection cut per part (MiMo's
gate|up rows: rank r holds its gate rows and its up rows). A layer keeps its shards in
`param_shards` (parameter name within the module → `ParamShard`), which the loader reads: it
plans every parameter at its full shape, so every layout a `WeightMap` declares (packed,
original, MXFP4, FP8) shards the same way, and asks `pieces` where each checkpoint tensor's part
goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A Placement's index into the full parameter: ints and slices over the leading dims.
Index = tuple[int | slice, ...]
# A region of one checkpoint tensor, in the parameter's (dequantized) coordinates: one slice per
# dimension of the tensor, with explicit start and stop.
Region = tuple[slice, ...]


@dataclass(frozen=True, slots=True)
class ParamShard:
    """Rank's part of a parameter of `full_shape`: `segments` of dimension `dim`, padded with
    zeros to `local_size`."""

    full_shape: tuple[int, ...]
    dim: int
    segments: tuple[tuple[int, int], ...]
    local_size: int

    def __post_init__(self) -> None:
        held = sum(end - start for start, end in self.segments)
        if held > self.local_size or any(
            not 0 <= start <= end <= self.full_shape[self.dim] for start, end in self.segments
        ):
            raise ValueError(f"bad shard {self} of a parameter of shape {self.full_shape}")

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = self.local_size
        return tuple(shape)

    @property
    def is_whole(self) -> bool:
        """The rank holds the full parameter as it is (TP = 1, or a replicated parameter)."""
        return (
            self.segments == ((0, self.full_shape[self.dim]),)
            and self.local_size == (self.full_shape[self.dim])
        )

    @property
    def is_padded(self) -> bool:
        """Part of the local tensor is padding, which the loader zero-fills."""
        return sum(end - start for start, end in self.segments) < self.local_size

    def pieces(self, index: Index) -> list[tuple[Index, Region]]:
        """Where the checkpoint tensor that fills `full[index]` goes on this rank: a list of
        (local index, region of that tensor) with `local[local index] = tensor[region]`;
        empty when the rank holds none of it."""
        comps = list(index) + [slice(None)] * (len(self.full_shape) - len(index))
        ranges = [_range(c, size) for c, size in zip(comps, self.full_shape, strict=True)]
        begin, end = ranges[self.dim]
        out: list[tuple[Index, Region]] = []
        offset = 0
        for seg_start, seg_end in self.segments:
            lo, hi = max(seg_start, begin), min(seg_end, end)
            if lo < hi:
                local: list[int | slice] = []
                region: list[slice] = []
                for d, (c, (a, b)) in enumerate(zip(comps, ranges, strict=True)):
                    if isinstance(c, int):
                        local.append(offset + c - seg_start if d == self.dim else c)
                    elif d == self.dim:
                        local.append(slice(offset + lo - seg_start, offset + hi - seg_start))
                        region.append(slice(lo - a, hi - a))
                    else:
                        local.append(slice(a, b))
                        region.append(slice(0, b - a))
                out.append((tuple(local), tuple(region)))
            offset += seg_end - seg_start
        return out


def _range(component: int | slice, size: int) -> tuple[int, int]:
    if isinstance(component, int):
        return component, component + 1
    start, stop, step = component.indices(size)
    if step != 1:
        raise ValueError(f"a placement index must not stride, got {component}")
    return start, stop


def indexed_shape(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    """The shape of `tensor[index]` for a tensor of `shape`, without one."""
    return tuple(torch.empty(shape, device="meta")[index].shape)


def whole_region(shape: tuple[int, ...] | torch.Size) -> Region:
    """The region that covers a tensor of `shape`."""
    return tuple(slice(0, n) for n in shape)
