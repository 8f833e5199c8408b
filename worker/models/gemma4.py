"""Gemma 4 text (transformers' `Gemma4ForCausalLM`): local sliding-window and global layers
(5:1 by default, the last one global), Gemma 3's sandwich blocks and GeGLU MLP, and Gemma 4's own
attention and inputs:

- the global layers have their own head dim and KV heads (`AttentionKindConfig` per kind) and,
  with `attention_k_eq_v`, no v_proj: V is the K projection before k's norm;
- q and k are RMS-normalized per head (RMSNorm × weight, in float32), v without weight; the
  softmax scale is 1; the global layers' RoPE is proportional (a quarter of each half rotates);
- KV-shared layers (the last `num_kv_shared_layers`) own no KV: they read the KV the last
  earlier layer of their kind wrote this step (`AttentionLayer.kv_layer_id`), and the pools have
  no room for them; with `use_double_wide_mlp` their MLP is twice as wide;
- per-layer inputs (`hidden_size_per_layer_input` P): each token gets, per layer, the sum of a
  P-wide embedding and a projection of its input embedding, normed, scaled by 2^-1/2; a layer
  gates it with its hidden state, projects it back and adds it, normed, to the residual;
- every layer ends by scaling its output by its `layer_scalar`;
- with `enable_moe_block` (26B-A4B) every layer adds a MoE block beside its MLP: a router on
  the block's input (RMS-normalized without weight, × `scale` · D^-1/2, softmax in float32,
  top-k renormalized, × `per_expert_scale`) over GeGLU experts, each branch with its own
  post-norm, their sum post-normed once more.

Tensor parallelism: attention and MLPs shard as the other dense models'; the per-layer input
tables shard by vocabulary, the small per-layer projections are held whole on every rank.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from swaserve.worker.attention.base import AttentionBackend, ForwardBatch
from swaserve.worker.attention.static_decode import DecodeBatch
from swaserve.worker.models.causal_lm import DenseHybridCausalLM
from swaserve.worker.models.config import ModelConfig
from swaserve.worker.models.layers import (
    ACTIVATIONS,
    Attention,
    DenseMLP,
    RMSNorm,
    glu,
    l2_norm,
)
from swaserve.worker.models.mimo_v2_flash import MiMoV2FlashExperts
from swaserve.worker.models.rotary import apply_rotary
from swaserve.worker.models.tp_layers import VocabParallelEmbedding
from swaserve.worker.runner.parallel import TPGroup


class Gemma4Attention(Attention):
    """q / k / v per-head norms (v without weight), K = V on global layers with
    `attention_k_eq_v`, and no K/V of its own on a KV-shared layer."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(config, layer_id, backend, dtype=dtype, tp=tp)
        kind = config.attention_kind(layer_id)
        eps = config.rms_norm_eps
        self.eps = eps
        self.shares_kv = not self.layer.writes_kv
        self.k_eq_v = kind.k_eq_v
        self.value_norm = config.value_norm
        self.q_norm = RMSNorm(kind.head_dim, eps, weight_after_cast=False, dtype=dtype)
        if self.shares_kv:
            del self.k_proj, self.v_proj
        else:
            self.k_norm = RMSNorm(kind.head_dim, eps, weight_after_cast=False, dtype=dtype)
            if self.k_eq_v:
                del self.v_proj

    def forward(
        self,
        hidden: torch.Tensor,  # [T, D]
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,  # 2 × [T, R/2]
        batch: ForwardBatch | DecodeBatch,
    ) -> torch.Tensor:  # [T, D]
        t = hidden.shape[0]
        if self.qkv_proj is not None:
            projected = self.qkv_proj(hidden)
            q, k_raw = projected[0], projected[1]
            v_raw = projected[2] if len(projected) > 2 else k_raw
        else:
            q = self.q_proj(hidden)
            k_raw = None if self.shares_kv else self.k_proj(hidden)
            v_raw = k_raw if self.shares_kv or self.k_eq_v else self.v_proj(hidden)
        assert cos_sin is not None  # every Gemma 4 layer has RoPE
        q = apply_rotary(self.q_norm(q.view(t, self.num_heads, self.head_dim)), *cos_sin)
        if k_raw is None or v_raw is None:  # KV-shared: the backend reads the source layer's
            k = q.new_empty(t, self.num_kv_heads, self.head_dim)
            v = q.new_empty(t, self.num_kv_heads, self.v_head_dim)
        else:
            k = apply_rotary(self.k_norm(k_raw.view(t, self.num_kv_heads, self.head_dim)), *cos_sin)
            v = v_raw.view(t, self.num_kv_heads, self.v_head_dim)
            if self.value_norm:
                v = l2_norm(v, self.eps)
        out = self.backend.forward(q, k, v, self.layer, batch)  # [T, H, Dv]
        return self.o_proj(out.reshape(t, self.num_heads * self.v_head_dim))


class Gemma4Experts(MiMoV2FlashExperts):
    """MiMo's packed layout (gate_up_proj [E, 2I, D], down_proj [E, D, I], split the same way
    under TP) with Gemma's GeGLU."""

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return glu(gate_up, "gelu_pytorch_tanh")


class Gemma4Router(nn.Module):
    """Top-k experts of each token and their weights (float32), as HF's Gemma4TextRouter."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        d, e = config.hidden_size, config.moe.num_experts
        self.eps, self.top_k, self.root = (
            config.rms_norm_eps,
            config.moe.num_experts_per_tok,
            d**-0.5,
        )
        self.proj = nn.Linear(d, e, bias=False, dtype=dtype)
        self.scale = nn.Parameter(torch.empty(d, dtype=dtype))  # [D]
        self.per_expert_scale = nn.Parameter(torch.empty(e, dtype=dtype))  # [E]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = l2_norm(x, self.eps) * self.scale * self.root
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)  # [T, E]
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index  # [T, k] float32, [T, k]


class Gemma4DecoderLayer(nn.Module):
    """Sandwich norms around attention and the MLP; then the per-layer input (if the model has
    them) added through its gate, projection and norm; then × `layer_scalar`."""

    def __init__(
        self,
        config: ModelConfig,
        attention: Attention,
        mlp: nn.Module,
        norm,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        d, p = config.hidden_size, config.per_layer_input_size
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = norm(d)
        self.post_attention_layernorm = norm(d)
        self.pre_feedforward_layernorm = norm(d)
        self.post_feedforward_layernorm = norm(d)
        self.layer_scalar = nn.Parameter(torch.empty(1, dtype=dtype))  # [1]
        self.act = ACTIVATIONS[config.hidden_act]
        self.tp = tp or TPGroup.single()
        if config.moe.num_experts:
            self.router = Gemma4Router(config, dtype=dtype)
            self.experts = Gemma4Experts(config, dtype=dtype, tp=self.tp)
            self.post_feedforward_layernorm_1 = norm(d)
            self.post_feedforward_layernorm_2 = norm(d)
            self.pre_feedforward_layernorm_2 = norm(d)
        if p:
            self.per_layer_input_gate = nn.Linear(d, p, bias=False, dtype=dtype)
            self.per_layer_projection = nn.Linear(p, d, bias=False, dtype=dtype)
            self.post_per_layer_input_norm = norm(d)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, D]
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        batch: ForwardBatch | DecodeBatch,
        per_layer_input: torch.Tensor | None = None,  # [T, P]
    ) -> torch.Tensor:  # [T, D]
        attn = self.self_attn(self.input_layernorm(hidden), cos_sin, batch)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        if hasattr(self, "experts"):
            weights, index = self.router(hidden)
            routed = self.experts(self.pre_feedforward_layernorm_2(hidden), index, weights)
            mlp = self.post_feedforward_layernorm_1(mlp) + self.post_feedforward_layernorm_2(
                self.tp.all_reduce(routed)
            )
        hidden = hidden + self.post_feedforward_layernorm(mlp)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar


class Gemma4ForCausalLM(DenseHybridCausalLM):
    embed_scale: ClassVar[bool] = True

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype = torch.float32,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(config, backend, dtype=dtype, tp=tp)
        p, n = config.per_layer_input_size, config.num_layers
        if p:
            self.model.embed_tokens_per_layer = VocabParallelEmbedding(
                config.per_layer_input_vocab_size, n * p, dtype=dtype, tp=self.tp
            )
            self.model.per_layer_model_projection = nn.Linear(
                config.hidden_size, n * p, bias=False, dtype=dtype
            )
            self.model.per_layer_projection_norm = self.make_norm(p)
            self._per_layer_multiplier = float(torch.tensor(p**0.5, dtype=dtype, device="cpu"))

    def make_layer(self, layer_id: int) -> nn.Module:
        return Gemma4DecoderLayer(
            self.config,
            self.make_attention(layer_id),
            self.make_mlp(layer_id),
            self.make_norm,
            self.dtype,
            self.tp,
        )

    def make_attention(self, layer_id: int) -> Attention:
        return Gemma4Attention(self.config, layer_id, self.backend, dtype=self.dtype, tp=self.tp)

    def make_mlp(self, layer_id: int) -> nn.Module:
        wide = self.config.double_wide_shared_mlp and self.config.kv_source(layer_id) != layer_id
        return DenseMLP(
            self.config.hidden_size,
            self.config.intermediate_size * (2 if wide else 1),
            dtype=self.dtype,
            tp=self.tp,
            activation=self.config.hidden_act,
        )

    def make_norm(self, hidden_size: int) -> RMSNorm:
        return RMSNorm(
            hidden_size, self.config.rms_norm_eps, weight_after_cast=False, dtype=self.dtype
        )

    def run_layers(
        self,
        hidden: torch.Tensor,  # [T, D]: the scaled input embeddings
        cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]],
        batch: ForwardBatch | DecodeBatch,
    ) -> torch.Tensor:  # [T, D]
        p, n = self.config.per_layer_input_size, self.config.num_layers
        inputs: list[torch.Tensor | None] = [None] * n
        if p:
            t = hidden.shape[0]
            own = self.model.embed_tokens_per_layer(batch.input_ids) * self._per_layer_multiplier
            projected = (
                self.model.per_layer_model_projection(hidden) * self.config.hidden_size**-0.5
            )
            projected = self.model.per_layer_projection_norm(projected.view(t, n, p))
            combined = (projected + own.view(t, n, p)) * 2.0**-0.5  # [T, L, P]
            inputs = list(combined.unbind(1))
        for layer, kind, per_layer in zip(
            self.model.layers, self.config.layer_types, inputs, strict=True
        ):
            hidden = layer(hidden, cos_sin.get(kind), batch, per_layer)
        return hidden
