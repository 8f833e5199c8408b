"""RoPE: our inverse frequencies equal transformers' bit for bit (GPT-OSS YaRN, MiMo's per-kind
partial RoPE), and `apply_rotary` rotates only the leading rotary channels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swaserve.worker.models.config import RopeConfig, load_model_config
from swaserve.worker.models.rotary import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_interleaved,
    inverse_frequencies,
)
from swaserve.worker.models.tiny import make_tiny_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(("head_dim", "truncate"), [(8, False), (64, False), (64, True)])
def test_gpt_oss_yarn_matches_transformers(head_dim: int, truncate: bool, tmp_path: Path) -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    make_tiny_model(tmp_path, arch="gpt-oss", num_layers=2, head_dim=head_dim)
    config_path = tmp_path / "config.json"
    text = config_path.read_text().replace(
        '"truncate": false', f'"truncate": {str(truncate).lower()}'
    )
    config_path.write_text(text)
    theirs = GptOssRotaryEmbedding(transformers.AutoConfig.from_pretrained(tmp_path))
    ours = RotaryEmbedding(load_model_config(tmp_path).full_attention.rope)
    assert torch.equal(ours._inv_freq_cpu, theirs.inv_freq)
    assert ours.attention_scaling == theirs.attention_scaling
    positions = torch.arange(0, 4000, 37)  # [T]
    cos, sin = ours.cos_sin(positions, torch.float32)
    their_cos, their_sin = theirs(torch.zeros(1), positions[None])
    assert torch.equal(cos, their_cos[0]) and torch.equal(sin, their_sin[0])


@pytest.mark.parametrize("head_dim", [24, 16, 192])
def test_mimo_partial_rope_matches_transformers(head_dim: int, tmp_path: Path) -> None:
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import (
        MiMoV2FlashRotaryEmbedding,
    )

    make_tiny_model(tmp_path, arch="mimo-v2-flash", num_layers=2, head_dim=head_dim)
    theirs = MiMoV2FlashRotaryEmbedding(transformers.AutoConfig.from_pretrained(tmp_path))
    config = load_model_config(tmp_path)
    for kind in ("full_attention", "sliding_attention"):
        rope = config.full_attention.rope if kind == "full_attention" else config.swa_attention.rope
        inv_freq, scaling = inverse_frequencies(rope)
        assert torch.equal(inv_freq, getattr(theirs, f"{kind}_inv_freq"))
        assert scaling == 1.0
        assert rope.rotary_dim == 2 * inv_freq.numel()


def test_gemma3_per_kind_and_linear_rope_match_transformers(tmp_path: Path) -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    make_tiny_model(tmp_path, arch="gemma3", num_layers=6, head_dim=16)
    theirs = Gemma3RotaryEmbedding(transformers.AutoConfig.from_pretrained(tmp_path))
    config = load_model_config(tmp_path)
    assert config.full_attention.rope.rope_type == "linear"
    for kind in ("full_attention", "sliding_attention"):
        rope = config.full_attention.rope if kind == "full_attention" else config.swa_attention.rope
        inv_freq, scaling = inverse_frequencies(rope)
        assert torch.equal(inv_freq, getattr(theirs, f"{kind}_inv_freq"))
        assert scaling == getattr(theirs, f"{kind}_attention_scaling") == 1.0


def test_cohere2_interleaved_rope_matches_transformers(tmp_path: Path) -> None:
    from transformers.models.cohere2 import modeling_cohere2 as hf

    make_tiny_model(tmp_path, arch="cohere2", num_layers=4, hidden_size=64)
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    rope = load_model_config(tmp_path).swa_attention.rope
    assert rope is not None and rope.interleaved
    positions = torch.arange(7)
    cos, sin = RotaryEmbedding(rope).cos_sin(positions, torch.bfloat16)
    their_cos, their_sin = hf.Cohere2RotaryEmbedding(hf_config)(
        torch.zeros(1, dtype=torch.bfloat16), positions[None]
    )
    assert torch.equal(cos, their_cos[0, :, ::2]) and torch.equal(sin, their_sin[0, :, ::2])
    q = torch.randn(7, 4, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ours = apply_rotary_interleaved(q, cos, sin)
    theirs, _ = hf.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], q.transpose(0, 1)[None], their_cos, their_sin
    )
    assert torch.equal(ours, theirs[0].transpose(0, 1))


def test_llama3_rope_matches_transformers(tmp_path: Path) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    make_tiny_model(tmp_path, arch="exaone4", num_layers=4, head_dim=64, hidden_size=64)
    rope = load_model_config(tmp_path).swa_attention.rope
    assert rope is not None and rope.rope_type == "llama3"
    theirs, their_scaling = ROPE_INIT_FUNCTIONS["llama3"](
        transformers.AutoConfig.from_pretrained(tmp_path), "cpu"
    )
    inv_freq, scaling = inverse_frequencies(rope)
    assert torch.equal(inv_freq, theirs) and scaling == their_scaling == 1.0


def test_apply_rotary_passes_trailing_channels_and_keeps_norm() -> None:
    rope = RopeConfig("default", 10_000.0, head_dim=10, partial_rotary_factor=0.5)
    assert (rope.freq_dim, rope.rotary_dim) == (5, 6)  # HF: int(10 · 0.5) = 5 → 3 frequencies
    x = torch.randn(3, 2, 10, generator=torch.Generator().manual_seed(0))  # [T, H, D]
    cos, sin = RotaryEmbedding(rope).cos_sin(torch.tensor([0, 1, 7]), torch.float32)
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[0], x[0])  # position 0 is the identity
    assert torch.equal(y[..., 6:], x[..., 6:])
    pairs_x = x[..., :3].pow(2) + x[..., 3:6].pow(2)
    pairs_y = y[..., :3].pow(2) + y[..., 3:6].pow(2)
    assert torch.allclose(pairs_x, pairs_y, atol=1e-6)
