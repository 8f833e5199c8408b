"""Linear weights held a second time, prepacked for oneDNN, for the compiled CPU decode step.

A CPU GEMM with few rows (a decode batch) spends most of its time reordering the weight into
the blocked layout its micro-kernel reads. MKL, behind `F.linear` and `bmm`, does that on every
call; oneDNN does it once (`torch.ops.mkldnn._reorder_linear_weight`) and then runs
`_linear_pointwise` over the blocked copy. On the decode bench's 2-core CPU, [8, 256] ×
[256, 2048] takes 46 µs against 201 µs through `F.linear`; [24, 1024] × [1024, 256] 42 against
115 µs. The compiled decode step's MoE runs as two such GEMMs over all of a layer's experts at
once (`BatchedExperts.forward_prepacked`), and its dense projections too.

The blocked copy is an opaque oneDNN tensor: torch.compile cannot take it as a graph input,
and inductor makes such copies itself only for weights frozen into the graph, which its on-disk
caches then skip (no cached start). So the step calls the op `swaserve::prepacked_linear(x,
source, bias, out_features)` instead: `source` is the parameter the copy was made from (a graph
input like every weight, read for nothing but its address) and the op's kernel runs oneDNN over
the copy held for it (`pack`). Once our C++ kernels are built (`attention/cpu_kernels.py`, when a
compiled step is made) the step calls their `swaserve::prepacked_linear_native` instead, which
finds the copy and calls oneDNN without Python (`use_native`: the copies are mirrored there);
through the Python kernel a call cost about 12 µs more (25 per step of the decode bench).

Only the static step uses the copies (`Prepackable.prepacked` and `in_static_step`): prefill
and mixed steps keep MKL over the parameters, so the copies add their bytes to the weights
(`ModelRunner.weight_bytes`). Float32 weights on CPU only (`available`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.worker.models.static_step import in_static_step

PACK_BATCH_ROWS = 16
"""The row count oneDNN picks the blocked layout for (any count runs; 8 to 64 pick the same
layout on the bench's CPU, 1 a slower one for larger batches)."""


@dataclass(slots=True)
class _Held:
    source: weakref.ref[torch.Tensor]
    shape: torch.Size  # the source's
    packed: torch.Tensor  # opaque oneDNN tensor of the [out_features, in_features] weight
    out_features: int


_HELD: dict[int, _Held] = {}  # source data_ptr → its copy, while the source lives
_NATIVE = [False]  # the C++ op is loaded and mirrors `_HELD` (`use_native`)


def available(weight: torch.Tensor) -> bool:
    """Whether this torch can hold `weight` prepacked: float32 on CPU, oneDNN built in."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(source: torch.Tensor, weight: torch.Tensor) -> int:
    """Hold a prepacked copy of `weight` ([out_features, in_features]: a view or rearranged
    copy of `source`'s values) for `source`, until `source` is freed; `prepacked_linear(x,
    source, ...)` then computes `x @ weight.T`. Returns the bytes the copy holds. `source` must
    not change afterwards (the copy would not follow)."""
    if not available(weight):
        raise ValueError(
            f"a prepacked weight must be float32 on CPU with oneDNN, got {weight.dtype} on "
            f"{weight.device} (oneDNN available: {torch.backends.mkldnn.is_available()})"
        )
    if weight.dim() != 2:
        raise ValueError(f"a prepacked weight is [out_features, in_features], got {weight.shape}")
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_ROWS)
    key = source.data_ptr()

    def forget(_: object, key: int = key) -> None:
        held = _HELD.get(key)
        if held is not None and held.source() is None:
            _release(key)

    _HELD[key] = _Held(weakref.ref(source, forget), source.shape, packed, weight.shape[0])
    if _NATIVE[0]:
        torch.ops.swaserve.hold_prepacked(source, packed, weight.shape[0])
    return weight.numel() * weight.element_size()


def drop(source: torch.Tensor) -> None:
    """Forget the copy held for `source` (a static step over it then raises)."""
    _release(source.data_ptr())


def _release(key: int) -> None:
    """Drop the copy held at `key` here and in the C++ op's mirror."""
    if _HELD.pop(key, None) is not None and _NATIVE[0]:
        torch.ops.swaserve.forget_prepacked(key)


def use_native() -> None:
    """The C++ op is loaded (`cpu_kernels.load`): mirror the copies held into it, and from now
    on every copy made or forgotten; `prepacked_linear` calls it."""
    if _NATIVE[0]:
        return
    torch.library.register_fake("swaserve::prepacked_linear_native")(_prepacked_linear_fake)
    for held in list(_HELD.values()):
        source = held.source()
        if source is not None:
            torch.ops.swaserve.hold_prepacked(source, held.packed, held.out_features)
    _NATIVE[0] = True


def _held(source: torch.Tensor) -> _Held | None:
    """The entry of `source`: at its address, for a live tensor of its shape (a view at the same
    address, or a tensor since freed, is not its source)."""
    held = _HELD.get(source.data_ptr())
    if held is None or held.source() is None or held.shape != source.shape:
        return None
    return held


def held_for(source: torch.Tensor) -> torch.Tensor | None:
    """The prepacked copy held for `source`, or None."""
    held = _held(source)
    return None if held is None else held.packed


_LIB = torch.library.Library("swaserve", "FRAGMENT")
_LIB.define("prepacked_linear(Tensor x, Tensor source, Tensor? bias, int out_features) -> Tensor")


def _prepacked_linear_cpu(
    x: torch.Tensor, source: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    held = _held(source)
    if held is None:
        raise RuntimeError(
            f"swaserve::prepacked_linear: no prepacked weight is held for the {source.shape} "
            "tensor it was given (pack() it first)"
        )
    if held.out_features != out_features:
        raise RuntimeError(
            f"swaserve::prepacked_linear: the copy held has {held.out_features} output "
            f"features, the call asks for {out_features}"
        )
    if x.numel() == 0:
        return _prepacked_linear_fake(x, source, bias, out_features)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), held.packed, bias, "none", [], "")


_LIB.impl("prepacked_linear", _prepacked_linear_cpu, "CPU")


@torch.library.register_fake("swaserve::prepacked_linear", lib=_LIB)
def _prepacked_linear_fake(
    x: torch.Tensor, source: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def prepacked_linear(
    x: torch.Tensor,  # [..., in_features]
    source: torch.Tensor,
    bias: torch.Tensor | None,  # [out_features]
    out_features: int,
) -> torch.Tensor:  # [..., out_features]
    """`x @ W.T + bias` for the weight W held prepacked for `source` (`pack`)."""
    if _NATIVE[0]:
        return torch.ops.swaserve.prepacked_linear_native(x, source, bias, out_features)
    return torch.ops.swaserve.prepacked_linear(x, source, bias, out_features)


class Prepackable(nn.Module):
    """A linear layer (`weight` [out_features, in_features], `bias` or None) whose forward may
    run over a prepacked copy of its weight in the static step: `prepack_weights()` makes the
    copy and sets `prepacked`."""

    weight: nn.Parameter
    prepacked = False

    def prepack_weights(self) -> int:
        """Hold the weight prepacked (when `available`); the bytes that adds (0 for a weight
        already held, e.g. tied)."""
        if not available(self.weight):
            return 0
        added = 0 if held_for(self.weight) is not None else pack(self.weight, self.weight)
        self.prepacked = True
        return added

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`F.linear(x, weight, bias)`; over the prepacked copy in the static step of more
        than one token (inductor's own loops are faster for one row)."""
        if self.prepacked and in_static_step() and x.shape[0] > 1:
            return prepacked_linear(x, self.weight, bias, self.weight.shape[0])
        return F.linear(x, self.weight, bias)
