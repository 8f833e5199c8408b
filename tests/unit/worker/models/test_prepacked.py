"""Linear weights held in panels for the compiled CPU decode step: the op (its Python kernel and
the C++ one of our kernels) against `F.linear`, a row's result independent of the batch, its
errors, the copies' lifetime in both, and where the layers use them."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from swaserve.worker.attention import cpu_kernels
from swaserve.worker.models import prepacked
from swaserve.worker.models.layers import FusedLinear
from swaserve.worker.models.prepacked import held_for, pack, prepacked_linear
from swaserve.worker.models.static_step import static_shapes
from swaserve.worker.models.tp_layers import ColumnParallelLinear, RowParallelLinear
from swaserve.worker.runner.parallel import TPGroup

GEN = torch.Generator().manual_seed(3)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", int], torch.Tensor]


@pytest.fixture(params=["python", "native"])
def linear(request: pytest.FixtureRequest) -> Linear:
    """The op through its Python kernel, or our C++ one (built here; copies made before the
    build are mirrored into it, later ones as they are made and freed)."""
    if request.param == "python":
        return torch.ops.swaserve.prepacked_linear
    if cpu_kernels.load() is None:
        pytest.skip("the C++ kernels did not build here")
    return torch.ops.swaserve.prepacked_linear_native


@pytest.mark.parametrize("rows", [1, 8, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_linear_equals_f_linear(rows: int, with_bias: bool, linear: Linear) -> None:
    weight, x = randn(48, 40), randn(rows, 40)
    bias = randn(48) if with_bias else None
    assert pack(weight, weight) == 48 * 40 * 4
    assert (linear(x, weight, bias, 48) - F.linear(x, weight, bias)).abs().max() < 1e-5
    strided = randn(40, rows).t()  # a transposed view
    want = F.linear(strided, weight, bias)
    assert (linear(strided, weight, bias, 48) - want).abs().max() < 1e-5
    assert linear(x[:0], weight, bias, 48).shape == (0, 48)
    active = (
        torch.ops.swaserve.prepacked_linear_native
        if prepacked._NATIVE[0]
        else torch.ops.swaserve.prepacked_linear
    )  # what the wrapper calls
    assert torch.equal(prepacked_linear(x, weight, bias, 48), active(x, weight, bias, 48))


@pytest.mark.parametrize("features", [1, 16, 17, 40, 100])
def test_any_row_count_and_feature_count(features: int, linear: Linear) -> None:
    """Every tile shape (1-8 rows, one or two panels, a partial last panel), and with the C++
    kernel each row's result the same bit for bit whatever else the batch holds."""
    weight, bias = randn(features, 24), randn(features)
    pack(weight, weight)
    x = randn(21, 24)
    got = linear(x, weight, bias, features)
    assert (got - F.linear(x, weight, bias)).abs().max() < 1e-5
    for rows in (1, 2, 7, 8, 9, 16):
        assert (linear(x[:rows], weight, bias, features) - got[:rows]).abs().max() < 1e-5
    if linear is torch.ops.swaserve.prepacked_linear:
        return  # the Python kernel's matmul: no such promise
    for rows in (1, 2, 7, 8, 9, 16):
        assert torch.equal(linear(x[:rows], weight, bias, features), got[:rows])
    assert torch.equal(linear(x[5:6], weight, bias, features)[0], got[5])


def test_the_panels_hold_the_weight_by_sixteen_outputs() -> None:
    weight = randn(20, 3)
    panels = prepacked.to_panels(weight)
    assert panels.shape == (2, 3, 16)
    assert torch.equal(panels[1, 2, :4], weight[16:, 2])
    assert not panels[1, :, 4:].any()  # zeros past the last output


def test_a_copy_of_rearranged_values_serves_its_source(linear: Linear) -> None:
    source = randn(3, 16, 10)  # [E, D, N]: three experts' weights
    stacked = source.transpose(1, 2).reshape(30, 16)  # [E·N, D], a rearranged copy
    pack(source, stacked)
    x = randn(5, 16)
    want = torch.cat([x @ source[e] for e in range(3)], dim=1)  # [5, E·N]
    assert (linear(x, source, None, 30) - want).abs().max() < 1e-5


def test_errors_are_clear(linear: Linear) -> None:
    weight = randn(8, 4)
    with pytest.raises(RuntimeError, match="no prepacked weight is held"):
        linear(randn(2, 4), weight, None, 8)
    pack(weight, weight)
    with pytest.raises(RuntimeError, match="has 8 output features, the call asks for 9"):
        linear(randn(2, 4), weight, None, 9)
    with pytest.raises(ValueError, match="float32 on CPU"):
        pack(weight, weight.double())
    with pytest.raises(ValueError, match=r"\[out_features, in_features\]"):
        pack(weight, randn(2, 2, 2))
    view = weight[:4]  # same address, another shape: not the source
    assert held_for(view) is None
    with pytest.raises(RuntimeError, match="no prepacked weight is held"):
        linear(randn(2, 4), view, None, 8)
    prepacked.drop(weight)
    with pytest.raises(RuntimeError, match="no prepacked weight is held"):
        linear(randn(2, 4), weight, None, 8)


def test_a_copy_lives_as_long_as_its_source(linear: Linear) -> None:
    gc.collect()
    before = len(prepacked._HELD)
    weight = randn(16, 16)
    pack(weight, weight)
    assert held_for(weight) is not None
    assert len(prepacked._HELD) == before + 1
    address = weight.data_ptr()
    del weight
    gc.collect()
    assert len(prepacked._HELD) == before
    other = torch.empty(16, 16)  # maybe at the freed address: no copy is held for it
    if other.data_ptr() == address:
        with pytest.raises(RuntimeError, match="no prepacked weight is held"):
            linear(randn(2, 16), other, None, 16)


def linears() -> list[torch.nn.Module]:
    """A column-, a row-parallel and a fused linear (TP = 1), with biases and random weights."""
    torch.manual_seed(0)
    col = ColumnParallelLinear(12, 20, ((0, 20),), bias=True, dtype=torch.float32)
    row = RowParallelLinear(12, 20, ((0, 12),), bias=True, dtype=torch.float32, tp=TPGroup.single())
    parts = [
        ColumnParallelLinear(12, n, ((0, n),), bias=True, dtype=torch.float32) for n in (6, 10)
    ]
    for module in [col, row, *parts]:
        with torch.no_grad():
            for param in module.parameters():
                param.copy_(torch.randn(param.shape))
    return [col, row, FusedLinear(parts, ("a_proj", "b_proj"))]


@pytest.mark.parametrize("index", range(3))
def test_layers_use_the_copy_only_in_a_static_step(index: int) -> None:
    layer = linears()[index]
    x = randn(4, 12)
    with torch.no_grad():
        want = layer(x)
        rows, cols = layer.weight.shape
        assert layer.prepack_weights() == -(-rows // prepacked.PANEL) * prepacked.PANEL * cols * 4
        assert layer.prepacked
        assert layer.prepack_weights() == 0  # held already: no second copy
        with static_shapes():
            got, one = layer(x), layer(x[:1])  # one row over the copy too
        for got_rows, want_rows in ((got, want), (one, layer(x[:1]))):
            outs = (
                (got_rows, want_rows)
                if isinstance(got_rows, tuple)
                else ((got_rows,), (want_rows,))
            )
            for a, b in zip(*outs, strict=True):
                assert (a - b).abs().max() < 1e-5
        prepacked.drop(layer.weight)  # now only the eager path works
        layer(x)
        with static_shapes():
            for rows in (x, x[:1]):
                with pytest.raises(RuntimeError, match="no prepacked weight is held"):  # either op
                    layer(rows)


def test_layers_without_onednn_weights_stay_plain() -> None:
    layer = ColumnParallelLinear(4, 4, ((0, 4),), bias=False, dtype=torch.float64)
    assert layer.prepack_weights() == 0
    assert not layer.prepacked


def test_the_expert_linears_run_each_token_through_its_own_experts() -> None:
    """`expert_linear` / `expert_linear_in` (the compiled step's MoE): each (token, expert) pair
    through that expert's rows / inputs of the stacked weights only, a token's result the same
    bit for bit whatever the batch, and an expert out of range refused."""
    if cpu_kernels.load() is None:
        pytest.skip("the C++ kernels did not build here")
    experts_n, features, inputs, d = 4, 32, 16, 24
    gate_up, bias = randn(experts_n * features, d), randn(experts_n * features)
    down = randn(d, experts_n * inputs)
    pack(gate_up, gate_up)
    pack(down, down)
    assert prepacked.experts_run_sparse(features)
    assert not prepacked.experts_run_sparse(features + 8)
    x = randn(11, d)
    chosen = torch.stack([torch.randperm(experts_n, generator=GEN)[:2] for _ in range(11)])
    weights = torch.rand(11, 2, generator=GEN)
    got = prepacked.expert_linear(x, gate_up, bias, experts_n * features, chosen, features)
    h = randn(11, 2, inputs)
    y = prepacked.expert_linear_in(h, down, d, chosen, weights, inputs)
    for t in range(11):
        want_y = torch.zeros(d)
        for j in range(2):
            e = int(chosen[t, j])
            rows = slice(e * features, (e + 1) * features)
            want = x[t] @ gate_up[rows].T + bias[rows]
            assert (got[t, j] - want).abs().max() < 1e-5
            want_y += weights[t, j] * (h[t, j] @ down[:, e * inputs : (e + 1) * inputs].T)
        assert (y[t] - want_y).abs().max() < 1e-5
    for rows in (1, 3, 8):
        part = prepacked.expert_linear(
            x[:rows], gate_up, bias, experts_n * features, chosen[:rows], features
        )
        assert torch.equal(part, got[:rows])
        part_y = prepacked.expert_linear_in(
            h[:rows], down, d, chosen[:rows], weights[:rows], inputs
        )
        assert torch.equal(part_y, y[:rows])
    chosen[3, 1] = 7
    with pytest.raises(RuntimeError, match="expert 7 of 4"):
        prepacked.expert_linear(x, gate_up, bias, experts_n * features, chosen, features)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        prepacked.expert_linear(x, gate_up, bias, experts_n * features, chosen[:, :1] * 0, 24)


def bf16_valued(*shape: int) -> torch.Tensor:
    """Float32 values that are all bfloat16 values: a bfloat16 checkpoint loaded in float32."""
    return randn(*shape).to(torch.bfloat16).float()


def test_bfloat16_values_are_held_in_bfloat16_panels() -> None:
    weight = bf16_valued(40, 24)
    assert prepacked.panel_dtype(weight) == torch.bfloat16
    assert pack(weight, weight) == 48 * 24 * 2  # half a float32 copy's bytes
    held = held_for(weight)
    assert held is not None and held.dtype == torch.bfloat16
    assert torch.equal(held.float(), prepacked.to_panels(weight))  # nothing lost
    off = weight.clone()
    off[3, 5] += 2.0**-20  # one value a bfloat16 cannot hold
    assert prepacked.panel_dtype(off) == torch.float32
    assert pack(off, off) == 48 * 24 * 4


@pytest.mark.parametrize("rows", [1, 5, 8, 19])
def test_bfloat16_panels_give_the_float32_panels_bits(
    rows: int, linear: Linear, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel widens each bfloat16 weight to its float32 value as it loads it: the same
    products in the same order as over float32 panels of the same values (with the Python
    kernel, the same matmul)."""
    weight, bias, x = bf16_valued(40, 24), randn(40), randn(rows, 24)
    twin = weight.clone()  # the same values, held in float32 panels
    pack(weight, weight)
    _held_in_float32(twin, monkeypatch)
    assert held_for(weight).dtype == torch.bfloat16 and held_for(twin).dtype == torch.float32
    assert torch.equal(linear(x, weight, bias, 40), linear(x, twin, bias, 40))
    assert (linear(x, weight, bias, 40) - F.linear(x, weight, bias)).abs().max() < 1e-5


def test_bfloat16_expert_panels_give_the_float32_panels_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if cpu_kernels.load() is None:
        pytest.skip("the C++ kernels did not build here")
    experts_n, features, inputs, d = 4, 32, 16, 24
    gate_up, down = bf16_valued(experts_n * features, d), bf16_valued(d, experts_n * inputs)
    bias = randn(experts_n * features)
    twins = gate_up.clone(), down.clone()
    for weight in (gate_up, down):
        pack(weight, weight)
    for twin in twins:
        _held_in_float32(twin, monkeypatch)
    x, h, weights = randn(9, d), randn(9, 2, inputs), torch.rand(9, 2, generator=GEN)
    chosen = torch.stack([torch.randperm(experts_n, generator=GEN)[:2] for _ in range(9)])
    outs = [
        (
            prepacked.expert_linear(x, up, bias, experts_n * features, chosen, features),
            prepacked.expert_linear_in(h, dn, d, chosen, weights, inputs),
        )
        for up, dn in ((gate_up, down), twins)
    ]
    assert held_for(gate_up).dtype == torch.bfloat16 and held_for(twins[0]).dtype == torch.float32
    for got, want in zip(*outs, strict=True):
        assert torch.equal(got, want)


def _held_in_float32(weight: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hold `weight`'s copy in float32 panels whatever its values (as `pack` does for values a
    bfloat16 cannot hold)."""
    with monkeypatch.context() as patch:
        patch.setattr(prepacked, "panel_dtype", lambda _: torch.float32)
        pack(weight, weight)
