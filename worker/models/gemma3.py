"""Gemma 3 text (transformers' `Gemma3ForCausalLM`): local sliding-window and global layers
(5:1 by default), each kind with its own RoPE (local θ 10⁴; global θ 10⁶, linearly scaled in
the larger models), a dense GeGLU MLP in every layer, and Gemma's own details:

- RMSNorm scales by 1 + weight, in float32 (`RMSNorm(unit_offset=True)`), four per layer:
  before and after attention, before and after the MLP (`SandwichDecoderLayer`);
- q and k are RMS-normalized per head before RoPE (`q_norm`, `k_norm` over Dk);
- the softmax scale is query_pre_attn_scalar^-0.5, not Dk^-0.5 (`ModelConfig.attention_scale`);
- embeddings are multiplied by sqrt(hidden_size) as the model dtype rounds it;
- logits are soft-capped when `final_logit_softcapping` is set.

Everything shards as the shared layers do: per-head norms hold their weight whole on every rank.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from swaserve.worker.models.causal_lm import DenseHybridCausalLM
from swaserve.worker.models.layers import RMSNorm, SandwichDecoderLayer


class Gemma3ForCausalLM(DenseHybridCausalLM):
    embed_scale: ClassVar[bool] = True
    qk_norm_per_head: ClassVar[bool] = True

    def make_layer(self, layer_id: int) -> nn.Module:
        d = self.config.hidden_size
        norms = [self.make_norm(d) for _ in range(4)]
        return SandwichDecoderLayer(self.make_attention(layer_id), self.make_mlp(layer_id), *norms)

    def make_norm(self, hidden_size: int) -> RMSNorm:
        return RMSNorm(
            hidden_size,
            self.config.rms_norm_eps,
            weight_after_cast=False,
            dtype=self.dtype,
            unit_offset=True,
        )
