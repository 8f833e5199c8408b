"""`ModelConfig`: what swaserve needs from an HF model dir's config.json, parsed once, checked,
and frozen. No transformers import: this reads the JSON the way transformers' `GptOssConfig` /
`MiMoV2FlashConfig` would and applies the same defaults, so that our model and HF's agree.

Layer kinds: every layer is `"full_attention"` or `"sliding_attention"` (local: SWA). The two
kinds may differ in KV heads, head dims, sinks and RoPE (`AttentionKindConfig`); the local span
rule is shared: a sliding window W, or chunked attention with chunk C (`attention_chunk_size`;
Llama 4's `"chunked_attention"` layers, stored with W = C - 1). `layer_cache_specs()` is the
per-layer declaration the KV memory is laid out from. The per-architecture readers of
config.json live in `config_parsers.py`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swaserve.worker.attention.base import AttentionLayer
from swaserve.worker.kv.kv_pool import KVLayout
from swaserve.worker.kv.memory import KVModelSpec
from swaserve.worker.models.errors import (
    MissingConfigFieldError,
    ModelConfigError,
    UnknownArchitectureError,
)
from swaserve.worker.models.quantization import QuantizationConfig
from swaserve.worker.runner.parallel import (
    ShardingError,
    num_heads_per_rank,
    num_kv_heads_per_rank,
    shard_range,
)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
GPT_OSS = "GptOssForCausalLM"
MIMO_V2_FLASH = "MiMoV2FlashForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
GEMMA4 = "Gemma4ForCausalLM"
LLAMA4 = "Llama4ForCausalLM"
COHERE2 = "Cohere2ForCausalLM"
OLMO3 = "Olmo3ForCausalLM"
EXAONE4 = "Exaone4ForCausalLM"
SUPPORTED_ARCHITECTURES = (GPT_OSS, MIMO_V2_FLASH, GEMMA3, GEMMA4, COHERE2, OLMO3, EXAONE4, LLAMA4)
_ARCHITECTURE_BY_MODEL_TYPE = {
    "gpt_oss": GPT_OSS,
    "mimo_v2_flash": MIMO_V2_FLASH,
    "gemma3_text": GEMMA3,
    "gemma4_text": GEMMA4,
    "cohere2": COHERE2,
    "olmo3": OLMO3,
    "exaone4": EXAONE4,
    "llama4_text": LLAMA4,
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """RoPE of one layer kind, as transformers' ROPE_INIT_FUNCTIONS read it (rotate-half style on
    the leading `rotary_dim` channels of each head; the rest pass through)."""

    rope_type: str  # "default", "linear" (positions divided by `factor`), "llama3", "yarn" or
    # "proportional" (Gemma 4: the first partial_rotary_factor of each half of the head rotates,
    # with frequencies over the whole head_dim; the rest of the pairs have frequency 0)
    theta: float
    head_dim: int
    partial_rotary_factor: float = 1.0
    # YaRN only
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # Pairs (2i, 2i + 1) rotate together, computed in float32 (Cohere); else rotate-half.
    interleaved: bool = False
    # cos / sin stay float32 and the rotation runs in float32, then casts back (OLMo 3).
    float32: bool = False

    @property
    def freq_dim(self) -> int:
        """The `dim` of HF's inverse-frequency formula: int(head_dim * partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rotary_dim(self) -> int:
        """Channels that rotate: two per inverse frequency (HF's cos/sin width)."""
        if self.rope_type == "proportional":
            return self.head_dim
        return 2 * math.ceil(self.freq_dim / 2)


@dataclass(frozen=True, slots=True)
class AttentionKindConfig:
    """Attention shape of one layer kind (full or SWA)."""

    num_kv_heads: int
    head_dim: int  # Dk (q and k)
    v_head_dim: int  # Dv
    has_sinks: bool
    rope: RopeConfig | None  # None: no position encoding (NoPE layers: Cohere2's global ones)
    k_eq_v: bool = False  # V is the K projection (no v_proj): Gemma 4's global layers


@dataclass(frozen=True, slots=True)
class LayerCacheSpec:
    """What one layer keeps in the KV cache: `rule` "full" (every token), "window" (the W tokens
    before each query, `span` = W), "chunked" (the query's chunk, `span` = C) or "shared"
    (nothing: it reads an earlier layer's KV), with the KV shape of one rank."""

    layer_id: int
    rule: str
    span: int | None
    layout: KVLayout


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Routed experts. GPT-OSS: softmax over the top-k router logits, clamped SwiGLU experts with
    biases. MiMo-V2-Flash: DeepSeek-V3 sigmoid router with grouped top-k, plain SwiGLU experts."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # per expert
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # Llama 4: an always-on shared expert (a dense SwiGLU of this width); 0: none.
    shared_expert_intermediate_size: int = 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model, parsed from config.json. Layer ids are global (0 .. num_layers - 1)."""

    architecture: str
    source: str  # the config.json it came from, for error messages
    vocab_size: int
    hidden_size: int
    num_heads: int
    layer_types: tuple[str, ...]  # per layer: FULL_ATTENTION or SLIDING_ATTENTION
    mlp_layer_types: tuple[str, ...]  # per layer: "dense" or "sparse"
    sliding_window_size: int | None  # W (architecture §2); None when no layer slides
    full_attention: AttentionKindConfig
    swa_attention: AttentionKindConfig
    attention_bias: bool  # q/k/v projections
    o_proj_bias: bool
    attention_value_scale: float | None  # MiMo multiplies V by it; None = no scaling
    rms_norm_eps: float
    hidden_act: str
    intermediate_size: int  # dense MLP (MiMo's "dense" layers)
    moe: MoEConfig
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # What the checkpoint stores (config.json's quantization_config); None: plain weights.
    quantization: QuantizationConfig | None = None
    # The softmax scale of every layer; None: Dk^-0.5 (Gemma 3: query_pre_attn_scalar^-0.5).
    attention_scale: float | None = None
    # Logits become tanh(logits / c) · c (Gemma's final_logit_softcapping); None: as they are.
    final_logit_softcapping: float | None = None
    # Logits are multiplied by it (Cohere's logit_scale); None: as they are.
    logit_scale: float | None = None
    # C of chunked local layers (Llama 4); then sliding_window_size = C - 1. None: a window.
    attention_chunk_size: int | None = None
    # NoPE layers scale q by log1p(floor((pos + 1) / floor_scale)) · attn_scale + 1 (Llama 4's
    # temperature tuning): (floor_scale, attn_scale); None: no scaling.
    attention_temperature: tuple[float, float] | None = None
    # q and k of RoPE layers are RMS-normalized per head, without weight, after RoPE (Llama 4).
    qk_l2_norm_after_rope: bool = False
    # Per layer, the layer whose KV it reads: itself, or an earlier layer of its kind whose KV
    # it shares (Gemma 4's KV-shared layers own no KV). Empty: every layer its own.
    kv_source_layers: tuple[int, ...] = ()
    # V is RMS-normalized per head without weight (Gemma 4).
    value_norm: bool = False
    # Gemma 4's per-layer inputs: an embedding of this width per layer (0: none), over a
    # vocabulary of `per_layer_input_vocab_size`.
    per_layer_input_size: int = 0
    per_layer_input_vocab_size: int = 0
    # KV-shared layers have an MLP twice as wide (Gemma 4's use_double_wide_mlp).
    double_wide_shared_mlp: bool = False
    # Multi-token-prediction layers the engine runs as a draft model (MiMo-V2-Flash's
    # `model.mtp.layers.{j}`, speculative_method="mtp"): SWA layers with ids num_layers + j,
    # their KV in the SWA pool beside the stack's. 0: none (the checkpoint's are skipped).
    num_mtp_layers: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def full_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def swa_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION]

    def kv_source(self, layer_id: int) -> int:
        """The layer whose KV `layer_id` reads (itself unless it shares another's)."""
        if layer_id >= len(self.kv_source_layers):  # none shares, or an MTP layer
            return layer_id
        return self.kv_source_layers[layer_id]

    def layer_cache_specs(self, tp_size: int = 1) -> tuple[LayerCacheSpec, ...]:
        """Per layer, its attention's cache rule and KV shape on one rank of a TP group of
        `tp_size`: layers with one rule share a pool (the full pool; the local pool); a
        "shared" layer keeps nothing (it reads `kv_source(layer)`'s KV)."""
        out = []
        for i in range(self.num_layers + self.num_mtp_layers):
            kind = self.attention_kind(i)
            rule = (
                "shared"
                if self.kv_source(i) != i
                else "full"
                if not self.is_swa_layer(i)
                else "chunked"
                if self.attention_chunk_size
                else "window"
            )
            span = (
                None
                if rule in ("full", "shared")
                else self.attention_chunk_size or self.sliding_window_size
            )
            heads = num_kv_heads_per_rank(kind.num_kv_heads, tp_size)
            out.append(
                LayerCacheSpec(i, rule, span, KVLayout(heads, kind.head_dim, kind.v_head_dim))
            )
        return tuple(out)

    def is_swa_layer(self, layer_id: int) -> bool:
        """Whether `layer_id` slides (ids from num_layers on are the MTP layers: SWA)."""
        if layer_id >= self.num_layers:
            return True
        return self.layer_types[layer_id] == SLIDING_ATTENTION

    def attention_kind(self, layer_id: int) -> AttentionKindConfig:
        return self.swa_attention if self.is_swa_layer(layer_id) else self.full_attention

    def attention_layer(self, layer_id: int, tp_size: int = 1) -> AttentionLayer:
        """What the attention backend needs to know about layer `layer_id` on one rank of a TP
        group of `tp_size`: that rank's query and KV heads (raises `ShardingError` when they do
        not split)."""
        kind = self.attention_kind(layer_id)
        return AttentionLayer(
            layer_id=layer_id,
            num_heads=num_heads_per_rank(self.num_heads, tp_size),
            num_kv_heads=num_kv_heads_per_rank(kind.num_kv_heads, tp_size),
            head_dim=kind.head_dim,
            v_head_dim=kind.v_head_dim,
            scaling=self.attention_scale or kind.head_dim**-0.5,
            sliding_window_size=self.sliding_window_size if self.is_swa_layer(layer_id) else None,
            attention_chunk_size=self.attention_chunk_size if self.is_swa_layer(layer_id) else None,
            kv_layer_id=None if self.kv_source(layer_id) == layer_id else self.kv_source(layer_id),
        )

    def check_tp_size(self, tp_size: int) -> None:
        """Raise `ShardingError` unless every sharded dimension splits over `tp_size`: query
        heads, each layer kind's KV heads, the dense and the expert intermediate sizes."""
        if tp_size < 1:
            raise ShardingError(f"tp_size must be >= 1, got {tp_size}")
        num_heads_per_rank(self.num_heads, tp_size)
        for kind in {self.attention_kind(i) for i in range(self.num_layers)}:
            num_kv_heads_per_rank(kind.num_kv_heads, tp_size)
        if "dense" in self.mlp_layer_types:
            shard_range(self.intermediate_size, 0, tp_size, "intermediate_size")
        if "sparse" in self.mlp_layer_types:
            shard_range(self.moe.intermediate_size, 0, tp_size, "moe intermediate_size")

    def kv_spec(self, tp_size: int = 1) -> KVModelSpec:
        """The layer kinds and the KV shapes of one rank of a TP group of `tp_size` (its KV
        heads: an even share, or one replicated head when tp exceeds them), from which that
        rank's KV pools are sized and laid out. Raises `ShardingError` when they do not split."""

        specs = self.layer_cache_specs(tp_size)
        local = [s for s in specs if s.rule in ("window", "chunked")]

        def layout(kind: AttentionKindConfig) -> KVLayout:
            heads = num_kv_heads_per_rank(kind.num_kv_heads, tp_size)
            return KVLayout(heads, kind.head_dim, kind.v_head_dim)

        return KVModelSpec(
            full_layer_ids=[s.layer_id for s in specs if s.rule == "full"],
            swa_layer_ids=[s.layer_id for s in local],
            full_layout=layout(self.full_attention),
            swa_layout=layout(self.swa_attention),
            sliding_window_size=self.sliding_window_size or 0,
            shared_layer_ids=tuple(s.layer_id for s in specs if s.rule == "shared"),
        )


def sliding_window_size_from_hf(hf_config: Mapping[str, Any], architecture: str) -> int | None:
    """W — how many tokens *before* the current one an SWA query sees — from an HF config dict.

    transformers masks an SWA layer with `kv_idx > q_idx - sliding_window` (masking_utils'
    `sliding_window_overlay`): the query sees `sliding_window` keys, itself included, so
    W = sliding_window - 1 (GPT-OSS: 128 → 127). MiMo-V2-Flash configs may give W directly as
    `sliding_window_size` (SGLang's convention); transformers then sets
    `sliding_window = sliding_window_size + 1`, so that field wins. None when neither is set.
    """
    if architecture == MIMO_V2_FLASH and hf_config.get("sliding_window_size") is not None:
        w = hf_config["sliding_window_size"]
        if not is_int(w) or w < 0:
            raise ModelConfigError(f"sliding_window_size must be an int >= 0, got {w!r}")
        return int(w)
    window = hf_config.get("sliding_window")
    if window is None:
        return None
    if not is_int(window) or window < 1:
        raise ModelConfigError(f"sliding_window must be an int >= 1, got {window!r}")
    return int(window) - 1


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and parse `model_dir/config.json` (raises ModelConfigError and subclasses)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"no config.json in {model_dir}")
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(hf, dict):
        raise ModelConfigError(f"{path} must hold a JSON object")
    return parse_model_config(hf, source=str(path))


MULTIMODAL_ARCHITECTURES = {
    "Llama4ForConditionalGeneration": LLAMA4,
    "Gemma3ForConditionalGeneration": GEMMA3,
    "Gemma4ForConditionalGeneration": GEMMA4,
}
"""Published multimodal checkpoints whose language model swaserve serves: its config is their
`text_config`, its weights sit under a prefix (`weight_maps.py`), the vision (and audio) towers
are skipped."""

_TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    # Gemma3TextConfig's defaults, which the published Gemma 3 configs leave out of text_config
    GEMMA3: dict(
        vocab_size=262_208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
    ),
}


def text_config_of(hf: Mapping[str, Any], source: str = "config.json") -> Mapping[str, Any]:
    """The language model's config: `hf` itself, or a multimodal checkpoint's `text_config`
    with the text architecture, the top-level quantization and the family's defaults."""
    multimodal = [a for a in hf.get("architectures") or () if a in MULTIMODAL_ARCHITECTURES]
    if not multimodal:
        return hf
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        raise MissingConfigFieldError("text_config", source, f"a {multimodal[0]} checkpoint")
    arch = MULTIMODAL_ARCHITECTURES[multimodal[0]]
    merged = dict(_TEXT_CONFIG_DEFAULTS.get(arch, {})) | dict(text)
    merged["architectures"] = [arch]
    for key in ("quantization_config", "tie_word_embeddings", "eos_token_id"):
        if key not in merged and key in hf:
            merged[key] = hf[key]
    return merged


def parse_model_config(hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Parse an HF config dict (the content of config.json; a multimodal checkpoint's
    language model, `text_config_of`)."""
    from swaserve.worker.models.config_parsers import PARSERS  # they build on this module

    hf = text_config_of(hf, source)
    return PARSERS[architecture_from_hf(hf, source)](hf, source).parse()


def architecture_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> str:
    """The supported architecture named by `architectures` (or, failing that, `model_type`)."""
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    archs = hf.get("architectures")
    if archs:
        for arch in archs:
            if arch in SUPPORTED_ARCHITECTURES:
                return str(arch)
        raise UnknownArchitectureError(
            f"unsupported architecture {archs} in {source}; supported: {supported}"
        )
    model_type = hf.get("model_type")
    if model_type is None:
        raise MissingConfigFieldError("architectures", source, f"supported: {supported}")
    if model_type not in _ARCHITECTURE_BY_MODEL_TYPE:
        raise UnknownArchitectureError(
            f"unsupported model_type {model_type!r} in {source}; supported: {supported}"
        )
    return _ARCHITECTURE_BY_MODEL_TYPE[model_type]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
