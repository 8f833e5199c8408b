"""Checkpoint layouts: the packed in-memory names and the original (published, `save_pretrained`)
layout load the same parameters through the architecture's declared `WeightMap`; declared skip
rules are logged once; everything else that does not fit is a typed error naming the tensor."""

from __future__ import annotations

import json
import logging
import re
import struct
from pathlib import Path

import pytest
import torch
from checkpoint_edit import edit_checkpoint, state
from ref_backend import RefBackend
from safetensors.torch import load_file

from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.errors import (
    CheckpointFileError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
)
from swaserve.worker.models.gpt_oss import GptOssForCausalLM
from swaserve.worker.models.loader import (
    SINGLE_FILE,
    build_model,
    load_model,
    load_weights,
)
from swaserve.worker.models.tiny import make_tiny_model
from swaserve.worker.models.weight_maps import MIMO_V2_FLASH_WEIGHTS

SINK = "model.layers.1.self_attn.sinks"
SINK_ORIGINAL = "model.layers.1.self_attn.attention_sink_bias"
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.fixture
def mimo_original(tmp_path: Path) -> Path:
    return make_tiny_model(
        tmp_path / "orig",
        arch="mimo-v2-flash",
        num_layers=2,
        seed=4,
        checkpoint_format="original",
        mtp_layers=0,
    )


def test_original_layout_is_per_expert_with_attention_sink_bias(mimo_original: Path) -> None:
    names = set(load_file(mimo_original / SINGLE_FILE))
    assert SINK_ORIGINAL in names and SINK not in names
    assert GATE_UP not in names
    experts = {n for n in names if ".mlp.experts." in n}
    assert experts == {
        f"model.layers.1.mlp.experts.{e}.{p}.weight"
        for e in range(4)
        for p in ("gate_proj", "up_proj", "down_proj")
    }


@pytest.mark.parametrize("arch", ["gpt-oss", "mimo-v2-flash"])
def test_original_and_packed_layouts_load_the_same_parameters(arch: str, tmp_path: Path) -> None:
    packed = make_tiny_model(tmp_path / "hf", arch=arch, num_layers=3, seed=8)
    original = make_tiny_model(
        tmp_path / "orig", arch=arch, num_layers=3, seed=8, checkpoint_format="original"
    )
    a = state(load_model(packed, RefBackend()))
    b = state(load_model(original, RefBackend()))
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    checkpoint = load_file(original / SINGLE_FILE)
    if arch == "mimo-v2-flash":  # the packed tensor is the per-expert ones, gate rows first
        gate_up = a["model.layers.2.mlp.experts.gate_up_proj"]
        assert torch.equal(
            gate_up[3, :32], checkpoint["model.layers.2.mlp.experts.3.gate_proj.weight"]
        )
        assert torch.equal(
            gate_up[3, 32:], checkpoint["model.layers.2.mlp.experts.3.up_proj.weight"]
        )


@pytest.mark.parametrize("arch", ["gpt-oss", "mimo-v2-flash"])
def test_transformers_save_pretrained_loads_every_parameter_exactly(
    arch: str, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    tiny = make_tiny_model(tmp_path / "tiny", arch=arch, num_layers=2)
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(tiny)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "saved")
    ours = load_model(tmp_path / "saved", RefBackend()).state_dict()
    theirs = hf.state_dict()
    assert set(ours) == set(theirs)
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []


def test_mtp_layers_are_skipped_and_logged_once(
    mimo_original: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mtp = {
        "model.mtp.layers.0.enorm.weight": torch.ones(32),
        "model.mtp.layers.0.eh_proj.weight": torch.ones(32, 64),
        "model.mtp.layers.0.self_attn.attention_sink_bias": torch.ones(4),
    }
    edit_checkpoint(mimo_original, mtp)
    model = build_model(load_model_config(mimo_original), RefBackend())
    with caplog.at_level(logging.INFO, logger="swaserve.worker.models.loader"):
        report = load_weights(model, mimo_original)
    assert sorted(report.skipped) == sorted(mtp)
    skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert skips == [
        "skipping 3 checkpoint tensors (multi-token-prediction layers, which swaserve runs only "
        "as speculative_method='mtp' drafts): 'model.mtp.layers.0.eh_proj.weight', 'model.mtp.layers.0.enorm.weight', "
        "'model.mtp.layers.0.self_attn.attention_sink_bias'"
    ]
    assert MIMO_V2_FLASH_WEIGHTS.skipped("model.mtp.layers.0.enorm.weight") is not None
    assert MIMO_V2_FLASH_WEIGHTS.skipped("model.layers.0.mtp.weight") is None


def test_an_expert_beyond_the_config_is_unexpected(mimo_original: Path) -> None:
    extra = "model.layers.1.mlp.experts.4.gate_proj.weight"
    edit_checkpoint(mimo_original, {extra: torch.zeros(32, 32)})
    with pytest.raises(UnexpectedTensorError, match=re.escape(f"'{extra}' (1 unexpected)")):
        load_model(mimo_original, RefBackend())


def test_both_layouts_of_one_parameter_is_an_error(mimo_original: Path) -> None:
    edit_checkpoint(mimo_original, {SINK: torch.zeros(4)})
    with pytest.raises(UnexpectedTensorError, match=re.escape(f"'{SINK_ORIGINAL}' (1 unexpected)")):
        load_model(mimo_original, RefBackend())


def test_missing_expert_names_the_parameter_and_the_original_tensor(mimo_original: Path) -> None:
    edit_checkpoint(mimo_original, {"model.layers.1.mlp.experts.2.up_proj.weight": None})
    with pytest.raises(MissingTensorError) as err:
        load_model(mimo_original, RefBackend())
    assert str(err.value) == (
        f"checkpoint in {mimo_original} has no tensor for '{GATE_UP}' (1 missing); the original "
        "layout also lacks 'model.layers.1.mlp.experts.2.up_proj.weight'"
    )


def test_original_tensor_of_the_wrong_shape_is_named(mimo_original: Path) -> None:
    name = "model.layers.1.mlp.experts.1.down_proj.weight"
    edit_checkpoint(mimo_original, {name: torch.zeros(32, 31)})
    with pytest.raises(TensorShapeError) as err:
        load_model(mimo_original, RefBackend())
    assert str(err.value) == (
        f"tensor '{name}' in {SINGLE_FILE}: expected shape (32, 32), got (32, 31)"
    )


def last_tensor(path: Path) -> str:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return max(header, key=lambda k: header[k]["data_offsets"][1])


def test_truncated_file_names_the_first_cut_tensor(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, arch="gpt-oss", num_layers=2)
    path = model_dir / SINGLE_FILE
    name = last_tensor(path)
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointFileError) as err:
        load_model(model_dir, RefBackend())
    assert re.fullmatch(
        rf"{re.escape(str(path))} is truncated: tensor '{re.escape(name)}' needs bytes "
        rf"\[\d+, {size}\) but the file has {size - 10}",
        str(err.value),
    )
    path.write_bytes(b"\x10\x00")
    with pytest.raises(CheckpointFileError, match="2 bytes, no safetensors header"):
        load_model(model_dir, RefBackend())


def test_load_report_log_and_progress_bar(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = make_tiny_model(tmp_path, arch="gpt-oss", num_layers=2, num_shards=2)
    model = build_model(load_model_config(model_dir), RefBackend())
    assert isinstance(model, GptOssForCausalLM)
    with caplog.at_level(logging.INFO, logger="swaserve.worker.models.loader"):
        report = load_weights(model, model_dir, progress=True)
    files = sorted(model_dir.glob("model-*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    assert report.num_tensors == len(tensors) == 37
    assert report.num_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert (report.num_files, report.quantization, report.skipped) == (2, "none", [])
    [message] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded")]
    assert message.startswith(
        f"loaded 37 tensors ({report.num_bytes / 2**20:.1f} MiB, quantization none) from 2 "
        f"file(s) in {model_dir} in "
    )
    bar = capsys.readouterr().err
    assert f"loading {model_dir.name}: 100%" in bar
