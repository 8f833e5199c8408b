"""GPT-OSS (transformers' `GptOssForCausalLM`): alternating sliding / full attention layers, all
with sinks and q/k/v/o biases, one YaRN RoPE, and a MoE MLP in every layer — softmax over the
top-k router logits, clamped SwiGLU experts with biases.

Tensor parallelism: the router is replicated; every expert is split over its intermediate
dimension. gate_up_proj interleaves gate and up columns (2j, 2j + 1 belong to intermediate unit
j), so rank r's units [i0, i1) are the contiguous columns [2·i0, 2·i1), gate and up together,
with their biases; down_proj rows [i0, i1). The partial outputs are all-reduced; the down bias is
added on rank 0 only."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.worker.models.causal_lm import HybridCausalLM
from swaserve.worker.models.config import ModelConfig
from swaserve.worker.models.layers import BatchedExperts, RMSNorm
from swaserve.worker.models.param_shard import ParamShard
from swaserve.worker.runner.parallel import TPGroup, shard_range


class GptOssTopKRouter(nn.Module):
    """Linear router with bias; the top-k logits are softmaxed among themselves."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = config.moe.num_experts_per_tok
        e, d = config.moe.num_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(e, d, dtype=dtype))  # [E, D]
        self.bias = nn.Parameter(torch.empty(e, dtype=dtype))  # [E]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights [T, k], top-k expert ids [T, k] int64) for x [T, D]."""
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        top_value, top_index = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
        return torch.softmax(top_value, dim=1, dtype=top_value.dtype), top_index


class GptOssExperts(BatchedExperts):
    """Experts as packed tensors in HF's transposed layout: gate_up_proj [E, D, 2I] with gate and
    up interleaved (even / odd columns), down_proj [E, I, D], each with a bias. On a TP rank,
    I is its share I_r of the intermediate units and the output is partial (see the module
    docstring); `adds_down_bias` is true on one rank only."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        moe = config.moe
        e, d, i_all = moe.num_experts, config.hidden_size, moe.intermediate_size
        i0, i1 = shard_range(i_all, tp.rank, tp.world_size, "moe intermediate_size")
        i = i1 - i0
        self.num_experts = e
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit
        self.adds_down_bias = tp.is_first
        self.gate_up_proj = nn.Parameter(torch.empty(e, d, 2 * i, dtype=dtype))  # [E, D, 2I_r]
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype))  # [E, 2I_r]
        self.down_proj = nn.Parameter(torch.empty(e, i, d, dtype=dtype))  # [E, I_r, D]
        self.down_proj_bias = nn.Parameter(torch.empty(e, d, dtype=dtype))  # [E, D]
        gate_up_columns = ((2 * i0, 2 * i1),)
        self.param_shards = {
            "gate_up_proj": ParamShard((e, d, 2 * i_all), 2, gate_up_columns, 2 * i),
            "gate_up_proj_bias": ParamShard((e, 2 * i_all), 1, gate_up_columns, 2 * i),
            "down_proj": ParamShard((e, i_all, d), 1, ((i0, i1),), i),
        }
        self.expert_elements = 3 * d * i  # gate/up and down weights of one expert
        self.expert_weight_names = ("gate_up_proj", "down_proj")

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Clamped SwiGLU of interleaved gate / up outputs (even / odd)."""
        return self.clamped_swiglu(gate_up[..., ::2], gate_up[..., 1::2])

    def clamped_swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """(up + 1) · gate · σ(α · gate), gate clamped above and up on both sides at `limit`."""
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def stacked_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each expert's gate outputs, then its up outputs (de-interleaved: the activation then
        reads two contiguous halves, not every other element)."""
        _, d, two_i = self.gate_up_proj.shape
        order = torch.cat([torch.arange(0, two_i, 2), torch.arange(1, two_i, 2)])  # [2I]
        order = order.to(self.gate_up_proj.device)
        gate_up = self.gate_up_proj[:, :, order].transpose(1, 2).reshape(-1, d)  # [E·2I, D]
        bias = self.gate_up_proj_bias[:, order].reshape(-1)  # [E·2I]
        return gate_up, bias, self.down_proj.reshape(-1, d).t()  # ..., [D, E·I]

    def stacked_activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.clamped_swiglu(gate, up)

    def routed_down_bias(self) -> torch.Tensor | None:
        return self.down_proj_bias if self.adds_down_bias else None

    def expert_outputs(
        self,
        xs: torch.Tensor,  # [n, C, D]
        experts: torch.Tensor | None,  # [n] int64, or None: every expert in order
    ) -> torch.Tensor:  # [n, C, D]
        gate_up_bias = (
            self.gate_up_proj_bias if experts is None else self.gate_up_proj_bias[experts]
        )
        gate_up = torch.bmm(xs, self.expert_weight("gate_up_proj", experts))  # [n, C, 2I]
        gate_up = gate_up + gate_up_bias.unsqueeze(1)
        y = torch.bmm(self.activation(gate_up), self.expert_weight("down_proj", experts))
        if self.adds_down_bias:
            down_bias = self.down_proj_bias if experts is None else self.down_proj_bias[experts]
            y = y + down_bias.unsqueeze(1)  # [n, C, D]
        return y


class GptOssMLP(nn.Module):
    """Replicated router, sharded experts, their partial outputs summed over the TP group."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.router = GptOssTopKRouter(config, dtype=dtype)
        self.experts = GptOssExperts(config, dtype=dtype, tp=self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.router(x)
        return self.tp.all_reduce(self.experts(x, index, weights))


class GptOssForCausalLM(HybridCausalLM):
    norm_weight_after_cast: ClassVar[bool] = False

    def make_mlp(self, layer_id: int) -> nn.Module:
        return GptOssMLP(self.config, dtype=self.dtype, tp=self.tp)

    def make_norm(self, hidden_size: int) -> RMSNorm:
        # HF keeps GPT-OSS norms in float32 (`_keep_in_fp32_modules`) whatever the model dtype.
        return RMSNorm(
            hidden_size, self.config.rms_norm_eps, weight_after_cast=False, dtype=torch.float32
        )
