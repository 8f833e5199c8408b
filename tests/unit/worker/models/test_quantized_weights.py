"""Quantized checkpoints kept quantized in memory (`quantized_weights`): parameters hold the
checkpoint's own bytes (MXFP4 blocks + scales; FP8 weights with their block scales expanded),
the MoE paths dequantize only the experts a batch selects and compute exactly what the
dequantized-at-load model computes, FP8 linears dequantize per call on CPU, and the bytes a
model will hold are known exactly before it is loaded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoint_edit import edit_checkpoint
from ref_backend import RefBackend
from safetensors.torch import load_file

from swaserve.worker.models.causal_lm import HybridCausalLM
from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.errors import QuantizedTensorError
from swaserve.worker.models.fp8 import (
    dequantize_fp8,
    dequantize_fp8_expanded,
    fp8_linear,
    pad_block_scale,
    quantize_fp8,
    scaled_mm_block_linear,
    scaled_mm_block_scale,
    scaled_mm_block_supported,
)
from swaserve.worker.models.layers import BatchedExperts, sort_by_expert
from swaserve.worker.models.loader import SINGLE_FILE, build_meta_model, load_model
from swaserve.worker.models.mxfp4 import dequantize_mxfp4, random_mxfp4
from swaserve.worker.models.quantized_weights import Fp8Linear, Fp8Weight, resident_bytes
from swaserve.worker.runner.parallel import TPGroup

LAYER = "model.layers.1"
MODELS = {
    "gpt-oss-mxfp4": dict(arch="gpt-oss", quantization="mxfp4", num_experts=8),
    "gpt-oss-fp8": dict(arch="gpt-oss", quantization="fp8", num_experts=8, fp8_block_size=(16, 8)),
    "mimo-fp8": dict(
        arch="mimo-v2-flash", quantization="fp8", num_experts=8, fp8_block_size=(16, 16)
    ),
    # Blocks that divide nothing, per-expert gate / up tensors.
    "mimo-fp8-original": dict(
        arch="mimo-v2-flash",
        quantization="fp8",
        num_experts=8,
        fp8_block_size=(20, 24),
        checkpoint_format="original",
    ),
}


def both(model_dir: Path) -> tuple[HybridCausalLM, HybridCausalLM]:
    """(kept quantized, dequantized at load), float32."""
    kept = load_model(model_dir, RefBackend(), dequantize_weights=False)
    dequantized = load_model(model_dir, RefBackend(), dequantize_weights=True)
    return kept, dequantized


def experts_of(model: HybridCausalLM) -> BatchedExperts:
    experts = model.get_submodule(f"{LAYER}.mlp.experts")
    assert isinstance(experts, BatchedExperts)
    return experts


def test_mxfp4_experts_hold_the_checkpoint_bytes(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory(**MODELS["gpt-oss-mxfp4"])
    checkpoint = load_file(model_dir / SINGLE_FILE)
    loaded = load_model(model_dir, RefBackend(), dequantize_weights=False).state_dict()
    name = f"{LAYER}.mlp.experts.gate_up_proj"
    assert name not in loaded
    assert loaded[name + "_blocks"].shape == (8, 64, 1, 16)  # [E, 2I, D / 32, 16]
    assert loaded[name + "_blocks"].dtype == torch.uint8
    stored = [n for n in checkpoint if n.endswith(("_blocks", "_scales"))]
    assert len(stored) == 4 * 4  # gate_up / down, blocks / scales, 4 layers
    assert all(torch.equal(loaded[n], checkpoint[n]) for n in stored)
    assert set(loaded) == set(checkpoint)  # every other tensor by its own name, float32


def test_fp8_weights_hold_the_checkpoint_bytes_and_expanded_scales(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model_dir = tiny_model_factory(**MODELS["mimo-fp8"])
    checkpoint = load_file(model_dir / SINGLE_FILE)
    loaded = load_model(model_dir, RefBackend(), dequantize_weights=False).state_dict()
    q = f"{LAYER}.self_attn.q_proj.weight"
    assert loaded[q].dtype == torch.float8_e4m3fn
    assert torch.equal(loaded[q].view(torch.uint8), checkpoint[q].view(torch.uint8))
    scale = checkpoint[q + "_scale_inv"]  # [ceil(R / 16), ceil(C / 16)]
    rows = loaded[q].shape[0]
    assert torch.equal(loaded[q + "_scale_inv"], scale.repeat_interleave(16, dim=0)[:rows])
    gate_up = f"{LAYER}.mlp.experts.gate_up_proj"
    assert loaded[gate_up].dtype == torch.float8_e4m3fn
    assert loaded[gate_up + "_scale_inv"].shape == (8, 64, 2)  # [E, 2I, ceil(D / 16)]
    plain = "model.layers.0.self_attn.q_proj.weight"  # modules_to_not_convert
    assert loaded[plain].dtype == torch.float32
    assert plain + "_scale_inv" not in loaded


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("path", ["forward_gathered", "forward_grouped"])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_quantized_experts_compute_what_the_dequantized_compute(
    name: str, path: str, num_tokens: int, tiny_model_factory: Callable[..., Path]
) -> None:
    kept, dequantized = (experts_of(m) for m in both(tiny_model_factory(**MODELS[name])))
    assert kept.quantized and not dequantized.quantized
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 32, generator=gen)  # [T, D]
    index = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, 2, generator=gen)  # [T, k]
    with torch.no_grad():
        ours = getattr(kept, path)(x, index, weights)
        theirs = getattr(dequantized, path)(x, index, weights)
    assert theirs.abs().max() > 0.01
    assert torch.equal(ours, theirs)


def test_only_the_selected_experts_are_dequantized(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    experts = experts_of(load_model(tiny_model_factory(**MODELS["gpt-oss-mxfp4"]), RefBackend()))
    kept = experts_of(
        load_model(
            tiny_model_factory(**MODELS["gpt-oss-mxfp4"]), RefBackend(), dequantize_weights=False
        )
    )
    assert not experts.quantized
    asked: list[tuple[str, list[int] | None]] = []
    original = type(kept).expert_weight

    def spy(self: BatchedExperts, name: str, ids: torch.Tensor | None = None) -> torch.Tensor:
        asked.append((name, None if ids is None else ids.tolist()))
        return original(self, name, ids)

    monkeypatch.setattr(type(kept), "expert_weight", spy)
    index = torch.tensor([[5, 0], [5, 3], [0, 5]])  # [T=3, k=2]: experts 0, 3, 5 of 8
    x, weights = torch.randn(3, 32), torch.full((3, 2), 0.5)
    with torch.no_grad():
        kept.forward_grouped(x, index, weights)
        kept.forward_gathered(x, index, weights)
        experts.forward_grouped(x, index, weights)  # float weights: read whole, in place
    assert asked == [
        ("gate_up_proj", [0, 3, 5]),
        ("down_proj", [0, 3, 5]),
        ("gate_up_proj", [5, 0, 5, 3, 0, 5]),  # one copy per (token, expert) pair
        ("down_proj", [5, 0, 5, 3, 0, 5]),
        ("gate_up_proj", None),
        ("down_proj", None),
    ]


@pytest.mark.parametrize("name", ["gpt-oss-mxfp4", "mimo-fp8"])
def test_grouped_quantized_experts_run_in_chunks_within_the_budget(
    name: str, tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    kept, dequantized = (experts_of(m) for m in both(tiny_model_factory(**MODELS[name])))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 32, generator=gen)  # [T, D]
    index = torch.stack([torch.randperm(7, generator=gen)[:2] for _ in range(9)])  # 7 experts
    weights = torch.rand(9, 2, generator=gen)  # [T, k]
    with torch.no_grad():
        whole = kept.forward_grouped(x, index, weights)
        want = dequantized.forward_grouped(x, index, weights)
        monkeypatch.setattr(
            "swaserve.worker.models.layers.GATHER_BUDGET_ELEMENTS", 3 * kept.expert_elements
        )
        asked: list[list[int]] = []
        original = type(kept).expert_outputs

        def spy(self: BatchedExperts, xs: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
            assert ids is not None
            asked.append(ids.tolist())
            return original(self, xs, ids)

        monkeypatch.setattr(type(kept), "expert_outputs", spy)
        chunked = kept.forward_grouped(x, index, weights)
    chosen = sorted(set(index.reshape(-1).tolist()))
    assert asked == [chosen[0:3], chosen[3:6], chosen[6:]]  # 3 experts' weights at a time
    assert torch.equal(chunked, whole)
    assert torch.equal(chunked, want)


def test_sort_by_expert_only_selected_groups_the_chosen_experts() -> None:
    index = torch.tensor([[2, 0], [2, 3], [0, 2]])  # [T=3, k=2]; expert 1 chosen by no token
    groups = sort_by_expert(index, num_experts=4, only_selected=True)
    assert groups.experts is not None and groups.experts.tolist() == [0, 2, 3]
    assert groups.token_rows.tolist() == [[0, 2, 0], [0, 1, 2], [1, 0, 0]]
    assert groups.group.tolist() == [0, 0, 1, 1, 1, 2]
    assert groups.expert.tolist() == [0, 0, 2, 2, 2, 3]
    assert groups.position.tolist() == [0, 1, 0, 1, 2, 0]
    assert groups.pair.tolist() == [1, 4, 0, 2, 5, 3]
    every = sort_by_expert(index, num_experts=4)
    assert every.experts is None and every.group.tolist() == every.expert.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_dequantization_equals_transformers_over_every_exponent(dtype: torch.dtype) -> None:
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    gen = torch.Generator().manual_seed(3)
    # Every finite E8M0 scale (255 is E8M0's NaN: there transformers' ldexp gives 0 · 2^128 = 0).
    blocks, scales = random_mxfp4((4, 64, 48), gen, exponents=(-127, 127))  # [E, K, N]
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize_mxfp4(blocks, scales, dtype)
    assert want.isinf().any() and (want == 0).any()  # overflow and underflow both happen
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("expand_dim", [-2, -1])
@pytest.mark.parametrize("shape", [(45, 50), (3, 45, 50), (40, 48), (3, 40, 48)])
def test_fp8_expanded_scales_dequantize_bit_for_bit(
    expand_dim: int, shape: tuple[int, ...]
) -> None:
    block = (20, 24)  # 45 x 50: edge blocks short in both dims; 40 x 48: whole blocks
    rows, cols = shape[-2:]
    value = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    weight, scale_inv = quantize_fp8(value, block)
    if expand_dim == -2:
        expanded = scale_inv.repeat_interleave(20, dim=-2)[..., :rows, :]  # [..., R, C / bk]
    else:
        expanded = scale_inv.repeat_interleave(24, dim=-1)[..., :cols]  # [..., R / bn, C]
    for dtype in (torch.float32, torch.bfloat16):
        want = dequantize_fp8(weight, scale_inv, block, dtype)
        got = dequantize_fp8_expanded(weight, expanded, block, expand_dim, dtype)
        assert torch.equal(
            got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        )


def test_fp8_linear_dequantizes_per_call_off_cuda(tiny_model_factory: Callable[..., Path]) -> None:
    kept, dequantized = both(tiny_model_factory(**MODELS["mimo-fp8"]))
    linear = kept.get_submodule(f"{LAYER}.self_attn.o_proj")
    assert isinstance(linear, Fp8Linear)
    held = linear.quantized["weight"]
    assert isinstance(held, Fp8Weight)
    assert not scaled_mm_block_supported(torch.device("cpu"))
    assert scaled_mm_block_scale(linear.weight, linear.weight_scale_inv, (128, 128), -2) is None
    x = torch.randn(5, linear.in_features)
    want = dequantized.get_submodule(f"{LAYER}.self_attn.o_proj")(x)
    with torch.no_grad():
        assert torch.equal(linear(x), want)
        got = fp8_linear(
            x, linear.weight, linear.weight_scale_inv, held.block_size, held.expand_dim
        )
    assert torch.equal(got, F.linear(x, held.dequantize(linear)))


def test_a_float_tensor_where_fp8_is_declared_is_named(tmp_path: Path) -> None:
    from swaserve.worker.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path, arch="mimo-v2-flash", quantization="fp8")
    name = f"{LAYER}.self_attn.q_proj.weight"
    edit_checkpoint(model_dir, {name: torch.zeros(96, 32), name + "_scale_inv": None})
    load_model(model_dir, RefBackend(), dequantize_weights=True)  # loads as stored
    with pytest.raises(QuantizedTensorError, match=r"q_proj.*dequantize_weights=True"):
        load_model(model_dir, RefBackend(), dequantize_weights=False)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tp_size", [1, 2])
def test_resident_bytes_are_known_before_the_load(
    name: str, tp_size: int, tiny_model_factory: Callable[..., Path]
) -> None:
    model_dir = tiny_model_factory(**MODELS[name])
    config = load_model_config(model_dir)
    rank0 = TPGroup(rank=0, world_size=tp_size)  # rank 0's shard (loading needs no group)
    for dequantize in (False, True):
        meta = build_meta_model(config, RefBackend(), tp=rank0, dequantize_weights=dequantize)
        model = load_model(model_dir, RefBackend(), tp=rank0, dequantize_weights=dequantize)
        assert resident_bytes(meta) == resident_bytes(model)
        assert resident_bytes(model) == sum(t.nbytes for t in model.state_dict().values())


@pytest.mark.parametrize("k_blocks", [1, 2, 3, 4, 5, 8])
def test_block_scales_are_padded_to_four_k_blocks_with_ones(k_blocks: int) -> None:
    blocks = torch.rand(3, k_blocks) + 0.5  # [R / 128, C / 128]
    padded = pad_block_scale(blocks)
    assert padded.shape == (3, -(-k_blocks // 4) * 4) and padded.is_contiguous()
    assert torch.equal(padded[:, :k_blocks], blocks)
    assert bool((padded[:, k_blocks:] == 1).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens, cols", [(7, 512), (16, 256), (3, 384), (33, 640), (16, 1024)])
def test_scaled_mm_block_linear_is_close_to_dequantization_on_cuda(tokens: int, cols: int) -> None:
    """2, 3 and 5 blocks of 128 columns too: cuBLAS reads the weight's scales in fours."""
    device = torch.device("cuda")
    if not scaled_mm_block_supported(device):
        pytest.skip("this GPU / torch has no block-scaled _scaled_mm (fp8_linear dequantizes)")
    gen = torch.Generator(device=device).manual_seed(cols)
    weight, scale_inv = quantize_fp8(
        torch.randn(384, cols, device=device, generator=gen), (128, 128)
    )
    expanded = scale_inv.repeat_interleave(128, dim=0)  # [R, C / 128]
    block_scale = scaled_mm_block_scale(weight, expanded, (128, 128), -2)
    assert block_scale is not None
    x = torch.randn(tokens, cols, device=device, generator=gen).to(torch.bfloat16)
    got = scaled_mm_block_linear(x, weight, block_scale).float()
    want = x.float() @ dequantize_fp8(weight, scale_inv, (128, 128), torch.float32).t()
    assert got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) < 0.05


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("name", ["gpt-oss-mxfp4", "mimo-fp8"])
def test_prepacking_leaves_quantized_weights_alone(
    name: str, tiny_model_factory: Callable[..., Path]
) -> None:
    """The compiled CPU step's prepacked copies are made of float32 weights only: experts and
    linears held quantized keep their own paths."""
    kept, _ = both(tiny_model_factory(**MODELS[name]))
    packable = [m for m in kept.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)]
    floats = {
        id(m.weight): m.weight.nbytes
        for m in packable
        if hasattr(m, "linear") and m.weight.dtype == torch.float32
    }
    assert kept.prepack_weights() == sum(floats.values())
    assert not experts_of(kept).prepacked
    for module in kept.modules():
        if isinstance(module, Fp8Linear):
            assert not hasattr(module, "prepacked")
        elif getattr(module, "prepacked", False):
            assert id(module.weight) in floats
