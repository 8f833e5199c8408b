"""EXAONE 4 (transformers' `Exaone4ForCausalLM`): three local layers per global one (LLLG), the
global layers without position encoding when the model has a window; post-norm blocks like
OLMo's (a norm after attention and after the MLP, none before); q and k RMS-normalized per head
before RoPE; RMSNorm casting before the weight (as MiMo's); SwiGLU MLP."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from swaserve.worker.models.causal_lm import DenseHybridCausalLM


class Exaone4ForCausalLM(DenseHybridCausalLM):
    norm_weight_after_cast: ClassVar[bool] = True
    qk_norm_per_head: ClassVar[bool] = True

    def make_layer(self, layer_id: int) -> nn.Module:
        return self.post_norm_layer(layer_id)
