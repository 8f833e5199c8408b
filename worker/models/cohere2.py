"""Cohere2 / Command A (transformers' `Cohere2ForCausalLM`): three sliding-window layers per
global one by default, the global layers without position encoding (NoPE: `rope` None for the
full kind) and the local ones with interleaved RoPE (channel pairs, in float32); one LayerNorm
(no bias) feeds attention and the SwiGLU MLP side by side (`ParallelDecoderLayer`); logits are
multiplied by `logit_scale`; embeddings tied by default. Shards as the shared layers do."""

from __future__ import annotations

from torch import nn

from swaserve.worker.models.causal_lm import HybridCausalLM
from swaserve.worker.models.layers import DenseMLP, LayerNorm, ParallelDecoderLayer


class Cohere2ForCausalLM(HybridCausalLM):
    def make_layer(self, layer_id: int) -> nn.Module:
        return ParallelDecoderLayer(
            self.make_attention(layer_id),
            self.make_mlp(layer_id),
            self.make_norm(self.config.hidden_size),
        )

    def make_mlp(self, layer_id: int) -> nn.Module:
        return DenseMLP(
            self.config.hidden_size,
            self.config.intermediate_size,
            dtype=self.dtype,
            tp=self.tp,
            activation=self.config.hidden_act,
        )

    def make_norm(self, hidden_size: int) -> LayerNorm:
        return LayerNorm(hidden_size, self.config.rms_norm_eps, dtype=self.dtype)
