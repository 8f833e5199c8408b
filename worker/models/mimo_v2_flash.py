"""MiMo-V2-Flash (transformers' `MiMoV2FlashForCausalLM`): full attention at layer 0 and every
6th layer, SWA elsewhere with twice the KV heads and sinks; K head dim ≠ V head dim; V scaled by
`attention_value_scale`; per-kind partial RoPE; "dense" SwiGLU MLP layers and "sparse" MoE layers
with a DeepSeek-V3 sigmoid router (grouped top-k, score-correction bias).

Tensor parallelism: the router is replicated; every expert is split over its intermediate
dimension: rank r's units [i0, i1) are gate_up_proj rows [i0, i1) (gate) and [I + i0, I + i1)
(up), and down_proj columns [i0, i1); the partial outputs are all-reduced. Dense layers are
column-parallel gate/up and row-parallel down (`DenseMLP`)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.worker.models.causal_lm import HybridCausalLM
from swaserve.worker.models.config import ModelConfig
from swaserve.worker.models.layers import BatchedExperts, DenseMLP, glu
from swaserve.worker.models.param_shard import ParamShard
from swaserve.worker.models.tp_layers import fused_segments
from swaserve.worker.runner.parallel import TPGroup


class MiMoV2FlashTopkRouter(nn.Module):
    """Sigmoid scores; experts chosen by score + e_score_correction_bias within the `topk_group`
    best groups (a group's score is the sum of its two best); weights are the plain scores of the
    chosen experts, renormalized (norm_topk_prob) and scaled. Always float32, as in HF."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        self.num_experts, self.top_k = moe.num_experts, moe.num_experts_per_tok
        self.n_group, self.topk_group = moe.n_group, moe.topk_group
        self.norm_topk_prob = moe.norm_topk_prob
        self.routed_scaling_factor = moe.routed_scaling_factor
        e, d = moe.num_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(e, d, dtype=torch.float32))  # [E, D] float32
        self.register_buffer(
            "e_score_correction_bias", torch.empty(e, dtype=torch.float32)
        )  # [E] float32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights [T, k] float32, top-k expert ids [T, k] int64) for x [T, D]."""
        t = x.shape[0]
        scores = F.linear(x.float(), self.weight).sigmoid()  # [T, E] float32
        choice = scores + self.e_score_correction_bias  # [T, E] float32
        per_group = self.num_experts // self.n_group
        grouped = choice.view(t, self.n_group, per_group)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_index = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_index, 1)  # [T, G]
        expert_mask = group_mask[:, :, None].expand(t, self.n_group, per_group).reshape(t, -1)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        top_k_index = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, top_k_index)  # [T, k] float32
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, top_k_index


class MiMoV2FlashExperts(BatchedExperts):
    """Experts as packed tensors in HF's layout: gate_up_proj [E, 2I, D] (gate rows, then up
    rows), down_proj [E, D, I]; no biases. On a TP rank, I is its share I_r and the output
    is partial (see the module docstring)."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        e, d, i_all = config.moe.num_experts, config.hidden_size, config.moe.intermediate_size
        gate_rows, up_rows = fused_segments([i_all, i_all], tp, "moe intermediate_size")
        i = gate_rows[1] - gate_rows[0]
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d, dtype=dtype))  # [E, 2I_r, D]
        self.down_proj = nn.Parameter(torch.empty(e, d, i, dtype=dtype))  # [E, D, I_r]
        self.param_shards = {
            "gate_up_proj": ParamShard((e, 2 * i_all, d), 1, (gate_rows, up_rows), 2 * i),
            "down_proj": ParamShard((e, d, i_all), 2, (gate_rows,), i),
        }
        self.expert_elements = 3 * d * i  # gate/up and down weights of one expert
        self.expert_weight_names = ("gate_up_proj", "down_proj")

    def expert_outputs(
        self,
        xs: torch.Tensor,  # [n, C, D]
        experts: torch.Tensor | None,  # [n] int64, or None: every expert in order
    ) -> torch.Tensor:  # [n, C, D]
        gate_up_w = self.expert_weight("gate_up_proj", experts)  # [n, 2I, D]
        gate_up = torch.bmm(xs, gate_up_w.transpose(1, 2))  # [n, C, 2I]
        down_w = self.expert_weight("down_proj", experts)  # [n, D, I]
        return torch.bmm(self.activation(gate_up), down_w.transpose(1, 2))  # [n, C, D]

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: silu(gate) · up, gate the first half."""
        return glu(gate_up)

    def stacked_expert_weights(self) -> tuple[torch.Tensor, None, torch.Tensor]:
        e, d, i = self.down_proj.shape
        gate_up = self.gate_up_proj.reshape(-1, d)  # [E·2I, D]
        return gate_up, None, self.down_proj.permute(1, 0, 2).reshape(d, e * i)  # [D, E·I]


class MiMoV2FlashMoE(nn.Module):
    """Replicated router, sharded experts, their partial outputs summed over the TP group."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.experts = MiMoV2FlashExperts(config, dtype=dtype, tp=self.tp)
        self.gate = MiMoV2FlashTopkRouter(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.gate(x)
        return self.tp.all_reduce(self.experts(x, index, weights))


class MiMoV2FlashForCausalLM(HybridCausalLM):
    # The released checkpoint carries multi-token-prediction layers, which HF does not run and
    # we run only as drafts (`models.mtp`: built then, and loaded as any parameter).
    ignored_checkpoint_tensors: ClassVar[tuple[str, ...]] = (r"^model\.mtp\.",)
    norm_weight_after_cast: ClassVar[bool] = True

    def make_mlp(self, layer_id: int) -> nn.Module:
        if self.config.mlp_layer_types[layer_id] == "dense":
            return DenseMLP(
                self.config.hidden_size,
                self.config.intermediate_size,
                dtype=self.dtype,
                tp=self.tp,
            )
        return MiMoV2FlashMoE(self.config, dtype=self.dtype, tp=self.tp)
