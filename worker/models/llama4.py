"""Llama 4 text (transformers' `Llama4ForCausalLM`): chunked local layers (a query reads only its
own chunk of `attention_chunk_size` tokens; RoPE on interleaved pairs in float32, then, with
`use_qk_norm`, q and k RMS-normalized per head without weight) and global layers without
position encoding whose queries are scaled by the temperature tuning (both in `Attention`, from
the config). MoE layers add an always-on shared SwiGLU expert to the routed one: the router
keeps each token's top-k logits, their sigmoid scales the token *before* its expert (not the
expert's output), and the routed outputs are summed. Dense layers have a SwiGLU of
`intermediate_size_mlp`. The block is pre-norm; the MLP sits under `feed_forward`, as in HF.

Tensor parallelism: the router is replicated; every expert is split over its intermediate
dimension as MiMo's are (here in HF's input-major layout: gate_up_proj [E, D, 2I], columns
[i0, i1) gate and [I + i0, I + i1) up; down_proj [E, I, D], rows [i0, i1)); the routed partial
outputs are all-reduced, the shared expert is a `DenseMLP` (it reduces its own)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.worker.models.causal_lm import HybridCausalLM
from swaserve.worker.models.config import ModelConfig
from swaserve.worker.models.layers import BatchedExperts, DecoderLayer, DenseMLP, glu
from swaserve.worker.models.param_shard import ParamShard
from swaserve.worker.models.tp_layers import fused_segments
from swaserve.worker.runner.parallel import TPGroup


class Llama4Experts(BatchedExperts):
    """SwiGLU experts in HF's layout: gate_up_proj [E, D, 2I] (gate columns, then up),
    down_proj [E, I, D]; no biases."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        e, d, i_all = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size
        gate_cols, up_cols = fused_segments([i_all, i_all], tp, "moe intermediate_size")
        i = gate_cols[1] - gate_cols[0]
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, d, 2 * i, dtype=dtype))  # [E, D, 2I_r]
        self.down_proj = nn.Parameter(torch.empty(e, i, d, dtype=dtype))  # [E, I_r, D]
        self.param_shards = {
            "gate_up_proj": ParamShard((e, d, 2 * i_all), 2, (gate_cols, up_cols), 2 * i),
            "down_proj": ParamShard((e, i_all, d), 1, (gate_cols,), i),
        }
        self.expert_elements = 3 * d * i
        self.expert_weight_names = ("gate_up_proj", "down_proj")

    def expert_outputs(
        self,
        xs: torch.Tensor,  # [n, C, D]
        experts: torch.Tensor | None,  # [n] int64, or None: every expert in order
    ) -> torch.Tensor:  # [n, C, D]
        gate_up = torch.bmm(xs, self.expert_weight("gate_up_proj", experts))  # [n, C, 2I]
        return torch.bmm(self.activation(gate_up), self.expert_weight("down_proj", experts))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: silu(gate) · up, gate the first half."""
        return glu(gate_up)

    def stacked_expert_weights(self) -> tuple[torch.Tensor, None, torch.Tensor]:
        e, d, two_i = self.gate_up_proj.shape
        gate_up = self.gate_up_proj.transpose(1, 2).reshape(e * two_i, d)  # [E·2I, D]
        down = self.down_proj.permute(2, 0, 1).reshape(d, -1)  # [D, E·I]
        return gate_up, None, down


class Llama4Router(nn.Module):
    """Router logits in the model dtype; a token's top-k logits through a sigmoid (float32,
    cast back) are its experts' input scales."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        e, d = config.moe.num_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(e, d, dtype=dtype))  # [E, D]
        self.top_k = config.moe.num_experts_per_tok

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales [T, k] in x's dtype, expert ids [T, k] int64) for x [T, D]."""
        logits = F.linear(x, self.weight)  # [T, E]
        top, index = torch.topk(logits, self.top_k, dim=1)
        return torch.sigmoid(top.float()).to(x.dtype), index


class Llama4MoE(nn.Module):
    """shared_expert(x) + Σ_k expert_k(x · scale_k); the routed part summed over the TP group."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.experts = Llama4Experts(config, dtype=dtype, tp=self.tp)
        self.router = Llama4Router(config, dtype=dtype)
        self.shared_expert = DenseMLP(
            config.hidden_size,
            config.moe.shared_expert_intermediate_size,
            dtype=dtype,
            tp=self.tp,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D]
        t, d = x.shape
        scales, index = self.router(x)  # [T, k], [T, k]
        k = index.shape[1]
        routed_in = (x.unsqueeze(1) * scales.unsqueeze(-1)).reshape(t * k, d)  # [T·k, D]
        ones = torch.ones(t * k, 1, dtype=x.dtype, device=x.device)  # [T·k, 1]
        routed = self.experts(routed_in, index.reshape(t * k, 1), ones).view(t, k, d).sum(dim=1)
        return self.shared_expert(x) + self.tp.all_reduce(routed)


class Llama4ForCausalLM(HybridCausalLM):
    def make_layer(self, layer_id: int) -> nn.Module:
        d = self.config.hidden_size
        return DecoderLayer(
            self.make_attention(layer_id),
            self.make_mlp(layer_id),
            self.make_norm(d),
            self.make_norm(d),
            mlp_name="feed_forward",  # HF's name for it
        )

    def make_mlp(self, layer_id: int) -> nn.Module:
        if self.config.mlp_layer_types[layer_id] == "dense":
            return DenseMLP(
                self.config.hidden_size, self.config.intermediate_size, dtype=self.dtype, tp=self.tp
            )
        return Llama4MoE(self.config, dtype=self.dtype, tp=self.tp)
