"""Multi-token prediction (MTP) layers: MiMo-V2-Flash's `model.mtp.layers.{j}`, run as the
draft model of speculative decoding (`speculative_method="mtp"`, issue #44).

Depth j predicts, from the target's final (normed) hidden state h_p at position p and the
token t_{p+1} that followed it, the token after that:

    x   = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])           [T, 2D] → [T, D]
    x   = x + self_attn(input_layernorm(x))                       one SWA attention block at p
    x   = x + mlp(pre_mlp_layernorm(x))                           (window, sinks, SWA RoPE; dense MLP)
    out = final_layernorm(x)  → the shared lm_head                logits of t_{p+2}

(the layout and the "token shifted by one, position of the hidden state" convention of the
published checkpoint's reference runners). Each depth is an SWA layer of its own (global id
`num_layers + j`): its KV lives in the SWA pool beside the stack's and is freed, cached and
repaired with it. Embedding and LM head are the target's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from swaserve.worker.models.checkpoint import Checkpoint
from swaserve.worker.models.layers import DenseMLP

if TYPE_CHECKING:
    from swaserve.worker.attention.base import ForwardBatch
    from swaserve.worker.models.causal_lm import HybridCausalLM

MTP_LAYER = re.compile(r"^model\.mtp\.layers\.(\d+)\.")


def checkpoint_mtp_layers(model_dir: str | Path) -> int:
    """How many MTP depths the checkpoint in `model_dir` carries (`model.mtp.layers.{j}.*`,
    j = 0, 1, ... without gaps); 0 when none."""
    depths = {
        int(m.group(1)) for name in Checkpoint(model_dir).tensors if (m := MTP_LAYER.match(name))
    }
    n = 0
    while n in depths:
        n += 1
    return n


class MTPLayer(nn.Module):
    """One depth (see the module docstring), built on the target model's layer factories so
    that its attention, norms and TP sharding are the stack's own."""

    def __init__(self, model: HybridCausalLM, depth: int) -> None:
        super().__init__()
        config = model.config
        d = config.hidden_size
        self.enorm = model.make_norm(d)
        self.hnorm = model.make_norm(d)
        self.eh_proj = nn.Linear(2 * d, d, bias=False, dtype=model.dtype)  # replicated
        self.self_attn = model.make_attention(config.num_layers + depth)
        self.mlp = DenseMLP(d, config.intermediate_size, dtype=model.dtype, tp=model.tp)
        self.input_layernorm = model.make_norm(d)
        self.pre_mlp_layernorm = model.make_norm(d)
        self.final_layernorm = model.make_norm(d)

    def forward(
        self,
        embeds: torch.Tensor,  # [T, D] the next tokens' embeddings
        hidden: torch.Tensor,  # [T, D] the target's normed hidden states
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, D] normed: the LM head's input
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, batch)
        x = x + self.mlp(self.pre_mlp_layernorm(x))
        return self.final_layernorm(x)


class MTPStack(nn.Module):
    """`model.mtp`: the depths the engine runs (the checkpoint's first `num_mtp_layers`)."""

    def __init__(self, model: HybridCausalLM) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [MTPLayer(model, j) for j in range(model.config.num_mtp_layers)]
        )
