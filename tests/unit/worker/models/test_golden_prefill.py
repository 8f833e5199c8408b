"""Golden prefill: our GPT-OSS and MiMo-V2-Flash, loaded by our loader and run through the
reference backend, give transformers' logits (float32, eager attention) over several tiny
configs: W = 0, 1 and larger windows, different layer patterns, GQA / MQA / MHA, MiMo's SWA KV
heads = 2 × full, tied and untied LM heads — alone, batched, and decoded token by token on a
cached prefix. bfloat16 runs and stays close to HF's bfloat16."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ref_backend import RefBackend, prefill_batch

from swaserve.worker.attention.base import ForwardBatch
from swaserve.worker.models.loader import load_model
from swaserve.worker.models.tiny import make_tiny_model

transformers = pytest.importorskip("transformers")

F, S = "full_attention", "sliding_attention"
TOLERANCE = 1e-4

CONFIGS: dict[str, dict[str, Any]] = {
    # W = 1; GQA 2; HF's alternating pattern (SWA first).
    "gpt-oss-w1-gqa2": dict(arch="gpt-oss", num_layers=2, sliding_window_size=1, num_kv_heads=2),
    # W = 4; MQA; full layers at both ends; the SwiGLU clamp bites; tied LM head.
    "gpt-oss-w4-mqa-tied-clamped": dict(
        arch="gpt-oss",
        num_layers=4,
        sliding_window_size=4,
        num_kv_heads=1,
        layer_types=[F, S, S, F],
        swiglu_limit=0.3,
        tie_word_embeddings=True,
    ),
    # W = 7; MHA, hidden 64, 8 heads; SWA only; 3 of 6 experts.
    "gpt-oss-w7-mha-swa-only": dict(
        arch="gpt-oss",
        num_layers=3,
        sliding_window_size=7,
        num_heads=8,
        num_kv_heads=8,
        hidden_size=64,
        layer_types=[S, S, S],
        num_experts=6,
        num_experts_per_tok=3,
    ),
    # W = 0: an SWA query sees only itself.
    "gpt-oss-w0": dict(arch="gpt-oss", num_layers=2, sliding_window_size=0),
    # W = 1; full KV heads 1, SWA 2 (GQA 2); dense layer 0 then MoE.
    "mimo-w1-kv1x2": dict(
        arch="mimo-v2-flash", num_layers=2, sliding_window_size=1, num_kv_heads=1
    ),
    # W = 4; SWA KV heads 4 = 2 × 2 (MHA on SWA layers); grouped top-k; scaled; tied.
    "mimo-w4-grouped-tied": dict(
        arch="mimo-v2-flash",
        num_layers=4,
        sliding_window_size=4,
        num_kv_heads=2,
        layer_types=[S, F, S, S],
        num_experts=8,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        tie_word_embeddings=True,
    ),
    # W = 6; hidden 64, 8 heads; Dk 16 with HF's odd partial RoPE (int(16 · 0.334) = 5 → 3
    # frequencies, 6 rotated channels); Dv 8; q/k/v biases; no V scale; unnormalized top-k;
    # dense, sparse, dense.
    "mimo-w6-odd-rope-bias": dict(
        arch="mimo-v2-flash",
        num_layers=3,
        sliding_window_size=6,
        num_heads=8,
        num_kv_heads=2,
        hidden_size=64,
        head_dim=16,
        v_head_dim=8,
        attention_bias=True,
        attention_value_scale=None,
        norm_topk_prob=False,
        mlp_layer_types=["dense", "sparse", "dense"],
    ),
    # EXAONE 4: NoPE global layer, per-head q/k norms, post-norm blocks, Llama 3 RoPE.
    "exaone4-w2-lllg": dict(arch="exaone4", num_layers=4, sliding_window_size=2, num_kv_heads=2),
    # Llama 4: chunks of 4 (the prompt spans several), RoPE + qk L2 norm on chunked layers,
    # NoPE global layers with temperature, dense and MoE (shared expert, 2 of 4) layers.
    "llama4-c4-gqa2": dict(arch="llama4", num_layers=4, sliding_window_size=4, num_kv_heads=2),
    # Llama 4: one expert per token as published, MHA, tied head, chunks of 3.
    "llama4-c3-top1-tied": dict(
        arch="llama4",
        num_layers=3,
        sliding_window_size=3,
        num_kv_heads=4,
        num_experts_per_tok=1,
        tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # Gemma 4: global layers with twice the head dim and one KV head, K = V, proportional
    # RoPE; q/k/v norms; the last 2 layers share the KV of earlier ones (with double-wide MLPs);
    # per-layer inputs; layer scalars; soft-cap.
    "gemma4-w3-kv-shared-ple": dict(
        arch="gemma4", num_layers=6, sliding_window_size=3, num_kv_heads=2
    ),
    # Gemma 4 26B-A4B's shape: a MoE block (2 of 4 GeGLU experts) beside every layer's MLP.
    "gemma4-w3-moe": dict(
        arch="gemma4", num_layers=3, sliding_window_size=3, num_kv_heads=2, enable_moe_block=True
    ),
    # Gemma 4 without per-layer inputs, K != V, MQA on local layers, no shared layers.
    "gemma4-w2-plain": dict(
        arch="gemma4",
        num_layers=4,
        sliding_window_size=2,
        num_kv_heads=1,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=False,
    ),
    # OLMo 3: post-norm blocks, projection-wide q/k norms, YaRN on the global layer.
    "olmo3-w2-ssf": dict(
        arch="olmo3",
        num_layers=3,
        sliding_window_size=2,
        num_kv_heads=2,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
    # Cohere2: interleaved RoPE on sliding layers, NoPE global ones, LayerNorm, logit scale.
    "cohere2-w3-sssf": dict(arch="cohere2", num_layers=4, sliding_window_size=3, num_kv_heads=2),
    # Gemma 3: sandwich norms, per-head q/k norms, linear RoPE on global layers, softcap.
    "gemma3-w2-gqa2": dict(
        arch="gemma3",
        num_layers=3,
        sliding_window_size=2,
        num_kv_heads=2,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
}


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 262, (length,), generator=torch.Generator().manual_seed(seed))  # [n]


def hf_logits(model_dir: Path, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager"
    )
    with torch.no_grad():
        return model(ids[None]).logits[0]  # [n, vocab]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    kwargs = CONFIGS[request.param]
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), seed=7, **kwargs)
    length = max(24, 3 * kwargs["sliding_window_size"] + 5)
    return request.param, model_dir, prompt(length, seed=1)


def test_prefill_logits_match_transformers(tiny) -> None:
    name, model_dir, ids = tiny
    ours = load_model(model_dir, RefBackend())(prefill_batch([ids]))  # [n, vocab]
    theirs = hf_logits(model_dir, ids, torch.float32)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < TOLERANCE, name


def test_batched_prefill_gives_each_request_its_own_logits(tiny) -> None:
    name, model_dir, ids = tiny
    short = prompt(9, seed=2)
    model = load_model(model_dir, RefBackend())
    last = model(prefill_batch([ids, short], logits_positions="last"))  # [2, vocab]
    alone = [hf_logits(model_dir, p, torch.float32)[-1] for p in (ids, short)]
    assert (last - torch.stack(alone)).abs().max().item() < TOLERANCE, name


def test_decode_after_cached_prefix_matches_prefill_logits(tiny) -> None:
    """Prefill half the prompt, then feed the rest one token per step on top of the cached
    prefix: each step's logits are HF's prefill logits at that position."""
    name, model_dir, ids = tiny
    model = load_model(model_dir, RefBackend())
    theirs = hf_logits(model_dir, ids, torch.float32)  # [n, vocab]
    n, half = ids.numel(), ids.numel() // 2
    slots = torch.arange(1, n + 1)  # [n] int64, full slot of each position
    steps = [model(prefill_batch([ids[:half]], logits_positions="last"))]
    for pos in range(half, n):
        batch = ForwardBatch.from_slots(
            input_ids=ids[pos : pos + 1],
            positions=torch.tensor([pos]),
            prefix_lens=torch.tensor([pos]),
            seq_lens=torch.tensor([pos + 1]),
            req_token_slots=[slots[: pos + 1]],
            out_full_loc=slots[pos : pos + 1],
        )
        steps.append(model(batch))
    ours = torch.cat(steps)  # [n - half + 1, vocab]
    assert (ours - theirs[half - 1 :]).abs().max().item() < TOLERANCE, name


@pytest.mark.parametrize(
    "arch",
    ["gpt-oss", "mimo-v2-flash", "gemma3", "gemma4", "cohere2", "olmo3", "exaone4", "llama4"],
)
def test_bfloat16_prefill_runs_close_to_transformers(arch: str, tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, arch=arch, num_layers=2, sliding_window_size=3, seed=3)
    ids = prompt(16, seed=4)
    model = load_model(model_dir, RefBackend(), dtype=torch.bfloat16)
    ours = model(prefill_batch([ids]))
    theirs = hf_logits(model_dir, ids, torch.bfloat16)
    reference = hf_logits(model_dir, ids, torch.float32)
    assert ours.dtype == torch.bfloat16
    assert torch.isfinite(ours).all()
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    # Both bf16 runs are within bf16 rounding of each other and of the float32 run.
    assert (ours.float() - theirs.float()).abs().max().item() < 0.05
    assert (ours.float() - reference).abs().max().item() < 0.1
