"""Published multimodal checkpoints serve their language model: a `Llama4ForConditionalGeneration`,
a `Gemma3ForConditionalGeneration` and a `Gemma4ForConditionalGeneration` built by transformers (a tiny vision tower next to a tiny
language model with the tiny model's weights) and saved with `save_pretrained` load through the
engine (the config's `text_config`, the weights under `language_model.`, the vision tower
skipped) and decode greedily as transformers does."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint_formats_golden import hf_greedy, workload

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.loader import SINGLE_FILE

transformers = pytest.importorskip("transformers")


def llama4(text: dict) -> torch.nn.Module:
    vision = transformers.Llama4VisionConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=28,
        patch_size=14,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=text["hidden_size"],
        pixel_shuffle_ratio=0.5,
    )
    config = transformers.Llama4Config(
        text_config=text,
        vision_config=vision.to_dict(),
        image_token_index=300,
        boi_token_index=301,
        eoi_token_index=302,
    )
    return transformers.Llama4ForConditionalGeneration(config)


def gemma3(text: dict) -> torch.nn.Module:
    vision = transformers.SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=300,
    )
    return transformers.Gemma3ForConditionalGeneration(config)


def gemma4(text: dict) -> torch.nn.Module:
    """Without towers: the layout of the language model is what is checked."""
    config = transformers.Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    return transformers.Gemma4ForConditionalGeneration(config)


@pytest.mark.parametrize(
    ("arch", "build"), [("llama4", llama4), ("gemma3", gemma3), ("gemma4", gemma4)]
)
def test_a_multimodal_checkpoint_serves_its_language_model(
    arch: str,
    build: Callable[[dict], torch.nn.Module],
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
) -> None:
    layers = 6 if arch == "gemma4" else 4  # Gemma 4's last two share KV
    tiny = tiny_model_factory(arch, num_layers=layers, sliding_window_size=8, seed=7)
    text = json.loads((tiny / "config.json").read_text())
    model = build(text).eval()
    weights = load_file(tiny / SINGLE_FILE)
    # a causal LM (Llama 4) or its decoder alone (Gemma 3)
    language = getattr(model, "language_model", None) or model.model.language_model
    if not hasattr(language, "lm_head"):
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        head = weights.pop("lm_head.weight", None)
        if head is not None:
            model.lm_head.load_state_dict({"weight": head})
    result = language.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys
    model.tie_weights()
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny / name).exists():
            (tmp_path / name).write_bytes((tiny / name).read_bytes())
    saved = load_file(tmp_path / SINGLE_FILE)
    if arch != "gemma4":  # a vision tower, skipped by the loader
        assert any(name.startswith(("vision_", "model.vision_")) for name in saved)
    assert not any(name.startswith("model.layers.") for name in saved)  # under a prefix
    config = load_model_config(tmp_path)
    assert config.architecture == load_model_config(tiny).architecture
    prompts = workload(1)
    expected = hf_greedy(model, prompts)
    engine = Engine(
        EngineConfig(model=str(tmp_path), max_total_tokens=512, chunked_prefill_size=32)
    )
    try:
        outs = engine.generate(
            prompts, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
        )
        assert [o.token_ids for o in outs] == expected
    finally:
        engine.shutdown()
