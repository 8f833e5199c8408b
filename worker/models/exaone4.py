"""EXAONE 4 (transformers' `Exaone4ForCausalLM`): three local layers per global one (LLLG), the
global layers without position encoding when the model has a window; post-norm blocks like
OLMo's (a norm after attention and after the MLP, none before); q and k RMS-normalized per head
before RoPE; RMSNorm casting before the weight (as MiMo's); SwiGLU MLP."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from swaserve.worker.models.causal_lm import HybridCausalLM
from swaserve.worker.models.layers import Attention, DenseMLP, SandwichDecoderLayer


class Exaone4ForCausalLM(HybridCausalLM):
    norm_weight_after_cast: ClassVar[bool] = True

    def make_layer(self, layer_id: int) -> nn.Module:
        d = self.config.hidden_size
        return SandwichDecoderLayer(
            self.make_attention(layer_id),
            self.make_mlp(layer_id),
            nn.Identity(),
            self.make_norm(d),
            nn.Identity(),
            self.make_norm(d),
        )

    def make_attention(self, layer_id: int) -> Attention:
        attention = super().make_attention(layer_id)
        head_dim = self.config.attention_kind(layer_id).head_dim
        attention.q_norm = self.make_norm(head_dim)
        attention.k_norm = self.make_norm(head_dim)
        return attention

    def make_mlp(self, layer_id: int) -> nn.Module:
        return DenseMLP(
            self.config.hidden_size,
            self.config.intermediate_size,
            dtype=self.dtype,
            tp=self.tp,
            activation=self.config.hidden_act,
        )
