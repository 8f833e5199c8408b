"""OLMo 3 (transformers' `Olmo3ForCausalLM`): three sliding-window layers per global one by
default, per-kind RoPE (θ 5·10⁵; the global layers may use YaRN), a SwiGLU MLP, and OLMo's
details:

- post-norm blocks: x + norm(attn(x)), then x + norm(mlp(x)) — no norm before either
  (`SandwichDecoderLayer` with identities in front);
- q and k are RMS-normalized over the whole projection (all heads together) before RoPE
  (`ProjectionRMSNorm`; under TP the sum of squares is all-reduced over the group).
"""

from __future__ import annotations

from torch import nn

from swaserve.worker.models.causal_lm import DenseHybridCausalLM
from swaserve.worker.models.layers import (
    Attention,
    ProjectionRMSNorm,
)
from swaserve.worker.runner.parallel import kv_head_range


class Olmo3ForCausalLM(DenseHybridCausalLM):
    def make_layer(self, layer_id: int) -> nn.Module:
        return self.post_norm_layer(layer_id)

    def make_attention(self, layer_id: int) -> Attention:
        attention = super().make_attention(layer_id)
        config, tp = self.config, self.tp
        kind = config.attention_kind(layer_id)
        dk, heads, kv_heads = kind.head_dim, config.num_heads, kind.num_kv_heads
        h0 = tp.rank * attention.num_heads
        kv0, kv1 = kv_head_range(kv_heads, tp.rank, tp.world_size)
        eps = config.rms_norm_eps
        attention.q_norm = ProjectionRMSNorm(
            heads * dk, (h0 * dk, (h0 + attention.num_heads) * dk), eps, dtype=self.dtype, tp=tp
        )
        attention.k_norm = ProjectionRMSNorm(
            kv_heads * dk,
            (kv0 * dk, kv1 * dk),
            eps,
            dtype=self.dtype,
            tp=tp,
            replication=max(1, tp.world_size // kv_heads),
        )
        attention.norms_whole_projection = True
        return attention
