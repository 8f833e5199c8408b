"""Layers shared by the hybrid-SWA models: RMSNorm, attention through an `AttentionBackend`,
the dense SwiGLU MLP, the decoder layer, and the expert grouping that both MoE blocks use
(`gathers_expert_weights` picks the small- or large-batch path, `sort_by_expert` groups pairs).

Parameter names are transformers' (q_proj, k_proj, v_proj, o_proj, sinks, gate_proj, ...), so
that HF checkpoints load by name. Activations are token-major: [T, ...] over the whole batch.

Tensor parallelism (`tp`, see `tp_layers.py`): attention holds its rank's query heads and KV
heads (replicated when tp exceeds them), sinks with their heads, q/k/v column-parallel and o_proj
row-parallel; the dense MLP is column-parallel gate/up and row-parallel down. None: TP = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.worker.attention.base import AttentionBackend, ForwardBatch
from swaserve.worker.attention.static_decode import DecodeBatch
from swaserve.worker.models import prepacked
from swaserve.worker.models.config import ModelConfig
from swaserve.worker.models.param_shard import ParamShard
from swaserve.worker.models.prepacked import Prepackable, available, pack, prepacked_linear
from swaserve.worker.models.rotary import apply_rotary, apply_rotary_interleaved
from swaserve.worker.models.static_step import in_static_step
from swaserve.worker.models.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    even_segments,
)
from swaserve.worker.runner.host_tensors import to_device
from swaserve.worker.runner.parallel import TPGroup, kv_head_range

if TYPE_CHECKING:
    from swaserve.worker.models.quantized_weights import QuantizedWeight


class RMSNorm(nn.Module):
    """RMSNorm in float32 over the last dimension. `weight_after_cast=False` (GPT-OSS)
    multiplies by the weight before casting back to the input dtype; `True` (MiMo-V2-Flash)
    casts first, as each HF class does. `unit_offset` (Gemma) scales by 1 + weight, in float32."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        *,
        weight_after_cast: bool,
        dtype: torch.dtype,
        unit_offset: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))  # [D]
        self.eps = eps
        self.weight_after_cast = weight_after_cast
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)  # [..., D] float32
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        if self.weight_after_cast:
            return self.weight * h.to(x.dtype)
        return (self.weight * h).to(x.dtype)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection (all heads at once: OLMo's q_norm / k_norm), in
    float32, weight before the cast. Under TP a rank holds `segment` of the `full_size`
    channels: the sum of squares is all-reduced over the group, divided by `replication` (the
    ranks that hold each KV head, when tp exceeds the KV heads)."""

    def __init__(
        self,
        full_size: int,
        segment: tuple[int, int],
        eps: float,
        *,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
        replication: int = 1,
    ) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        local = segment[1] - segment[0]
        self.weight = nn.Parameter(torch.empty(local, dtype=dtype))  # [local]
        self.param_shards = {"weight": ParamShard((full_size,), 0, (segment,), local)}
        self.full_size, self.eps, self.replication = full_size, eps, replication

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)  # [T, local] float32
        squares = h.pow(2).sum(-1, keepdim=True)  # [T, 1]
        if self.tp.world_size > 1:
            squares = self.tp.all_reduce(squares) / self.replication
        h = h * torch.rsqrt(squares / self.full_size + self.eps)
        return (self.weight * h).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm without bias in float32 (Cohere): (x - mean) / std · weight, cast back."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))  # [D]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)  # [..., D] float32
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * h).to(x.dtype)


class Attention(nn.Module):
    """q/k/v projections, RoPE at the batch's positions, then the backend (which writes K/V into
    the pool and attends, windowed on SWA layers, with sinks when the layer kind has them).
    `q_norm` / `k_norm` (a model may set them: Gemma 3) normalize each head before RoPE."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        kind = config.attention_kind(layer_id)
        self.layer = config.attention_layer(layer_id, tp.world_size)
        self.backend = backend
        d, h_all, hkv_all = config.hidden_size, config.num_heads, kind.num_kv_heads
        dk, dv = kind.head_dim, kind.v_head_dim
        self.num_heads, self.num_kv_heads = self.layer.num_heads, self.layer.num_kv_heads
        self.head_dim, self.v_head_dim = dk, dv
        heads = (tp.rank * self.num_heads, (tp.rank + 1) * self.num_heads)
        kv_heads = kv_head_range(hkv_all, tp.rank, tp.world_size)
        bias = config.attention_bias
        self.q_proj = ColumnParallelLinear(
            d, h_all * dk, _scaled(heads, dk), bias=bias, dtype=dtype
        )
        self.k_proj = ColumnParallelLinear(
            d, hkv_all * dk, _scaled(kv_heads, dk), bias=bias, dtype=dtype
        )
        self.v_proj = ColumnParallelLinear(
            d, hkv_all * dv, _scaled(kv_heads, dv), bias=bias, dtype=dtype
        )
        self.o_proj = RowParallelLinear(
            h_all * dv, d, _scaled(heads, dv), bias=config.o_proj_bias, dtype=dtype, tp=tp
        )
        self.sinks: nn.Parameter | None
        self.param_shards: dict[str, ParamShard] = {}
        if kind.has_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype))  # [H_r]
            self.param_shards["sinks"] = ParamShard((h_all,), 0, (heads,), self.num_heads)
        else:
            self.register_parameter("sinks", None)
        self.value_scale = config.attention_value_scale
        self.interleaved_rope = kind.rope is not None and kind.rope.interleaved
        self.q_norm: nn.Module | None = None  # per head, over Dk
        self.k_norm: nn.Module | None = None
        self.norms_whole_projection = False  # q_norm / k_norm take [T, H·Dk] (OLMo)
        self.qkv_proj: FusedLinear | None = None  # set by fuse_projections
        # Llama 4: RoPE layers RMS-normalize q and k per head after RoPE, without weight; NoPE
        # layers scale q by a function of its position (temperature tuning).
        self.l2_norm_eps = (
            config.rms_norm_eps if config.qk_l2_norm_after_rope and kind.rope is not None else None
        )
        self.temperature = config.attention_temperature if kind.rope is None else None

    def fuse_projections(self) -> None:
        """After the load: the layer's q/k/v projections (those it has: Gemma 4 drops v where
        K = V, and k and v on a KV-shared layer) in one weight (`qkv_proj`, one matmul), unless
        one of them is held quantized (`Fp8Linear`); `qkv_proj` returns them in that order."""
        names = tuple(n for n in ("q_proj", "k_proj", "v_proj") if hasattr(self, n))
        parts = [getattr(self, n) for n in names]
        if len(parts) > 1 and all(type(p) is ColumnParallelLinear for p in parts):
            self.qkv_proj = FusedLinear(parts, names)
            for name in names:
                delattr(self, name)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, D]
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,  # 2 × [T, R/2]; None: NoPE
        batch: ForwardBatch | DecodeBatch,
    ) -> torch.Tensor:  # [T, D]
        t = hidden.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(hidden)
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        if self.norms_whole_projection and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, Dk]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dk]
        v = v.view(t, self.num_kv_heads, self.v_head_dim)  # [T, Hkv, Dv]
        if self.value_scale is not None:
            v = v * self.value_scale
        if not self.norms_whole_projection and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos_sin is not None:
            rotate = apply_rotary_interleaved if self.interleaved_rope else apply_rotary
            q, k = rotate(q, *cos_sin), rotate(k, *cos_sin)
        if self.l2_norm_eps is not None:
            q, k = l2_norm(q, self.l2_norm_eps), l2_norm(k, self.l2_norm_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            pos = batch.positions.float()  # [T] float32
            scale = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q.float() * scale[:, None, None]).to(q.dtype)
        sinks = None if self.sinks is None else self.sinks.float()  # [H] float32
        out = self.backend.forward(q, k, v, self.layer, batch, sinks=sinks)  # [T, H, Dv]
        return self.o_proj(out.reshape(t, self.num_heads * self.v_head_dim))


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dim without weight, in float32, cast back (Llama 4's qk norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def _scaled(heads: tuple[int, int], head_dim: int) -> tuple[tuple[int, int]]:
    """The rows (or columns) [start, end) of heads [h0, h1) in a projection of `head_dim`."""
    return ((heads[0] * head_dim, heads[1] * head_dim),)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
"""A gated MLP's activation by its HF `hidden_act` / `hidden_activation` name."""


def glu(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:  # [..., 2I] → [..., I]
    """A gated unit over fused gate/up outputs, gate the first half: act(gate) · up (SwiGLU by
    default; GeGLU with "gelu_pytorch_tanh")."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


class DenseMLP(nn.Module):
    """Gated MLP without biases: down(act(gate(x)) · up(x)); SwiGLU by default (MiMo-V2-Flash's
    "dense" layers), GeGLU with `activation="gelu_pytorch_tanh"` (Gemma)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        tp = tp or TPGroup.single()
        rows = even_segments(intermediate_size, tp, "intermediate_size")
        d, i = hidden_size, intermediate_size
        self.gate_proj = ColumnParallelLinear(d, i, rows, bias=False, dtype=dtype)
        self.up_proj = ColumnParallelLinear(d, i, rows, bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(i, d, rows, bias=False, dtype=dtype, tp=tp)

        self.gate_up_proj: FusedLinear | None = None  # set by fuse_projections

    def fuse_projections(self) -> None:
        """After the load: gate and up in one weight (`gate_up_proj`), unless held quantized."""
        parts = [self.gate_proj, self.up_proj]
        if all(type(p) is ColumnParallelLinear for p in parts):
            self.gate_up_proj = FusedLinear(parts, ("gate_proj", "up_proj"))
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class FusedLinear(Prepackable):
    """Column-parallel projections of one input in one weight (their rows stacked, biases too):
    one matmul instead of several; `forward` returns each projection's output, as views."""

    def __init__(self, parts: list[ColumnParallelLinear], names: tuple[str, ...]) -> None:
        super().__init__()
        self.sizes = [p.weight.shape[0] for p in parts]
        self.names = names  # the parts' module names (the checkpoint's)
        self.has_bias = [p.bias is not None for p in parts]
        with torch.no_grad():
            self.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
            biases = [p.bias for p in parts]
            self.bias: nn.Parameter | None = None
            if any(b is not None for b in biases):
                self.bias = nn.Parameter(
                    torch.cat(
                        [
                            b if b is not None else p.weight.new_zeros(p.weight.shape[0])
                            for p, b in zip(parts, biases, strict=True)
                        ]
                    ),
                    requires_grad=False,
                )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x, self.bias).split(self.sizes, dim=-1)

    def unfused(self) -> dict[str, torch.Tensor]:
        """The parts' parameters under their own names (`q_proj.weight`, ...), as views."""
        out: dict[str, torch.Tensor] = {}
        weights = self.weight.split(self.sizes)
        biases = None if self.bias is None else self.bias.split(self.sizes)
        for i, name in enumerate(self.names):
            out[f"{name}.weight"] = weights[i]
            if biases is not None and self.has_bias[i]:
                out[f"{name}.bias"] = biases[i]
        return out


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). `mlp_name`: the MLP's module
    name, as the checkpoint has it (Llama 4: `feed_forward`)."""

    def __init__(
        self,
        self_attn: Attention,
        mlp: nn.Module,
        input_layernorm: RMSNorm,
        post_attention_layernorm: RMSNorm,
        *,
        mlp_name: str = "mlp",
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(
        self,
        hidden: torch.Tensor,  # [T, D]
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        batch: ForwardBatch | DecodeBatch,
    ) -> torch.Tensor:  # [T, D]
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos_sin, batch)
        mlp = getattr(self, self.mlp_name)
        return hidden + mlp(self.post_attention_layernorm(hidden))


class SandwichDecoderLayer(nn.Module):
    """Norms around each block (Gemma 3): x + post_attn(attn(norm(x))), then
    x + post_ff(mlp(pre_ff(x)))."""

    def __init__(
        self,
        self_attn: Attention,
        mlp: nn.Module,
        input_layernorm: nn.Module,
        post_attention_layernorm: nn.Module,
        pre_feedforward_layernorm: nn.Module,
        post_feedforward_layernorm: nn.Module,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.pre_feedforward_layernorm = pre_feedforward_layernorm
        self.post_feedforward_layernorm = post_feedforward_layernorm

    def forward(
        self,
        hidden: torch.Tensor,  # [T, D]
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        batch: ForwardBatch | DecodeBatch,
    ) -> torch.Tensor:  # [T, D]
        attn = self.self_attn(self.input_layernorm(hidden), cos_sin, batch)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class ParallelDecoderLayer(nn.Module):
    """Attention and MLP side by side on one norm (Cohere): x + attn(norm(x)) + mlp(norm(x))."""

    def __init__(self, self_attn: Attention, mlp: nn.Module, input_layernorm: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm

    def forward(
        self,
        hidden: torch.Tensor,  # [T, D]
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        batch: ForwardBatch | DecodeBatch,
    ) -> torch.Tensor:  # [T, D]
        normed = self.input_layernorm(hidden)
        return hidden + self.self_attn(normed, cos_sin, batch) + self.mlp(normed)


# Temporary weight elements the gathered MoE path may copy (T·k pairs × one expert's gate/up and
# down weights): 2**27 elements is 256 MiB in bfloat16, enough for a GPT-OSS-120b decode step of
# one token (4 × 3 × 2880²).
GATHER_BUDGET_ELEMENTS = 1 << 27


def gathers_expert_weights(
    num_pairs: int, num_experts: int, expert_elements: int, device: torch.device | None = None
) -> bool:
    """True when `num_pairs` (token, expert) pairs are few enough to copy each pair's expert
    weights and run one batched matmul per projection: no host sync, no sort. That takes no more
    pairs than experts (the grouped path reads each expert's weights once, so beyond that it
    moves less memory) and at most `GATHER_BUDGET_ELEMENTS` copied weight elements.

    On CPU a host read costs nothing and copying weights is the larger cost (2.2× slower than
    the grouped path at T = 1 with 4 experts 512 wide), so there the gather is taken only when
    the grouped path would compute more than twice the experts the pairs need (`2 · pairs <
    experts`, e.g. one decode token over 128 experts)."""
    if num_pairs * expert_elements > GATHER_BUDGET_ELEMENTS:
        return False
    if device is not None and device.type == "cpu":
        return 2 * num_pairs < num_experts
    return num_pairs <= num_experts


class BatchedExperts(nn.Module):
    """MoE experts that choose their path per batch: `forward_gathered` (few pairs, no host
    sync) or `forward_grouped` (many pairs, one host read); see `gathers_expert_weights`.
    Subclasses set `num_experts`, `expert_elements` and `expert_weight_names` and give the
    experts' arithmetic, `expert_outputs`, reading their weights through `expert_weight` only.

    Weights that stay quantized in memory (see `quantized_weights.keep_quantized`) are listed
    in `quantized` (parameter name → its resident form); `expert_weight` dequantizes the experts
    a step selects, nothing else, and keeps nothing: the grouped path then runs only the
    selected experts, in chunks whose dequantized weights fit `GATHER_BUDGET_ELEMENTS`.

    For the compiled CPU decode step the experts' weights may be held a second time, prepacked
    (`prepack_weights`, `forward_prepacked`): subclasses give them as two linears over all
    experts (`stacked_expert_weights`) and their activation (`stacked_activation`)."""

    num_experts: int
    expert_elements: int
    expert_weight_names: tuple[str, ...] = ()
    prepacked = False
    stacked_out_features = (0, 0)  # (E·2I, D): the stacked linears' output sizes, once prepacked

    def __init__(self) -> None:
        super().__init__()
        self.quantized: dict[str, QuantizedWeight] = {}

    def expert_weight(self, name: str, experts: torch.Tensor | None = None) -> torch.Tensor:
        """Parameter `name` [E, ...] of `experts` ([n] int64; None: every expert) in the compute
        dtype, [n, ...]: the one seam between the experts' matmuls and how their weights are
        held (a fused quantized kernel replaces the matmul behind it)."""
        quantized = self.quantized.get(name)
        if quantized is not None:
            return quantized.dequantize(self, experts)
        weight = getattr(self, name)
        return weight if experts is None else weight[experts]

    def expert_outputs(
        self,
        xs: torch.Tensor,  # [n, C, D]
        experts: torch.Tensor | None,  # [n] int64: the expert of each row of xs; None: 0..E-1
    ) -> torch.Tensor:  # [n, C, D]
        """Each of `experts` applied to its C rows of `xs` (no routing weight)."""
        raise NotImplementedError

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2I] → [..., I]
        """The experts' gated activation of one expert's gate/up outputs."""
        raise NotImplementedError

    def stacked_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(gate_up [E·2I, D], its bias [E·2I] or None, down [D, E·I]): every expert's weights
        as two linear weights. Outputs [e·2I, (e + 1)·2I) of gate_up are expert e's gate/up
        outputs as `stacked_activation` reads them; input e·I + i of down is its intermediate
        unit i. Copies or views of the parameters."""
        raise NotImplementedError

    def stacked_activation(self, gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2I] → [..., I]
        """`activation` of gate/up outputs in `stacked_expert_weights`' order (the same order
        unless a subclass reorders them there)."""
        return self.activation(gate_up)

    def routed_down_bias(self) -> torch.Tensor | None:  # [E, D], added weighted by routing
        return None

    def prepack_weights(self) -> int:
        """Hold the stacked weights prepacked (`prepacked.pack`, for `forward_prepacked`), and
        the stacked gate/up bias as the buffer `stacked_gate_up_bias`, unless held quantized or
        the weights are not `prepacked.available`; the bytes that adds."""
        if self.quantized:
            return 0
        sources = [getattr(self, name) for name in self.expert_weight_names]
        if not all(available(w) for w in sources):
            return 0
        with torch.no_grad():
            gate_up, bias, down = self.stacked_expert_weights()
            added = pack(sources[0], gate_up) + pack(sources[1], down)
            if bias is not None:
                bias = bias.contiguous()
                added += bias.nbytes
        self.register_buffer("stacked_gate_up_bias", bias, persistent=False)
        self.stacked_out_features = (gate_up.shape[0], down.shape[0])
        self.prepacked = True
        return added

    def forward(
        self,
        x: torch.Tensor,  # [T, D]
        top_k_index: torch.Tensor,  # [T, k] int64
        top_k_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, D]
        """Σ over each token's k experts of weight · expert(x)."""
        if in_static_step():
            return self.forward_static(x, top_k_index, top_k_weights)
        if gathers_expert_weights(
            top_k_index.numel(), self.num_experts, self.expert_elements, x.device
        ):
            return self.forward_gathered(x, top_k_index, top_k_weights)
        return self.forward_grouped(x, top_k_index, top_k_weights)

    def forward_gathered(
        self,
        x: torch.Tensor,  # [T, D]
        top_k_index: torch.Tensor,  # [T, k] int64
        top_k_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, D]
        """Each (token, expert) pair with its own copy of the expert's weights: one bmm each."""
        t, k = top_k_index.shape
        flat = top_k_index.reshape(-1)  # [N] int64, N = T·k
        xs = x.repeat_interleave(k, dim=0).unsqueeze(1)  # [N, 1, D]
        y = self.expert_outputs(xs, flat).view(t, k, -1)  # [T, k, D]
        return (y * top_k_weights.unsqueeze(-1)).to(x.dtype).sum(dim=1)

    def forward_static(
        self,
        x: torch.Tensor,  # [T, D]
        top_k_index: torch.Tensor,  # [T, k] int64
        top_k_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, D]
        """A fixed-shape step's path: no host read, so that it compiles into one graph and a
        CUDA graph can capture it. Over the prepacked copies with our C++ kernels (the
        compiled CPU step), each token through its own experts (`forward_prepacked_sparse`):
        a row's result is then the same in every batch bucket, and on the decode bench
        (GPT-OSS, 4 experts top-2) the step takes 3.97 against 4.75 ms at batch 32 (every
        expert), the same at batch 8 (2.56 against 2.57 ms), and at batch 1, with the linears
        over their copies too, 0.96 against 1.77 ms (gathered experts, inductor's loops). Else
        the pairs' own weights when there are no more pairs than experts (CPU: one token) and
        their copies fit the budget (`forward_gathered`; compiled on CPU, the gather fuses into
        the matmul loop and copies nothing); else every expert over all T tokens in one bmm,
        each token's
        output weighted by its routing weight for that expert (0 where it did not choose it):
        E/k times the arithmetic of the chosen pairs, but each expert's weights are read once,
        as the grouped path reads them. Weights held quantized dequantize every expert then,
        in `GATHER_BUDGET_ELEMENTS` chunks."""
        if self.prepacked and prepacked.experts_run_sparse(
            self.stacked_out_features[0] // self.num_experts
        ):
            return self.forward_prepacked_sparse(x, top_k_index, top_k_weights)
        t, k = top_k_index.shape
        pairs = t * k
        # On CPU only one token's pairs gather: a compiled step then has two graphs in all (one
        # token, and every larger batch with the batch symbolic).
        few = t == 1 if x.device.type == "cpu" else pairs <= self.num_experts
        if few and pairs * self.expert_elements <= GATHER_BUDGET_ELEMENTS:
            return self.forward_gathered(x, top_k_index, top_k_weights)
        dense = torch.zeros(
            t, self.num_experts, dtype=top_k_weights.dtype, device=x.device
        ).scatter_(1, top_k_index, top_k_weights)  # [T, E] routing weight of every pair
        if self.prepacked:
            return self.forward_prepacked(x, dense)
        xs = x.unsqueeze(0).expand(self.num_experts, t, x.shape[1])  # [E, T, D]
        if self.quantized:
            per_chunk = max(1, GATHER_BUDGET_ELEMENTS // self.expert_elements)
            experts = torch.arange(self.num_experts, device=x.device)
            y = torch.cat(
                [
                    self.expert_outputs(xs[e : e + per_chunk], experts[e : e + per_chunk])
                    for e in range(0, self.num_experts, per_chunk)
                ]
            )  # [E, T, D]
        else:
            y = self.expert_outputs(xs, None)  # [E, T, D]
        return torch.einsum("etd,te->td", y, dense.to(y.dtype)).to(x.dtype)

    def stacked_sources(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The parameters the stacked gate/up and down copies are held for (`prepack_weights`)."""
        gate_up, down = (getattr(self, name) for name in self.expert_weight_names)
        return gate_up, down

    def forward_prepacked_sparse(
        self,
        x: torch.Tensor,  # [T, D]
        top_k_index: torch.Tensor,  # [T, k] int64
        top_k_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, D]
        """Each token through its k experts only, over the prepacked stacked weights (our C++
        kernels, `prepacked.expert_linear`): the pairs' gate/up rows [T, k, 2I], the
        activation, then each pair's down part weighted by its routing weight and summed.
        Half the arithmetic of `forward_prepacked` at top-2 of 4 experts, the same weights."""
        gate_up_source, down_source = self.stacked_sources()
        gate_up_features, out_features = self.stacked_out_features
        per_expert = gate_up_features // self.num_experts
        gate_up = prepacked.expert_linear(
            x, gate_up_source, self.stacked_gate_up_bias, gate_up_features, top_k_index, per_expert
        )  # [T, k, 2I]
        h = self.stacked_activation(gate_up)  # [T, k, I]
        y = prepacked.expert_linear_in(
            h, down_source, out_features, top_k_index, top_k_weights, h.shape[-1]
        )  # [T, D]
        bias = self.routed_down_bias()
        if bias is not None:
            y = y + (top_k_weights.to(bias.dtype)[..., None] * bias[top_k_index]).sum(1)
        return y.to(x.dtype)

    def forward_prepacked(
        self,
        x: torch.Tensor,  # [T, D]
        dense: torch.Tensor,  # [T, E] routing weight of every (token, expert); 0 if not chosen
    ) -> torch.Tensor:  # [T, D]
        """Every expert over every token as two GEMMs over the prepacked stacked weights:
        [T, D] × [D, E·2I], the activation, each expert's part scaled by its routing weight,
        then [T, E·I] × [E·I, D], which also sums over the experts."""
        t = x.shape[0]
        gate_up_source, down_source = self.stacked_sources()
        gate_up_features, out_features = self.stacked_out_features
        gate_up = prepacked_linear(
            x, gate_up_source, self.stacked_gate_up_bias, gate_up_features
        )  # [T, E·2I]
        h = self.stacked_activation(gate_up.view(t, self.num_experts, -1))  # [T, E, I]
        h = (h * dense.to(h.dtype)[..., None]).reshape(t, -1)  # [T, E·I]
        y = prepacked_linear(h, down_source, None, out_features)  # [T, D]
        bias = self.routed_down_bias()
        if bias is not None:
            y = y + dense.to(bias.dtype) @ bias
        return y.to(x.dtype)

    def forward_grouped(
        self,
        x: torch.Tensor,  # [T, D]
        top_k_index: torch.Tensor,  # [T, k] int64
        top_k_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, D]
        """Tokens sorted by expert and padded to the largest group: one bmm over [G, C, D]."""
        quantized = bool(self.quantized)
        groups = sort_by_expert(top_k_index, self.num_experts, only_selected=quantized)
        y = self._grouped_outputs(x, groups)  # [G, C, D]
        y = y[groups.group, groups.position]  # [N, D], real pairs only, sorted by expert
        weights = top_k_weights.reshape(-1)[groups.pair].unsqueeze(1)  # [N, 1]
        return torch.zeros_like(x).index_add_(0, groups.token, (y * weights).to(x.dtype))

    def _grouped_outputs(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """`expert_outputs` of every group ([G, C, D]): at once for weights read in place; for
        quantized weights, a chunk of groups at a time whose dequantized weights stay within
        `GATHER_BUDGET_ELEMENTS` (GPT-OSS-120b in bf16: 5 experts, 250 MiB, per chunk)."""
        num_groups = groups.token_rows.shape[0]
        per_chunk = max(1, GATHER_BUDGET_ELEMENTS // self.expert_elements)
        if groups.experts is None or per_chunk >= num_groups:
            return self.expert_outputs(x[groups.token_rows], groups.experts)
        chunks = [
            self.expert_outputs(
                x[groups.token_rows[g : g + per_chunk]], groups.experts[g : g + per_chunk]
            )
            for g in range(0, num_groups, per_chunk)
        ]
        return torch.cat(chunks)


@dataclass(slots=True)
class ExpertGroups:
    """The T·k (token, expert) pairs sorted by expert (tokens ascending within an expert), and a
    padded [G, C] table of the token each group reads, C being the largest group. A group is an
    expert: every expert in order (`experts` None), or only those a token selected (`experts`
    lists them, ascending). Padding reads token 0; its outputs are never picked up, since
    `group` / `position` name only real pairs."""

    token_rows: torch.Tensor  # [G, C] int64, token read by each (group, position); 0 on padding
    expert: torch.Tensor  # [N] int64, expert of each sorted pair
    position: torch.Tensor  # [N] int64, the pair's position within its expert's group
    token: torch.Tensor  # [N] int64, token row of each sorted pair
    pair: torch.Tensor  # [N] int64, index of each sorted pair in top_k_index.reshape(-1)
    group: torch.Tensor  # [N] int64, row of token_rows of each sorted pair (= expert when all)
    experts: torch.Tensor | None = None  # [G] int64, expert of each group; None: G = E, in order


def sort_by_expert(
    top_k_index: torch.Tensor,  # [T, k] int64 expert ids
    num_experts: int,
    *,
    only_selected: bool = False,
) -> ExpertGroups:
    """Groups the pairs by expert for batched matmuls over [G, C, D], without a loop over
    experts; `only_selected`: one group per expert some token chose, not one per expert.

    Reads the expert counts back to the host once (the buffers' shape depends on the largest,
    and the selected experts on which are not zero): a host sync, which is why the MoE blocks
    take this path only for large token counts and gather weights per pair
    (`gathers_expert_weights`) for small ones."""
    k = top_k_index.shape[1]
    device = top_k_index.device
    flat = top_k_index.reshape(-1)  # [N] int64, N = T·k
    num_pairs = flat.numel()
    pair = torch.argsort(flat, stable=True)  # [N] int64, grouped by expert
    expert = flat[pair]  # [N] int64, ascending
    counts = torch.bincount(flat, minlength=num_experts)  # [E] int64
    starts = torch.cumsum(counts, dim=0) - counts  # [E] int64, first sorted pair of each expert
    position = torch.arange(num_pairs, device=device) - starts[expert]  # [N] int64
    host_counts = counts.cpu()  # [E] int64: the one host read
    capacity = int(host_counts.max())
    token = pair // k  # [N] int64
    experts: torch.Tensor | None = None
    group = expert
    if only_selected:
        selected = torch.nonzero(host_counts).squeeze(1)  # [G] int64 (host)
        experts = to_device(selected, device)  # [G] int64
        group_of = torch.cumsum(counts > 0, dim=0) - 1  # [E] int64, group of each chosen expert
        group = group_of[expert]  # [N] int64
    num_groups = num_experts if experts is None else experts.numel()
    token_rows = torch.zeros(num_groups, capacity, dtype=torch.int64, device=device)  # [G, C]
    token_rows[group, position] = token
    return ExpertGroups(token_rows, expert, position, token, pair, group, experts)
