"""`HybridCausalLM`: the decoder stack both architectures share — embeddings, decoder layers of
two attention kinds, final norm, LM head — and the `forward(batch)` the model runner calls.

Subclasses say how to build one layer's MLP and norms. Build on the meta device, then
`materialize(device)` and load weights (see `loader.py`); `materialize` re-ties a tied LM head.

Under tensor parallelism (`tp`) every rank builds the same stack over its shard: vocab-parallel
embedding and LM head (see `tp_layers.py`), sharded attention and MLPs; `forward` returns the full
logits on every rank.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from swaserve.worker.attention.base import AttentionBackend, AttentionLayer, ForwardBatch
from swaserve.worker.attention.static_decode import DecodeBatch
from swaserve.worker.models.config import SLIDING_ATTENTION, ModelConfig
from swaserve.worker.models.layers import (
    Attention,
    DecoderLayer,
    DenseMLP,
    FusedLinear,
    RMSNorm,
    SandwichDecoderLayer,
)
from swaserve.worker.models.mtp import MTPLayer, MTPStack
from swaserve.worker.models.rotary import RotaryEmbedding
from swaserve.worker.models.tp_layers import ParallelLMHead, VocabParallelEmbedding
from swaserve.worker.runner.parallel import TPGroup


class UnboundBackend(AttentionBackend):
    """Stands in for the attention backend of a model that has no KV buffers yet (built only to
    read its shapes, or loaded before its KV pool is sized): running it raises."""

    name = "unbound"

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        raise RuntimeError("the model has no attention backend yet (see bind_backend)")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise RuntimeError("the model has no attention backend yet (see bind_backend)")


class DecoderModel(nn.Module):
    """HF's `model.` prefix: embed_tokens, layers, norm."""

    def __init__(
        self, embed_tokens: VocabParallelEmbedding, layers: list[nn.Module], norm: nn.Module
    ):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class HybridCausalLM(nn.Module):
    """A causal LM whose layers are full or sliding-window attention, reading and writing KV
    through `backend`. `forward(batch)` returns logits [N, vocab] for `batch.logits_indices()`."""

    # Regexes of checkpoint tensors the model does not use and the loader may skip.
    ignored_checkpoint_tensors: ClassVar[tuple[str, ...]] = ()
    # RMSNorm style of the HF class (see `RMSNorm`).
    norm_weight_after_cast: ClassVar[bool] = False
    # Embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype (Gemma).
    embed_scale: ClassVar[bool] = False

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        *,
        dtype: torch.dtype = torch.float32,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.dtype = dtype
        self.tp = tp = tp or TPGroup.single()
        d = config.hidden_size
        layers = [self.make_layer(i) for i in range(config.num_layers)]
        # sqrt(D) as the model dtype holds it, as HF's `embed_scale` buffer
        self._embed_multiplier = float(torch.tensor(d**0.5, dtype=dtype, device="cpu"))
        embed = VocabParallelEmbedding(config.vocab_size, d, dtype=dtype, tp=tp)
        self.model = DecoderModel(embed, layers, self.make_norm(d))
        self.lm_head = ParallelLMHead(d, config.vocab_size, dtype=dtype, tp=tp)
        self.tie_weights()
        # Speculative decoding with MTP drafts: the depths (`model.mtp`), and every forward
        # keeps its rows' normed hidden states (`last_hidden`), the drafts' input.
        self.keep_hidden = config.num_mtp_layers > 0
        self.last_hidden: torch.Tensor | None = None  # [T, D] of the latest forward
        self.mtp_layers: list[MTPLayer] = []  # the same modules, typed (not registered twice)
        if self.keep_hidden:
            self.model.mtp = MTPStack(self)
            self.mtp_layers = list(self.model.mtp.layers)  # type: ignore[arg-type, union-attr]
        # In the order the kinds first appear, not a set's: that order is the traced graph's,
        # and a set of strings iterates in a per-process order (hash randomisation), so the
        # compiled step's cache key would differ from one start to the next.
        # Kinds without position encoding (NoPE) have none.
        self.rotary = {
            kind: RotaryEmbedding(rope)
            for kind in dict.fromkeys(config.layer_types)
            if (rope := config.attention_kind(config.layer_types.index(kind)).rope) is not None
        }

    def make_layer(self, layer_id: int) -> nn.Module:
        """Decoder layer `layer_id`: a pre-norm block by default (`DecoderLayer`); its
        `forward(hidden, cos_sin, batch)` returns the new hidden states."""
        d = self.config.hidden_size
        return DecoderLayer(
            self.make_attention(layer_id),
            self.make_mlp(layer_id),
            self.make_norm(d),
            self.make_norm(d),
        )

    def make_attention(self, layer_id: int) -> Attention:
        return Attention(self.config, layer_id, self.backend, dtype=self.dtype, tp=self.tp)

    def make_mlp(self, layer_id: int) -> nn.Module:
        """Layer `layer_id`'s MLP on this rank's shard (`self.tp`); it returns the full sum."""
        raise NotImplementedError

    def make_norm(self, hidden_size: int) -> nn.Module:
        return RMSNorm(
            hidden_size,
            self.config.rms_norm_eps,
            weight_after_cast=self.norm_weight_after_cast,
            dtype=self.dtype,
        )

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def bind_backend(self, backend: AttentionBackend) -> None:
        """Read and write KV through `backend` from now on: a runner loads the weights first
        (with an `UnboundBackend`), then sizes and allocates the KV buffers from the memory
        the weights left, then binds the backend over them."""
        self.backend = backend
        for layer in self.model.layers:
            layer.self_attn.backend = backend
        for mtp_layer in self.mtp_layers:
            mtp_layer.self_attn.backend = backend

    def fuse_projections(self) -> None:
        """Once the weights are loaded: projections of one input into one weight each (q/k/v;
        a dense MLP's gate/up) — fewer kernels per layer. Checkpoint names stay the modules'
        until then, so loading is unchanged."""
        for module in list(self.modules()):
            if module is not self and hasattr(module, "fuse_projections"):
                module.fuse_projections()

    def prepack_weights(self) -> int:
        """For the compiled CPU decode step: each linear layer and MoE block holds its weights
        a second time, in panels for our GEMM kernel (`prepacked.py`, float32); the step
        then runs its GEMMs over those copies. Returns the bytes the copies add."""
        return sum(
            module.prepack_weights()
            for module in self.modules()
            if module is not self and hasattr(module, "prepack_weights")
        )

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """`state_dict()` under the checkpoint's names: fused projections split back into
        their parts (what an HF class of the model loads)."""
        state = self.state_dict()
        for name, module in self.named_modules():
            if isinstance(module, FusedLinear):
                prefix = name.rsplit(".", 1)[0]
                for key in [k for k in state if k.startswith(f"{name}.")]:
                    del state[key]
                state.update({f"{prefix}.{k}": v for k, v in module.unfused().items()})
        return state

    def materialize(self, device: str | torch.device) -> HybridCausalLM:
        """Give a meta-built model real (uninitialized) storage on `device`."""
        self.to_empty(device=device)
        self.tie_weights()  # to_empty gives each module its own copy of a shared parameter
        return self

    def run_layers(
        self,
        hidden: torch.Tensor,  # [T, D]: the input embeddings
        cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]],  # by layer kind (none: NoPE)
        batch: ForwardBatch | DecodeBatch,
    ) -> torch.Tensor:  # [T, D]
        """The decoder layers in order; a model with inputs of its own per layer (Gemma 4)
        overrides it."""
        for layer, kind in zip(self.model.layers, self.config.layer_types, strict=True):
            hidden = layer(hidden, cos_sin.get(kind), batch)
        return hidden

    @torch.no_grad()
    def forward(self, batch: ForwardBatch | DecodeBatch) -> torch.Tensor:  # [N, vocab]
        """Run all layers over the batch's new tokens. Calls the backend's
        `init_forward_metadata(batch)` first unless the runner already did. With MTP layers,
        keeps every row's normed hidden state in `last_hidden` (the drafts' input)."""
        logits, hidden = self.forward_hidden(batch)
        if hidden is not None:
            self.last_hidden = hidden
        return logits

    @torch.no_grad()
    def forward_hidden(
        self, batch: ForwardBatch | DecodeBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` without side effects (what a compiled or captured step traces): the
        logits [N, vocab] and, with MTP layers, every row's normed hidden state [T, D]."""
        if batch.attn_metadata is None:
            self.backend.init_forward_metadata(batch)
        hidden = self.model.embed_tokens(batch.input_ids)  # [T, D]
        if self.embed_scale:
            hidden = hidden * self._embed_multiplier
        cos_sin = {
            kind: rotary.cos_sin(batch.positions, hidden.dtype)
            for kind, rotary in self.rotary.items()
        }
        hidden = self.run_layers(hidden, cos_sin, batch)
        rows = batch.logits_indices()  # None: every row (a fixed-shape decode step)
        if not self.keep_hidden:
            return self.logits(self.model.norm(hidden if rows is None else hidden[rows])), None
        normed = self.model.norm(hidden)  # [T, D] every row's (the norm is per row)
        return self.logits(normed if rows is None else normed[rows]), normed

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] normed → [N, vocab]
        logits = self.lm_head(hidden)  # [N, vocab]
        if self.config.logit_scale is not None:
            logits = logits * self.config.logit_scale
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def draft(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,  # [T, D] the target's normed hidden state for each row
        depth: int,
        with_logits: bool,
    ) -> torch.Tensor | None:  # [N, vocab] for `batch.logits_indices()`, or None
        """MTP depth `depth` over the batch (`models.mtp`): its tokens are the tokens that
        followed each hidden state; it writes the depth's KV at the batch's slots."""
        if batch.attn_metadata is None:
            self.backend.init_forward_metadata(batch)
        out = self.draft_hidden(batch, hidden, depth)  # [T, D]
        if not with_logits:
            return None
        rows = batch.logits_indices()
        return self.logits(out if rows is None else out[rows])

    def draft_hidden(
        self,
        batch: ForwardBatch | DecodeBatch,  # its attention metadata built
        hidden: torch.Tensor,  # [T, D] the target's normed hidden state for each row
        depth: int,
    ) -> torch.Tensor:  # [T, D] normed: the LM head's input
        """MTP depth `depth` over every row of the batch, without the LM head (what a
        compiled draft step traces: `runner.draft_step`)."""
        embeds = self.model.embed_tokens(batch.input_ids)  # [T, D]
        if self.embed_scale:
            embeds = embeds * self._embed_multiplier
        rotary = self.rotary.get(SLIDING_ATTENTION)
        cos_sin = None if rotary is None else rotary.cos_sin(batch.positions, embeds.dtype)
        out: torch.Tensor = self.mtp_layers[depth](embeds, hidden, cos_sin, batch)
        return out


class DenseHybridCausalLM(HybridCausalLM):
    """A `HybridCausalLM` whose every layer has one dense gated MLP (`DenseMLP`, the config's
    activation): Gemma 3, Cohere2, OLMo 3, EXAONE 4."""

    # q and k normalized per head (over Dk, by `make_norm`) before RoPE: Gemma 3, EXAONE 4.
    qk_norm_per_head: ClassVar[bool] = False

    def make_attention(self, layer_id: int) -> Attention:
        attention = super().make_attention(layer_id)
        if self.qk_norm_per_head:
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

    def post_norm_layer(self, layer_id: int) -> SandwichDecoderLayer:
        """A post-norm block (OLMo, EXAONE): x + norm(attn(x)), then x + norm(mlp(x))."""
        d = self.config.hidden_size
        return SandwichDecoderLayer(
            self.make_attention(layer_id),
            self.make_mlp(layer_id),
            nn.Identity(),
            self.make_norm(d),
            nn.Identity(),
            self.make_norm(d),
        )
