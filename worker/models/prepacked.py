"""Linear weights held a second time, in panels, for the compiled CPU decode step.

A CPU GEMM with few rows (a decode batch) reads every weight once, so what it costs is how the
weight streams through the vector units. MKL, behind `F.linear` and `bmm`, reorders the weight
into its blocked layout on every call. The copy held here is that layout made once: W [N, K] as
panels [ceil(N / 16), K, 16] (panel p's row k holds W[16p .. 16p + 15, k], zeros past N), which
our C++ kernel (`attention/cpu_prepacked_linear.cpp`) reads in register tiles of up to 8 rows ×
32 outputs, summing each output's K products in order: a row's result does not depend on the
others in the batch. On the decode bench's 2-core CPU it takes [8, 256] × [256, 768] in 19 µs
(oneDNN's prepacked GEMM, which it replaced: 33 µs; `F.linear`: about 4× that). The compiled
decode step's dense projections run over such copies, and its MoE over the stacked experts:
each token through its own experts (`expert_linear`, `expert_linear_in`, with the C++
kernels) or every expert over every token (`BatchedExperts.forward_prepacked`, without).

The graph calls the op `swaserve::prepacked_linear(x, source, bias, out_features)`: `source` is
the parameter the copy was made from (a graph input like every weight, read for nothing but its
address) and the op's kernel runs over the copy held for it (`pack`). Once our C++ kernels are
built (`attention/cpu_kernels.py`: every CPU attention backend loads them) the step calls their
`swaserve::prepacked_linear_native` instead, which finds the copy and runs the panel kernel
without Python (`use_native`: the copies are mirrored there). Without them (no compiler), the
Python kernel multiplies by the panels with `torch.matmul`.

Only the static step uses the copies (`Prepackable.prepacked` and `in_static_step`): prefill
and mixed steps keep MKL over the parameters, so the copies add their bytes to the weights
(`ModelRunner.weight_bytes`). Float32 weights on CPU only (`available`).

A weight whose every value is a bfloat16 value (a checkpoint stored in bfloat16, as the
published GPT-OSS and MiMo-V2-Flash weights are, computed in float32 on CPU) is held in
bfloat16 panels (`panel_dtype`): the kernel widens each value to float32 as it loads it, which
is exact, so the step computes the same products in the same order and returns the same bits,
and it streams half the bytes. The decode bench's batch-8 step reads its weights at about the
memory's speed, so that is where its time goes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.worker.models.static_step import in_static_step

PANEL = 16
"""Output features a panel holds (`cpu_prepacked_linear.cpp`'s kPanel)."""


@dataclass(slots=True)
class _Held:
    source: weakref.ref[torch.Tensor]
    shape: torch.Size  # the source's
    packed: torch.Tensor  # [ceil(out_features / PANEL), in_features, PANEL] the weight's panels
    out_features: int


_HELD: dict[int, _Held] = {}  # source data_ptr → its copy, while the source lives
_NATIVE = [False]  # the C++ op is loaded and mirrors `_HELD` (`use_native`)


def available(weight: torch.Tensor) -> bool:
    """Whether `weight` can be held in panels: float32 on CPU."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def panel_dtype(weight: torch.Tensor) -> torch.dtype:
    """bfloat16 where every value of the float32 `weight` is a bfloat16 value (so the panels
    lose nothing), else float32."""
    narrow = weight.to(torch.bfloat16)
    return torch.bfloat16 if torch.equal(narrow.to(weight.dtype), weight) else weight.dtype


def to_panels(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[N, K] → [ceil(N / PANEL), K, PANEL] in `dtype` (the weight's by default): panel p's row
    k holds weight[PANEL·p + j, k]."""
    n, k = weight.shape
    count = -(-n // PANEL)
    padded = weight.new_zeros(count * PANEL, k, dtype=dtype or weight.dtype)
    padded[:n] = weight
    return padded.view(count, PANEL, k).transpose(1, 2).contiguous()


def pack(source: torch.Tensor, weight: torch.Tensor) -> int:
    """Hold a prepacked copy of `weight` ([out_features, in_features]: a view or rearranged
    copy of `source`'s values) for `source`, until `source` is freed; `prepacked_linear(x,
    source, ...)` then computes `x @ weight.T`. Returns the bytes the copy holds (half when the
    values are bfloat16 values, `panel_dtype`). `source` must not change afterwards (the copy
    would not follow)."""
    if not available(weight):
        raise ValueError(
            f"a prepacked weight must be float32 on CPU, got {weight.dtype} on {weight.device}"
        )
    if weight.dim() != 2:
        raise ValueError(f"a prepacked weight is [out_features, in_features], got {weight.shape}")
    with torch.no_grad():
        packed = to_panels(weight, panel_dtype(weight))
    key = source.data_ptr()

    def forget(_: object, key: int = key) -> None:
        held = _HELD.get(key)
        if held is not None and held.source() is None:
            _release(key)

    _HELD[key] = _Held(weakref.ref(source, forget), source.shape, packed, weight.shape[0])
    if _NATIVE[0]:
        torch.ops.swaserve.hold_prepacked(source, packed, weight.shape[0])
    return packed.nbytes


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
    torch.library.register_fake("swaserve::prepacked_expert_linear")(_expert_linear_fake)
    torch.library.register_fake("swaserve::prepacked_expert_linear_in")(_expert_linear_in_fake)
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
    rows = x.reshape(-1, x.shape[-1])
    y = torch.matmul(rows, held.packed.to(rows.dtype))  # [P, M, PANEL]
    y = y.transpose(0, 1).reshape(rows.shape[0], -1)[:, :out_features]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], out_features)


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
        """`F.linear(x, weight, bias)`; over the prepacked copy in the static step, whatever
        its rows (one row too: the compiled batch-1 step of the decode bench ran 1.4× faster
        over the copies than with inductor's own loops, and a row's result is then the same
        in every batch bucket)."""
        if self.prepacked and in_static_step():
            return prepacked_linear(x, self.weight, bias, self.weight.shape[0])
        return F.linear(x, self.weight, bias)


def experts_run_sparse(expert_features: int) -> bool:
    """Whether `expert_linear` / `expert_linear_in` serve experts of `expert_features` gate/up
    outputs: the C++ kernels are loaded and an expert's outputs fill whole panels."""
    return _NATIVE[0] and expert_features % PANEL == 0


def expert_linear(
    x: torch.Tensor,  # [T, K]
    source: torch.Tensor,
    bias: torch.Tensor | None,  # [E·F]
    out_features: int,  # E·F
    experts: torch.Tensor,  # [T, k] int64
    expert_features: int,  # F
) -> torch.Tensor:  # [T, k, F]
    """Each token through its k experts' rows of the stacked weight held for `source`:
    out[t, j] = x[t] W_e^T + bias_e, e = experts[t, j], W_e its rows [e·F, (e + 1)·F). Only the
    chosen experts' weights are read and multiplied (`experts_run_sparse` must hold)."""
    return torch.ops.swaserve.prepacked_expert_linear(
        x, source, bias, out_features, experts, expert_features
    )


def expert_linear_in(
    h: torch.Tensor,  # [T, k, I]
    source: torch.Tensor,
    out_features: int,  # D
    experts: torch.Tensor,  # [T, k] int64
    weights: torch.Tensor,  # [T, k]
    expert_inputs: int,  # I
) -> torch.Tensor:  # [T, D]
    """y[t] = Σ_j weights[t, j] · h[t, j] W_e^T, e = experts[t, j], W_e the inputs
    [e·I, (e + 1)·I) of the stacked weight held for `source` ([D, E·I])."""
    return torch.ops.swaserve.prepacked_expert_linear_in(
        h, source, out_features, experts, weights, expert_inputs
    )


def _expert_linear_fake(
    x: torch.Tensor,
    source: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    experts: torch.Tensor,
    expert_features: int,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], experts.shape[1], expert_features))


def _expert_linear_in_fake(
    h: torch.Tensor,
    source: torch.Tensor,
    out_features: int,
    experts: torch.Tensor,
    weights: torch.Tensor,
    expert_inputs: int,
) -> torch.Tensor:
    return h.new_empty((h.shape[0], out_features))
