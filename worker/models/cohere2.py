"""Cohere2 / Command A (transformers' `Cohere2ForCausalLM`): three sliding-window layers per
global one by default, the global layers without position encoding (NoPE: `rope` None for the
full kind) and the local ones with interleaved RoPE (channel pairs, in float32); one LayerNorm
(no bias) feeds attention and the SwiGLU MLP side by side (`ParallelDecoderLayer`); logits are
multiplied by `logit_scale`; embeddings tied by default. Shards as the shared layers do."""

from __future__ import annotations

from torch import nn

from swaserve.worker.models.causal_lm import DenseHybridCausalLM
from swaserve.worker.models.layers import LayerNorm, ParallelDecoderLayer


class Cohere2ForCausalLM(DenseHybridCausalLM):
    def make_layer(self, layer_id: int) -> nn.Module:
        return ParallelDecoderLayer(
            self.make_attention(layer_id),
            self.make_mlp(layer_id),
            self.make_norm(self.config.hidden_size),
        )

    def make_norm(self, hidden_size: int) -> LayerNorm:
        return LayerNorm(hidden_size, self.config.rms_norm_eps, dtype=self.dtype)
