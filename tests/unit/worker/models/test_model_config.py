"""config.json → ModelConfig: layer kinds, the window W (against transformers' own masks),
per-kind KV shapes, sinks and RoPE, the KV spec, and the typed errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from swaserve.worker.kv.kv_pool import KVLayout
from swaserve.worker.models.config import (
    COHERE2,
    EXAONE4,
    GEMMA3,
    GPT_OSS,
    MIMO_V2_FLASH,
    OLMO3,
    load_model_config,
    parse_model_config,
    sliding_window_size_from_hf,
)
from swaserve.worker.models.errors import (
    MissingConfigFieldError,
    ModelConfigError,
    UnknownArchitectureError,
)
from swaserve.worker.models.tiny import make_tiny_model

F, S = "full_attention", "sliding_attention"


def gpt_oss_dict(**changes: Any) -> dict[str, Any]:
    hf: dict[str, Any] = {
        "architectures": [GPT_OSS],
        "model_type": "gpt_oss",
        "vocab_size": 288,
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "sliding_window": 128,
        "layer_types": [S, F, S, F],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    }
    return hf | changes


def mimo_dict(**changes: Any) -> dict[str, Any]:
    hf: dict[str, Any] = {
        "architectures": [MIMO_V2_FLASH],
        "model_type": "mimo_v2_flash",
        "vocab_size": 288,
        "hidden_size": 32,
        "num_hidden_layers": 7,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "v_head_dim": 16,
        "sliding_window": 129,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
    }
    return hf | changes


def test_gpt_oss_layers_window_and_kv_spec() -> None:
    config = parse_model_config(gpt_oss_dict())
    assert config.architecture == GPT_OSS
    assert config.full_layer_ids == [1, 3]
    assert config.swa_layer_ids == [0, 2]
    assert config.sliding_window_size == 127  # HF's sliding_window = 128 = W + 1
    for kind in (config.full_attention, config.swa_attention):
        assert (kind.num_kv_heads, kind.head_dim, kind.v_head_dim, kind.has_sinks) == (
            2,
            8,
            8,
            True,
        )
    assert config.attention_bias and config.o_proj_bias
    assert config.attention_value_scale is None
    assert config.mlp_layer_types == ("sparse",) * 4
    assert (config.moe.num_experts, config.moe.num_experts_per_tok) == (4, 2)
    assert (config.moe.swiglu_alpha, config.moe.swiglu_limit) == (1.702, 7.0)
    rope = config.swa_attention.rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.truncate) == (
        "yarn",
        150000.0,
        32.0,
        False,
    )
    assert rope.rotary_dim == 8
    spec = config.kv_spec()
    assert spec.full_layer_ids == [1, 3] and spec.swa_layer_ids == [0, 2]
    assert spec.full_layout == spec.swa_layout == KVLayout(2, 8, 8)
    assert spec.sliding_window_size == 127
    swa, full = config.attention_layer(0), config.attention_layer(1)
    assert (swa.sliding_window_size, full.sliding_window_size) == (127, None)
    assert (swa.num_heads, swa.num_kv_heads, swa.scaling) == (4, 2, 8**-0.5)


def test_gpt_oss_defaults_follow_transformers() -> None:
    hf = gpt_oss_dict()
    for key in ("layer_types", "rope_parameters"):
        del hf[key]
    config = parse_model_config(hf)
    assert config.layer_types == (S, F, S, F)  # HF: sliding at even layers
    rope = config.full_attention.rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position_embeddings) == (
        "yarn",
        150000.0,
        32.0,
        4096,
    )


def test_mimo_kinds_differ_in_kv_heads_sinks_and_rope() -> None:
    config = parse_model_config(mimo_dict())
    assert config.full_layer_ids == [0, 5]  # HF: layer 0 and every 6th
    assert config.swa_layer_ids == [1, 2, 3, 4, 6]
    assert config.sliding_window_size == 128
    full, swa = config.full_attention, config.swa_attention
    assert (full.num_kv_heads, full.head_dim, full.v_head_dim, full.has_sinks) == (2, 24, 16, False)
    assert (swa.num_kv_heads, swa.head_dim, swa.v_head_dim, swa.has_sinks) == (4, 24, 16, True)
    assert (full.rope.theta, swa.rope.theta) == (5_000_000.0, 10_000.0)
    assert full.rope.partial_rotary_factor == swa.rope.partial_rotary_factor == 0.334
    assert full.rope.rotary_dim == 8  # int(24 · 0.334) = 8
    assert config.attention_value_scale == 0.707
    assert not config.attention_bias and not config.o_proj_bias
    assert config.mlp_layer_types == ("dense",) + ("sparse",) * 6
    spec = config.kv_spec()
    assert spec.full_layout == KVLayout(2, 24, 16)
    assert spec.swa_layout == KVLayout(4, 24, 16)
    assert spec.full_layout.token_bytes(torch.bfloat16) == 2 * 40 * 2
    assert spec.swa_layout.token_bytes(torch.bfloat16) == 4 * 40 * 2
    assert config.attention_layer(1).num_kv_heads == 4
    assert config.attention_layer(0).num_kv_heads == 2


def test_mimo_older_fields_hybrid_layer_pattern_moe_layer_freq_and_window_size() -> None:
    hf = mimo_dict(
        num_hidden_layers=4,
        hybrid_layer_pattern=[0, 1, 1, 0],
        moe_layer_freq=[0, 1, 0, 1],
        sliding_window=128,
        sliding_window_size=128,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=None,
    )
    config = parse_model_config(hf)
    assert config.full_layer_ids == [0, 3]
    assert config.swa_layer_ids == [1, 2]
    assert config.mlp_layer_types == ("dense", "sparse", "dense", "sparse")
    assert config.sliding_window_size == 128  # sliding_window_size is W itself
    assert (config.moe.n_group, config.moe.topk_group, config.moe.routed_scaling_factor) == (
        4,
        2,
        1.0,
    )


def test_window_function_conventions() -> None:
    assert sliding_window_size_from_hf({"sliding_window": 128}, GPT_OSS) == 127
    assert sliding_window_size_from_hf({"sliding_window": 129}, MIMO_V2_FLASH) == 128
    both = {"sliding_window": 128, "sliding_window_size": 128}
    assert sliding_window_size_from_hf(both, MIMO_V2_FLASH) == 128
    assert sliding_window_size_from_hf(both, GPT_OSS) == 127  # GPT-OSS has no such field
    assert sliding_window_size_from_hf({"sliding_window": 1}, GPT_OSS) == 0
    assert sliding_window_size_from_hf({}, GPT_OSS) is None
    with pytest.raises(ModelConfigError, match="sliding_window must be an int >= 1"):
        sliding_window_size_from_hf({"sliding_window": 0}, GPT_OSS)


def hf_visible_keys(hf_config: Any, seq_len: int) -> torch.Tensor:
    """transformers' own SWA mask for one sequence: [q, k] bool, True where q sees k."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    hf_config._attn_implementation = "sdpa"  # boolean masks
    mask = create_sliding_window_causal_mask(
        config=hf_config,
        inputs_embeds=torch.zeros(1, seq_len, 4),  # [1, n, 4]
        attention_mask=None,
        cache=None,
        position_ids=torch.arange(seq_len)[None],  # [1, n]
        allow_is_causal_skip=False,
    )
    return mask[0, 0]


def our_visible_keys(window: int, seq_len: int) -> torch.Tensor:
    """AttentionLayer's convention: a query at p sees keys [p - W, p]."""
    q = torch.arange(seq_len)[:, None]  # [n, 1]
    k = torch.arange(seq_len)[None, :]  # [1, n]
    return (k <= q) & (k >= q - window)


@pytest.mark.parametrize("window", [0, 1, 2, 5, 9])
@pytest.mark.parametrize("arch", ["gpt-oss", "mimo-v2-flash", "mimo-sliding_window_size", "gemma3"])
def test_window_matches_transformers_masks(arch: str, window: int, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    make_tiny_model(
        tmp_path,
        arch="mimo-v2-flash" if arch.startswith("mimo") else arch,
        num_layers=2,
        sliding_window_size=window,
    )
    if arch == "mimo-sliding_window_size":
        # W given directly; transformers then ignores the stale sliding_window.
        hf = json.loads((tmp_path / "config.json").read_text())
        hf |= {"sliding_window_size": window, "sliding_window": 1000}
        write(tmp_path, hf)
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = load_model_config(tmp_path)
    assert ours.sliding_window_size == window
    seq_len = window + 6
    assert torch.equal(hf_visible_keys(hf_config, seq_len), our_visible_keys(window, seq_len))


def test_gemma3_reads_transformers_own_configs_new_and_older_fields() -> None:
    """What `Gemma3TextConfig` writes (nested per-kind RoPE), and the fields the published
    checkpoints carry (`rope_theta` for global layers, `rope_local_base_freq` for local ones,
    `rope_scaling` for global ones only, `sliding_window_pattern`): the same model."""
    transformers = pytest.importorskip("transformers")
    saved = transformers.Gemma3TextConfig(
        num_hidden_layers=12,
        head_dim=32,
        sliding_window=512,
        query_pre_attn_scalar=144,
        rope_parameters={
            F: {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            S: {"rope_type": "default", "rope_theta": 1e4},
        },
    ).to_dict() | {"architectures": ["Gemma3ForCausalLM"]}
    older = {k: v for k, v in saved.items() if k not in ("rope_parameters", "layer_types")}
    older |= {
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 6,
    }
    for hf in (saved, older):
        config = parse_model_config(hf)
        assert config.architecture == GEMMA3
        assert config.sliding_window_size == 511
        assert config.layer_types == ((S,) * 5 + (F,)) * 2
        assert config.attention_scale == 144**-0.5
        assert config.full_attention.rope.rope_type == "linear"
        assert config.full_attention.rope.factor == 8.0
        assert config.full_attention.rope.theta == 1e6
        assert (config.swa_attention.rope.rope_type, config.swa_attention.rope.theta) == (
            "default",
            1e4,
        )
        assert config.tie_word_embeddings and config.rms_norm_eps == 1e-6
        assert config.hidden_act == "gelu_pytorch_tanh" and config.final_logit_softcapping is None
    with pytest.raises(ModelConfigError, match="use_bidirectional_attention"):
        parse_model_config(saved | {"use_bidirectional_attention": True})
    with pytest.raises(ModelConfigError, match="attn_logit_softcapping"):
        parse_model_config(saved | {"attn_logit_softcapping": 50.0})


def test_olmo3_reads_transformers_own_config_and_the_older_rope_fields() -> None:
    """`Olmo3Config`'s nested per-kind RoPE, and the older `rope_theta` + `rope_scaling`,
    which go to the global layers only: the sliding ones keep θ 5·10⁵ (as Olmo3Config reads)."""
    transformers = pytest.importorskip("transformers")
    yarn = {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "attention_factor": 1.2,
    }
    saved = transformers.Olmo3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=8,
        rope_parameters={
            F: {"rope_theta": 1e6, **yarn},
            S: {"rope_type": "default", "rope_theta": 5e5},
        },
    ).to_dict() | {"architectures": ["Olmo3ForCausalLM"]}
    older = {k: v for k, v in saved.items() if k != "rope_parameters"}
    older |= {"rope_theta": 1e6, "rope_scaling": yarn}
    for hf in (saved, older):
        config = parse_model_config(hf)
        assert config.architecture == OLMO3 and config.layer_types == (S, S, S, F) * 2
        full, swa = config.full_attention.rope, config.swa_attention.rope
        assert full is not None and swa is not None
        assert (full.rope_type, full.theta, full.factor, full.attention_factor) == (
            "yarn",
            1e6,
            8.0,
            1.2,
        )
        assert (swa.rope_type, swa.theta) == ("default", 5e5)
        assert full.float32 and swa.float32
        assert config.swa_attention.num_kv_heads == 4 and config.sliding_window_size == 4095


def test_exaone4_layer_patterns_and_nope_global_layers() -> None:
    """EXAONE 4's layers by `sliding_window_pattern` (an int, or "LLLG" as the published
    configs write it): NoPE global layers with a window; RoPE everywhere without one."""
    transformers = pytest.importorskip("transformers")
    base = transformers.Exaone4Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8
    ).to_dict() | {"architectures": ["Exaone4ForCausalLM"]}
    del base["layer_types"]
    for pattern in (4, "LLLG"):
        config = parse_model_config(base | {"sliding_window_pattern": pattern})
        assert config.architecture == EXAONE4 and config.layer_types == (S, S, S, F) * 2
        assert config.full_attention.rope is None and config.swa_attention.rope is not None
        assert config.sliding_window_size == 4095
    dense = parse_model_config(base | {"sliding_window": None})
    assert dense.layer_types == (F,) * 8 and dense.full_attention.rope is not None
    assert dense.sliding_window_size is None
    with pytest.raises(ModelConfigError, match="sliding_window_pattern"):
        parse_model_config(base | {"sliding_window_pattern": "LLXG"})


def test_cohere2_reads_transformers_own_config() -> None:
    """`Cohere2Config`'s defaults: 3 sliding : 1 global, NoPE global layers, interleaved RoPE,
    head dim hidden / heads, LayerNorm eps, logit scale, tied embeddings."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.Cohere2Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8
    ).to_dict() | {"architectures": ["Cohere2ForCausalLM"]}
    config = parse_model_config(hf)
    assert config.architecture == COHERE2
    assert config.layer_types == (S, S, S, F) * 2
    assert config.full_attention.rope is None
    rope = config.swa_attention.rope
    assert rope is not None and rope.interleaved and rope.theta == 10_000.0
    assert config.swa_attention.head_dim == 16 and config.sliding_window_size == 4095
    assert (config.logit_scale, config.rms_norm_eps) == (0.0625, 1e-5)
    assert config.tie_word_embeddings
    with pytest.raises(ModelConfigError, match="hidden_act"):
        parse_model_config(hf | {"hidden_act": "gelu"})


def write(tmp_path: Path, hf: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def test_unknown_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    write(tmp_path, gpt_oss_dict(architectures=["LlamaForCausalLM"], model_type="llama"))
    with pytest.raises(UnknownArchitectureError) as err:
        load_model_config(tmp_path)
    message = str(err.value)
    assert "LlamaForCausalLM" in message
    assert "GptOssForCausalLM" in message and "MiMoV2FlashForCausalLM" in message


def test_model_type_stands_in_for_missing_architectures() -> None:
    hf = mimo_dict()
    del hf["architectures"]
    assert parse_model_config(hf).architecture == MIMO_V2_FLASH


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (gpt_oss_dict, "hidden_size"),
        (gpt_oss_dict, "num_key_value_heads"),
        (gpt_oss_dict, "num_local_experts"),
        (gpt_oss_dict, "sliding_window"),
        (mimo_dict, "v_head_dim"),
        (mimo_dict, "moe_intermediate_size"),
    ],
)
def test_missing_field_names_field_and_file(make: Any, field: str, tmp_path: Path) -> None:
    hf = make()
    del hf[field]
    path = write(tmp_path, hf) / "config.json"
    with pytest.raises(MissingConfigFieldError) as err:
        load_model_config(tmp_path)
    assert err.value.field == field
    assert f"missing required field {field!r} in {path}" in str(err.value)


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        (gpt_oss_dict(num_key_value_heads=3), "not a multiple"),
        (gpt_oss_dict(layer_types=[S, F]), "one kind per layer"),
        (gpt_oss_dict(layer_types=[S, F, "chunked_attention", F]), "'chunked_attention'"),
        (gpt_oss_dict(hidden_size="32"), "'hidden_size' must be an int"),
        (gpt_oss_dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1.0}), "llama3"),
        (mimo_dict(n_group=3), "n_group=3"),
        (mimo_dict(hidden_act="gelu"), "gelu"),
    ],
)
def test_inconsistent_configs_raise_typed_errors(hf: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        parse_model_config(hf)


def test_unreadable_config(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=re.escape("no config.json")):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="cannot read"):
        load_model_config(tmp_path)


def test_a_published_gemma3_multimodal_config_gives_its_language_model() -> None:
    """gemma-3-4b-it's config.json keeps only what differs from Gemma3TextConfig's defaults in
    its text_config: the parser fills them as transformers does."""
    transformers = pytest.importorskip("transformers")
    text = {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    }
    hf = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model"},
        "eos_token_id": [1, 106],
    }
    ours = parse_model_config(hf)
    theirs = transformers.Gemma3TextConfig(**text)
    assert ours.architecture == "Gemma3ForCausalLM"
    assert ours.vocab_size == theirs.vocab_size
    assert ours.num_heads == theirs.num_attention_heads
    assert ours.full_attention.num_kv_heads == theirs.num_key_value_heads
    assert ours.full_attention.head_dim == theirs.head_dim
    assert list(ours.layer_types) == theirs.layer_types
    assert ours.sliding_window_size == theirs.sliding_window - 1
    assert ours.eos_token_ids == (1, 106)
    with pytest.raises(MissingConfigFieldError, match="text_config"):
        parse_model_config({"architectures": ["Llama4ForConditionalGeneration"]})
