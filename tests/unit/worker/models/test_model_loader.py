"""Weight loading: single file and sharded checkpoints load the same tensors; every mismatch
between checkpoint and model is a typed error that names the tensor."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from checkpoint_edit import edit_checkpoint, state
from ref_backend import RefBackend
from safetensors.torch import load_file

from swaserve.worker.models.errors import (
    MissingConfigFieldError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    UnknownArchitectureError,
    WeightLoadError,
)
from swaserve.worker.models.gpt_oss import GptOssForCausalLM
from swaserve.worker.models.loader import INDEX_FILE, SINGLE_FILE, load_model
from swaserve.worker.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from swaserve.worker.models.tiny import make_tiny_model

ROUTER = "model.layers.1.mlp.router.weight"


@pytest.fixture
def gpt_oss_dir(tmp_path: Path) -> Path:
    return make_tiny_model(tmp_path / "m", arch="gpt-oss", num_layers=2, seed=5)


def test_loads_every_tensor_by_hf_name(gpt_oss_dir: Path) -> None:
    model = load_model(gpt_oss_dir, RefBackend())
    assert isinstance(model, GptOssForCausalLM)
    checkpoint = load_file(gpt_oss_dir / SINGLE_FILE)
    loaded = model.state_dict()
    assert set(loaded) == set(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(loaded[name], tensor), name
    assert not model.training


def test_sharded_checkpoint_loads_the_same_tensors(tmp_path: Path) -> None:
    single = make_tiny_model(tmp_path / "one", arch="mimo-v2-flash", num_layers=3, seed=9)
    sharded = make_tiny_model(
        tmp_path / "three", arch="mimo-v2-flash", num_layers=3, seed=9, num_shards=3
    )
    assert not (sharded / SINGLE_FILE).exists()
    weight_map = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) == 3
    a = state(load_model(single, RefBackend()))
    b = state(load_model(sharded, RefBackend()))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_tensor_is_named(gpt_oss_dir: Path) -> None:
    edit_checkpoint(gpt_oss_dir, {ROUTER: None})
    with pytest.raises(
        MissingTensorError, match=re.escape(f"no tensor for '{ROUTER}' (1 missing)")
    ):
        load_model(gpt_oss_dir, RefBackend())


def test_wrong_shape_names_tensor_expected_and_got(gpt_oss_dir: Path) -> None:
    edit_checkpoint(gpt_oss_dir, {ROUTER: torch.zeros(5, 32)})
    with pytest.raises(TensorShapeError) as err:
        load_model(gpt_oss_dir, RefBackend())
    assert str(err.value) == (
        f"tensor '{ROUTER}' in {SINGLE_FILE}: expected shape (4, 32), got (5, 32)"
    )


def test_unexpected_tensor_is_named_but_mtp_layers_are_skipped(tmp_path: Path) -> None:
    gpt_oss = make_tiny_model(tmp_path / "g", arch="gpt-oss", num_layers=2)
    edit_checkpoint(gpt_oss, {"model.layers.0.extra": torch.zeros(2)})
    with pytest.raises(
        UnexpectedTensorError, match=re.escape("'model.layers.0.extra' (1 unexpected)")
    ):
        load_model(gpt_oss, RefBackend())
    mimo = make_tiny_model(tmp_path / "m", arch="mimo-v2-flash", num_layers=2)
    edit_checkpoint(mimo, {"model.mtp.0.proj.weight": torch.zeros(2)})
    assert isinstance(load_model(mimo, RefBackend()), MiMoV2FlashForCausalLM)


def test_tied_lm_head_loads_with_or_without_its_own_copy(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, arch="gpt-oss", num_layers=2, tie_word_embeddings=True)
    checkpoint = load_file(model_dir / SINGLE_FILE)
    assert "lm_head.weight" not in checkpoint
    model = load_model(model_dir, RefBackend())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, checkpoint["model.embed_tokens.weight"])
    edit_checkpoint(model_dir, {"lm_head.weight": checkpoint["model.embed_tokens.weight"]})
    model = load_model(model_dir, RefBackend())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unknown_architecture_and_missing_field_fail_before_any_weight(gpt_oss_dir: Path) -> None:
    config_path = gpt_oss_dir / "config.json"
    hf = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(hf | {"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(
        UnknownArchitectureError, match="supported: GptOssForCausalLM, MiMoV2FlashForCausalLM"
    ):
        load_model(gpt_oss_dir, RefBackend())
    del hf["num_attention_heads"]
    config_path.write_text(json.dumps(hf))
    with pytest.raises(
        MissingConfigFieldError, match=re.escape(f"'num_attention_heads' in {config_path}")
    ):
        load_model(gpt_oss_dir, RefBackend())


def test_missing_checkpoint_files(gpt_oss_dir: Path, tmp_path: Path) -> None:
    (gpt_oss_dir / SINGLE_FILE).unlink()
    with pytest.raises(WeightLoadError, match=re.escape(f"no {SINGLE_FILE} or {INDEX_FILE}")):
        load_model(gpt_oss_dir, RefBackend())
    sharded = make_tiny_model(tmp_path / "s", arch="gpt-oss", num_layers=2, num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        WeightLoadError, match=re.escape("names shard model-00002-of-00002.safetensors")
    ):
        load_model(sharded, RefBackend())


def test_bfloat16_keeps_hf_float32_islands(tmp_path: Path) -> None:
    mimo = load_model(
        make_tiny_model(tmp_path / "m", arch="mimo-v2-flash", num_layers=2),
        RefBackend(),
        dtype=torch.bfloat16,
    )
    gate = mimo.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert mimo.model.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16
    gpt_oss = load_model(
        make_tiny_model(tmp_path / "g", arch="gpt-oss", num_layers=2),
        RefBackend(),
        dtype=torch.bfloat16,
    )
    assert gpt_oss.model.norm.weight.dtype == torch.float32
    assert gpt_oss.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
