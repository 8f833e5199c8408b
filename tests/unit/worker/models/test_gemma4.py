"""Gemma 4's config as transformers reads it: per-kind head dims and KV heads, K = V, which layers
share KV (against `Gemma4TextConfig.kv_sharing_modes`), proportional RoPE (against
transformers' own inverse frequencies); the KV pools hold no room for KV-shared layers; what is
not supported is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swaserve.worker.kv import KVMemoryConfig, build_kv_memory
from swaserve.worker.models.config import ModelConfigError, load_model_config, parse_model_config
from swaserve.worker.models.rotary import inverse_frequencies
from swaserve.worker.models.tiny import make_tiny_model

transformers = pytest.importorskip("transformers")


def hf_config(**overrides: object) -> dict:
    config = transformers.Gemma4TextConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        sliding_window=5,
        hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=320,
        **overrides,
    )
    out = config.to_dict()
    out["architectures"] = ["Gemma4ForCausalLM"]
    return out, config


def test_the_parser_reads_what_transformers_builds() -> None:
    raw, config = hf_config()
    ours = parse_model_config(raw)
    assert list(ours.layer_types) == config.layer_types
    assert ours.sliding_window_size == 4
    assert (ours.full_attention.head_dim, ours.full_attention.num_kv_heads) == (16, 1)
    assert (ours.swa_attention.head_dim, ours.swa_attention.num_kv_heads) == (8, 2)
    assert ours.full_attention.k_eq_v and not ours.swa_attention.k_eq_v
    assert ours.attention_scale == 1.0 and ours.value_norm
    # KV sharing as transformers decides it: "reuse" layers read the last "store" of their kind.
    modes = config.kv_sharing_modes
    for i, mode in enumerate(modes):
        source = ours.kv_source(i)
        if mode == "reuse":
            assert source != i and modes[source] == "store"
            assert config.layer_types[source] == config.layer_types[i]
        else:
            assert source == i
    specs = ours.layer_cache_specs()
    assert [s.rule == "shared" for s in specs] == [m == "reuse" for m in modes]


def test_proportional_rope_equals_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw, config = hf_config()
    ours = parse_model_config(raw)
    theirs, scale = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu", layer_type="full_attention")
    mine, my_scale = inverse_frequencies(ours.full_attention.rope)
    assert torch.equal(mine, theirs) and my_scale == scale
    assert ours.full_attention.rope.rotary_dim == 16


def test_kv_shared_layers_take_no_pool_room(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path, arch="gemma4", num_layers=6, sliding_window_size=4)
    config = load_model_config(model)
    spec = config.kv_spec()
    assert spec.shared_layer_ids == (4, 5)
    assert sorted([*spec.full_layer_ids, *spec.swa_layer_ids]) == [0, 1, 2, 3]
    for single in (False, True):
        memory = build_kv_memory(
            spec,
            KVMemoryConfig(max_total_tokens=64, disable_hybrid_swa_memory=single),
        )
        assert memory.kv_pool.num_layers == 4
        with pytest.raises((KeyError, ValueError)):
            memory.kv_pool.get_kv_buffer(5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(enable_moe_block=True, num_experts=None), "num_experts"),
        (dict(enable_moe_block=True, num_experts=2, top_k_experts=3), "top_k_experts"),
        (dict(per_layer_config={"0": {"head_dim": 16}}), "local layer"),
        (dict(per_layer_config={"5": {"sliding_window": 3}}), "overrides"),
    ],
)
def test_what_is_not_supported_is_refused_by_name(overrides: dict, message: str) -> None:
    raw, _ = hf_config()
    raw.update(overrides)
    with pytest.raises(ModelConfigError, match=message):
        parse_model_config(raw)
