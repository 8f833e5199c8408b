"""Quantized checkpoints: MXFP4 GPT-OSS experts dequantize bit for bit as transformers'
`convert_moe_packed_tensors`; FP8 block-scaled weights equal a reference written here from the
format's definition, `modules_to_not_convert` load as stored; bad quantized tensors and unknown
methods are typed errors that name the tensor (or the config field)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from checkpoint_edit import edit_checkpoint
from ref_backend import RefBackend
from safetensors.torch import load_file

from swaserve.worker.models.checkpoint import Checkpoint
from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.errors import (
    MissingTensorError,
    QuantizedTensorError,
    UnexpectedTensorError,
    UnsupportedQuantizationError,
)
from swaserve.worker.models.loader import SINGLE_FILE, load_model
from swaserve.worker.models.mxfp4 import dequantize_mxfp4, random_mxfp4
from swaserve.worker.models.quantization import QuantizationConfig, parse_quantization_config
from swaserve.worker.models.tiny import make_tiny_model

GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"
BLOCK = (20, 24)  # neither divides the tiny shapes: edge blocks are short in both dims


def fp8_reference(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """value[r, c] = float(weight[r, c]) · scale_inv[r // bn, c // bk], block by block."""
    rows, cols = weight.shape
    bn, bk = BLOCK
    out = torch.empty(rows, cols)  # [R, C] float32
    for i in range(0, rows, bn):
        for j in range(0, cols, bk):
            out[i : i + bn, j : j + bk] = weight[i : i + bn, j : j + bk].float() * float(
                scale_inv[i // bn, j // bk]
            )
    return out


@pytest.fixture
def mxfp4_dir(tmp_path: Path) -> Path:
    return make_tiny_model(tmp_path / "m", arch="gpt-oss", num_layers=2, quantization="mxfp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_equal_transformers_dequantization(
    mxfp4_dir: Path, dtype: torch.dtype
) -> None:
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    checkpoint = load_file(mxfp4_dir / SINGLE_FILE)
    model = load_model(mxfp4_dir, RefBackend(), dtype=dtype)
    assert model.config.quantization == QuantizationConfig(
        "mxfp4",
        None,
        ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"),
    )
    loaded = model.state_dict()
    quantized = [n.removesuffix("_blocks") for n in checkpoint if n.endswith("_blocks")]
    assert len(quantized) == 4  # gate_up_proj and down_proj of 2 layers
    for name in quantized:
        want = mxfp4.convert_moe_packed_tensors(
            checkpoint[name + "_blocks"], checkpoint[name + "_scales"], dtype=dtype
        )
        assert loaded[name].dtype == dtype
        assert torch.equal(loaded[name].view(torch.uint8), want.view(torch.uint8)), name
    assert loaded[GATE_UP].shape == (4, 32, 64)
    plain = [n for n in checkpoint if not n.endswith(("_blocks", "_scales"))]
    assert all(torch.equal(loaded[n], checkpoint[n].to(loaded[n].dtype)) for n in plain)


def test_mxfp4_one_expert_at_a_time_equals_the_whole_tensor() -> None:
    blocks, scales = random_mxfp4((3, 64, 32), torch.Generator().manual_seed(1), (-127, 127))
    whole = dequantize_mxfp4(blocks, scales, torch.float32)  # [3, 64, 32]
    assert whole.shape == (3, 64, 32)
    for e in range(3):
        assert torch.equal(dequantize_mxfp4(blocks[e], scales[e], torch.float32), whole[e])
    assert whole.abs().max() == 6.0 * 2.0**127  # the largest code in the largest block


@pytest.mark.parametrize("checkpoint_format", ["original", "hf"])
def test_fp8_weights_equal_the_block_scaled_reference(
    checkpoint_format: str, tmp_path: Path
) -> None:
    model_dir = make_tiny_model(
        tmp_path,
        arch="mimo-v2-flash",
        num_layers=2,
        checkpoint_format=checkpoint_format,
        quantization="fp8",
        fp8_block_size=BLOCK,
    )
    checkpoint = load_file(model_dir / SINGLE_FILE)
    model = load_model(model_dir, RefBackend())
    assert model.config.quantization is not None
    assert model.config.quantization.weight_block_size == BLOCK
    loaded = model.state_dict()
    scaled = [n.removesuffix("_scale_inv") for n in checkpoint if n.endswith("_scale_inv")]
    assert len(scaled) == (19 if checkpoint_format == "original" else 9)  # dense, attn, experts
    for name in scaled:
        weight, scale = checkpoint[name], checkpoint[name + "_scale_inv"]
        assert weight.dtype == torch.float8_e4m3fn
        if checkpoint_format == "original" and ".experts." in name:
            layer, rest = name.split(".mlp.experts.")
            expert, proj = rest.split(".", 1)
            packed = loaded[
                f"{layer}.mlp.experts.{'down_proj' if 'down' in proj else 'gate_up_proj'}"
            ]
            rows = weight.shape[0]
            part = {"gate_proj.weight": slice(0, rows), "up_proj.weight": slice(rows, 2 * rows)}
            got = packed[int(expert)][part.get(proj, slice(None))]
        else:
            got = loaded[name]
        if got.dim() == 3:
            want = torch.stack([fp8_reference(weight[e], scale[e]) for e in range(weight.shape[0])])
        else:
            want = fp8_reference(weight, scale)
        assert torch.equal(got, want), name
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # layer 0's attention is not converted
        key = f"model.layers.0.self_attn.{name}.weight"
        assert checkpoint[key].dtype == torch.float32
        assert torch.equal(loaded[key], checkpoint[key])


def test_fp8_dequantizes_to_bfloat16_by_rounding_once(tmp_path: Path) -> None:
    model_dir = make_tiny_model(
        tmp_path, arch="mimo-v2-flash", num_layers=2, quantization="fp8", fp8_block_size=BLOCK
    )
    checkpoint = load_file(model_dir / SINGLE_FILE)
    model = load_model(model_dir, RefBackend(), dtype=torch.bfloat16)
    name = "model.layers.1.self_attn.q_proj.weight"
    want = fp8_reference(checkpoint[name], checkpoint[name + "_scale_inv"]).to(torch.bfloat16)
    assert torch.equal(model.state_dict()[name], want)


def test_mxfp4_wrong_block_count_is_named(mxfp4_dir: Path) -> None:
    blocks = torch.zeros(4, 64, 2, 16, dtype=torch.uint8)  # K = 32 needs 1 block per row
    edit_checkpoint(
        mxfp4_dir,
        {
            GATE_UP + "_blocks": blocks,
            GATE_UP + "_scales": torch.zeros(4, 64, 2, dtype=torch.uint8),
        },
    )
    with pytest.raises(QuantizedTensorError) as err:
        load_model(mxfp4_dir, RefBackend())
    assert str(err.value) == (
        f"tensor '{GATE_UP}_blocks' in {SINGLE_FILE}: 2 blocks of 32 values per row, but the "
        "parameter (4, 32, 64) needs 1 (K = 32)"
    )


def test_mxfp4_scales_of_the_wrong_shape_are_named(mxfp4_dir: Path) -> None:
    edit_checkpoint(mxfp4_dir, {GATE_UP + "_scales": torch.zeros(4, 64, dtype=torch.uint8)})
    with pytest.raises(QuantizedTensorError) as err:
        load_model(mxfp4_dir, RefBackend())
    assert str(err.value) == (
        f"tensor '{GATE_UP}_scales' in {SINGLE_FILE}: expected one scale per block, shape "
        "(4, 64, 1), got (4, 64)"
    )


def test_mxfp4_blocks_without_scales_are_named(mxfp4_dir: Path) -> None:
    edit_checkpoint(mxfp4_dir, {GATE_UP + "_scales": None})
    with pytest.raises(QuantizedTensorError, match=re.escape(f"has no '{GATE_UP}_scales'")):
        load_model(mxfp4_dir, RefBackend())


def test_mxfp4_tensors_without_a_quantization_config_are_named(mxfp4_dir: Path) -> None:
    config_path = mxfp4_dir / "config.json"
    hf = json.loads(config_path.read_text())
    del hf["quantization_config"]
    config_path.write_text(json.dumps(hf))
    with pytest.raises(MissingTensorError) as err:
        load_model(mxfp4_dir, RefBackend())
    assert str(err.value).endswith(
        "(4 missing); the checkpoint holds 'model.layers.0.mlp.experts.gate_up_proj_blocks' "
        "(mxfp4) but config.json has no quantization_config with quant_method 'mxfp4'"
    )
    blocks = "model.layers.0.self_attn.q_proj.weight_blocks"  # attention is not converted
    edit_checkpoint(mxfp4_dir, {blocks: torch.zeros(1, dtype=torch.uint8)})
    hf["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    config_path.write_text(json.dumps(hf))
    with pytest.raises(UnexpectedTensorError, match=re.escape(f"'{blocks}' (1 unexpected)")):
        load_model(mxfp4_dir, RefBackend())


@pytest.fixture
def fp8_dir(tmp_path: Path) -> Path:
    return make_tiny_model(
        tmp_path / "f", arch="mimo-v2-flash", num_layers=2, quantization="fp8", fp8_block_size=BLOCK
    )


def test_fp8_scales_of_the_wrong_shape_are_named(fp8_dir: Path) -> None:
    name = "model.layers.1.self_attn.q_proj.weight_scale_inv"  # q_proj is [96, 32]: (5, 2) blocks
    edit_checkpoint(fp8_dir, {name: torch.ones(4, 2)})
    with pytest.raises(QuantizedTensorError) as err:
        load_model(fp8_dir, RefBackend())
    assert str(err.value) == (
        f"tensor '{name}' in {SINGLE_FILE}: expected block scales of shape (5, 2) (weight "
        "(96, 32) in blocks of (20, 24)), got (4, 2)"
    )


def test_fp8_weight_without_scales_is_named(fp8_dir: Path) -> None:
    name = "model.layers.1.self_attn.o_proj.weight"
    edit_checkpoint(fp8_dir, {name + "_scale_inv": None})
    with pytest.raises(
        QuantizedTensorError, match=re.escape(f"'{name}' in {SINGLE_FILE} is F8_E4M3")
    ):
        load_model(fp8_dir, RefBackend())


def test_unknown_quant_method_is_named(fp8_dir: Path) -> None:
    config_path = fp8_dir / "config.json"
    hf = json.loads(config_path.read_text())
    hf["quantization_config"] = {"quant_method": "awq", "bits": 4}
    config_path.write_text(json.dumps(hf))
    with pytest.raises(UnsupportedQuantizationError) as err:
        load_model(fp8_dir, RefBackend())
    assert str(err.value) == (
        f"{config_path}: quantization_config.quant_method 'awq' is not supported; "
        "supported: mxfp4, fp8"
    )


def test_quantization_config_fields(fp8_dir: Path) -> None:
    assert (
        load_model_config(make_tiny_model(fp8_dir.parent / "p", num_layers=1)).quantization is None
    )
    quant = parse_quantization_config(
        {
            "quantization_config": {
                "quant_method": "fp8",
                "ignored_layers": ["model.layers.1", "lm_head"],
            }
        }
    )
    assert quant == QuantizationConfig("fp8", (128, 128), ("model.layers.1", "lm_head"))
    assert not quant.converts("model.layers.1.self_attn.q_proj")
    assert quant.converts("model.layers.11.self_attn.q_proj")  # a module boundary, not a prefix
    assert not quant.converts("lm_head")
    glob = QuantizationConfig("mxfp4", None, ("model.layers.*.mlp.router",))
    assert not glob.converts("model.layers.7.mlp.router")
    assert glob.converts("model.layers.7.mlp.experts.gate_up_proj")
    with pytest.raises(
        UnsupportedQuantizationError, match="weight_block_size must be two positive"
    ):
        parse_quantization_config(
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}
        )


def test_expert_tensors_are_read_one_expert_at_a_time(
    mxfp4_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[tuple[str, int | None]] = []
    original_read = Checkpoint.read

    def recording_read(self: Checkpoint, name: str, index: int | None = None) -> torch.Tensor:
        reads.append((name, index))
        return original_read(self, name, index)

    monkeypatch.setattr(Checkpoint, "read", recording_read)
    load_model(mxfp4_dir, RefBackend())
    blocks = [index for name, index in reads if name == GATE_UP + "_blocks"]
    assert blocks == [0, 1, 2, 3]  # never the whole [E, ...] tensor at once
    bias = [index for name, index in reads if name == GATE_UP + "_bias"]
    assert bias == [None]  # 2-D tensors are read whole
