"""Per-architecture readers of an HF config.json: each applies the defaults of transformers'
config class (`GptOssConfig`, `MiMoV2FlashConfig`) and checks what our model code relies on,
raising typed errors that name the field and the file."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from swaserve.worker.models.config import (
    COHERE2,
    EXAONE4,
    FULL_ATTENTION,
    GEMMA3,
    GEMMA4,
    GPT_OSS,
    LLAMA4,
    MIMO_V2_FLASH,
    OLMO3,
    SLIDING_ATTENTION,
    AttentionKindConfig,
    ModelConfig,
    MoEConfig,
    RopeConfig,
    is_int,
    sliding_window_size_from_hf,
)
from swaserve.worker.models.errors import MissingConfigFieldError, ModelConfigError
from swaserve.worker.models.quantization import parse_quantization_config

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


class ConfigParser:
    """Shared field access with typed errors; one subclass per architecture."""

    architecture = ""

    def __init__(self, hf: Mapping[str, Any], source: str) -> None:
        self.hf = hf
        self.source = source

    def parse(self) -> ModelConfig:
        raise NotImplementedError

    def fail(self, message: str) -> ModelConfigError:
        return ModelConfigError(f"{self.source}: {message}")

    def required_int(self, name: str, reason: str = "", minimum: int = 1) -> int:
        if self.hf.get(name) is None:
            raise MissingConfigFieldError(name, self.source, reason)
        return self.int_field(name, self.hf[name], minimum)

    def optional_int(self, name: str, default: int, minimum: int = 1) -> int:
        value = self.hf.get(name)
        return default if value is None else self.int_field(name, value, minimum)

    def int_field(self, name: str, value: Any, minimum: int) -> int:
        if not is_int(value) or value < minimum:
            raise self.fail(f"field {name!r} must be an int >= {minimum}, got {value!r}")
        return int(value)

    def number(self, name: str, default: float) -> float:
        value = self.hf.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"field {name!r} must be a number, got {value!r}")
        return float(value)

    def layer_types(self, num_layers: int, default: list[str]) -> tuple[str, ...]:
        types = self.hf.get("layer_types")
        if types is None:
            return tuple(default)
        if not isinstance(types, list) or len(types) != num_layers:
            raise self.fail(f"layer_types must list one kind per layer ({num_layers})")
        for t in types:
            if t not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise self.fail(
                    f"layer_types entry {t!r} is not {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}"
                )
        return tuple(types)

    def window(self, layer_types: tuple[str, ...]) -> int | None:
        try:
            w = sliding_window_size_from_hf(self.hf, self.architecture)
        except ModelConfigError as exc:
            raise self.fail(str(exc)) from exc
        if w is None and SLIDING_ATTENTION in layer_types:
            raise MissingConfigFieldError(
                "sliding_window", self.source, "layer_types has sliding_attention layers"
            )
        return w

    def check_heads(self, num_heads: int, kind: AttentionKindConfig, name: str) -> None:
        if num_heads % kind.num_kv_heads:
            raise self.fail(
                f"num_attention_heads={num_heads} is not a multiple of the {name} layers' "
                f"KV heads ({kind.num_kv_heads})"
            )

    def rope(self, params: Mapping[str, Any], head_dim: int, default_partial: float) -> RopeConfig:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise self.fail(f"rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
        theta = params.get("rope_theta")
        if theta is None:
            raise MissingConfigFieldError("rope_parameters.rope_theta", self.source)
        partial = float(params.get("partial_rotary_factor", default_partial))
        if rope_type == "default":
            return RopeConfig("default", float(theta), head_dim, partial)
        if rope_type == "proportional":
            factor = float(params.get("factor") or 1.0)
            return RopeConfig("proportional", float(theta), head_dim, partial, factor=factor)
        if params.get("factor") is None:
            raise MissingConfigFieldError(
                "rope_parameters.factor", self.source, f"{rope_type} RoPE"
            )
        if rope_type == "linear":
            return RopeConfig(
                "linear", float(theta), head_dim, partial, factor=float(params["factor"])
            )
        if rope_type == "llama3":
            if params.get("original_max_position_embeddings") is None:
                raise MissingConfigFieldError(
                    "rope_parameters.original_max_position_embeddings", self.source, "llama3 RoPE"
                )
            return RopeConfig(
                "llama3",
                float(theta),
                head_dim,
                partial,
                factor=float(params["factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            )
        original = params.get("original_max_position_embeddings")
        if original is None:
            original = self.hf.get(
                "original_max_position_embeddings", self.hf.get("max_position_embeddings")
            )
        if original is None:
            raise MissingConfigFieldError(
                "rope_parameters.original_max_position_embeddings", self.source, "YaRN RoPE"
            )
        return RopeConfig(
            "yarn",
            float(theta),
            head_dim,
            partial,
            factor=float(params["factor"]),
            original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
        )

    def common(self) -> dict[str, Any]:
        eos = self.hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return dict(
            architecture=self.architecture,
            source=self.source,
            vocab_size=self.required_int("vocab_size"),
            hidden_size=self.required_int("hidden_size"),
            num_heads=self.required_int("num_attention_heads"),
            rms_norm_eps=self.number("rms_norm_eps", 1e-5),
            tie_word_embeddings=bool(self.hf.get("tie_word_embeddings", False)),
            max_position_embeddings=self.optional_int("max_position_embeddings", 131072),
            bos_token_id=self.hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=self.hf.get("pad_token_id"),
            quantization=parse_quantization_config(self.hf, self.source),
        )


class DenseConfigParser(ConfigParser):
    """A model whose every layer has one dense gated MLP (`intermediate_size`) and one KV shape
    for both kinds, attention without sinks: the parts its parsers share."""

    activations: tuple[str, ...] = ("silu",)

    def every_nth_global(self, n: int, default_pattern: int) -> tuple[str, ...]:
        """`layer_types`, else every `sliding_window_pattern`-th layer global, the rest local."""
        pattern = self.optional_int("sliding_window_pattern", default_pattern)
        return self.layer_types(
            n, [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(n)]
        )

    def activation(self, name: str = "hidden_act") -> str:
        act = str(self.hf.get(name) or self.activations[0])
        if act not in self.activations:
            raise self.fail(f"{name} {act!r} is not supported; supported: {self.activations}")
        return act

    def flat_rope(self, head_dim: int, default_theta: float = 10_000.0) -> RopeConfig:
        """One RoPE for every layer that has one: `rope_parameters`, or the older `rope_scaling`
        and `rope_theta`; the whole head rotates."""
        params = dict(self.hf.get("rope_parameters") or self.hf.get("rope_scaling") or {})
        params.setdefault("rope_type", "default")
        params.setdefault("rope_theta", self.hf.get("rope_theta", default_theta))
        params["partial_rotary_factor"] = 1.0
        return self.rope(params, head_dim, 1.0)

    def dense_config(
        self,
        common: dict[str, Any],
        types: tuple[str, ...],
        head_dim: int,
        kv_heads: int,
        ropes: Mapping[str, RopeConfig | None],
        act: str,
        **extra: Any,
    ) -> ModelConfig:
        """The `ModelConfig` of layers `types`, `ropes` by kind (None: NoPE)."""
        full = AttentionKindConfig(kv_heads, head_dim, head_dim, False, ropes[FULL_ATTENTION])
        swa = AttentionKindConfig(kv_heads, head_dim, head_dim, False, ropes[SLIDING_ATTENTION])
        self.check_heads(common["num_heads"], full, "attention")
        bias = bool(self.hf.get("attention_bias", False))
        return ModelConfig(
            **common,
            layer_types=types,
            mlp_layer_types=("dense",) * len(types),
            sliding_window_size=self.window(types) if SLIDING_ATTENTION in types else None,
            full_attention=full,
            swa_attention=swa,
            attention_bias=bias,
            o_proj_bias=bias,
            attention_value_scale=None,
            hidden_act=act,
            intermediate_size=self.required_int("intermediate_size"),
            moe=MoEConfig(0, 0, 0),
            **extra,
        )


class GptOssConfigParser(ConfigParser):
    """transformers' GptOssConfig: all layers have sinks and q/k/v/o biases (attention_bias);
    one YaRN RoPE for both kinds; every layer is MoE."""

    architecture = GPT_OSS
    _DEFAULT_ROPE: Mapping[str, Any] = {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    }

    def parse(self) -> ModelConfig:
        common = self.common()
        n = self.required_int("num_hidden_layers")
        types = self.layer_types(
            n, [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(n)]
        )
        head_dim = self.required_int("head_dim")
        params = dict(
            self.hf.get("rope_parameters") or self.hf.get("rope_scaling") or self._DEFAULT_ROPE
        )
        params.setdefault("rope_theta", self.hf.get("rope_theta", 150000.0))
        if params.get("rope_type", params.get("type")) == "default":
            params["partial_rotary_factor"] = 1.0  # HF's default RoPE for GPT-OSS rotates all
        rope = self.rope(params, head_dim, 1.0)
        if rope.rotary_dim != head_dim:
            raise self.fail("GPT-OSS RoPE must rotate the whole head (partial_rotary_factor 1)")
        kind = AttentionKindConfig(
            num_kv_heads=self.required_int("num_key_value_heads"),
            head_dim=head_dim,
            v_head_dim=head_dim,
            has_sinks=True,
            rope=rope,
        )
        self.check_heads(common["num_heads"], kind, "attention")
        bias = bool(self.hf.get("attention_bias", True))
        moe = MoEConfig(
            num_experts=self._num_experts(),
            num_experts_per_tok=self.required_int("num_experts_per_tok"),
            intermediate_size=self.required_int("intermediate_size"),
            swiglu_alpha=self.number("swiglu_alpha", 1.702),
            swiglu_limit=self.number("swiglu_limit", 7.0),
        )
        if moe.num_experts_per_tok > moe.num_experts:
            raise self.fail("num_experts_per_tok exceeds the number of experts")
        return ModelConfig(
            **common,
            layer_types=types,
            mlp_layer_types=("sparse",) * n,
            sliding_window_size=self.window(types),
            full_attention=kind,
            swa_attention=kind,
            attention_bias=bias,
            o_proj_bias=bias,
            attention_value_scale=None,
            hidden_act=str(self.hf.get("hidden_act", "silu")),
            intermediate_size=moe.intermediate_size,
            moe=moe,
        )

    def _num_experts(self) -> int:
        if self.hf.get("num_local_experts") is None and self.hf.get("num_experts") is not None:
            return self.required_int("num_experts")
        return self.required_int("num_local_experts")


class MiMoConfigParser(ConfigParser):
    """transformers' MiMoV2FlashConfig: SWA layers have 2 × num_key_value_heads and sinks, full
    layers neither; per-kind RoPE theta and partial rotary; V head dim may differ from K's;
    V is scaled by attention_value_scale; "dense" layers have a SwiGLU MLP, "sparse" ones MoE."""

    architecture = MIMO_V2_FLASH
    _DEFAULT_ROPE: Mapping[str, Mapping[str, Any]] = {
        FULL_ATTENTION: {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "partial_rotary_factor": 0.334,
        },
        SLIDING_ATTENTION: {
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.334,
        },
    }

    def parse(self) -> ModelConfig:
        common = self.common()
        n = self.required_int("num_hidden_layers")
        types = self.layer_types(n, self._default_layer_types(n))
        mlp_types = self._mlp_layer_types(n)
        head_dim = self.required_int("head_dim")
        v_head_dim = self.required_int("v_head_dim")
        kv_heads = self.required_int("num_key_value_heads")
        rope_by_kind = self.hf.get("rope_parameters") or self._DEFAULT_ROPE

        def kind(name: str, heads: int, sinks: bool) -> AttentionKindConfig:
            params = rope_by_kind.get(name) if isinstance(rope_by_kind, Mapping) else None
            if not isinstance(params, Mapping):
                raise MissingConfigFieldError(f"rope_parameters.{name}", self.source)
            rope = self.rope(
                params, head_dim, 0.334 if params.get("rope_type", "default") == "default" else 1.0
            )
            return AttentionKindConfig(heads, head_dim, v_head_dim, sinks, rope)

        full = kind(FULL_ATTENTION, kv_heads, False)
        swa = kind(SLIDING_ATTENTION, 2 * kv_heads, True)
        for name, k in ((FULL_ATTENTION, full), (SLIDING_ATTENTION, swa)):
            if name in types:
                self.check_heads(common["num_heads"], k, name)
        act = str(self.hf.get("hidden_act", "silu"))
        if act != "silu":
            raise self.fail(f"hidden_act {act!r} is not supported (only 'silu')")
        scale = self.hf.get("attention_value_scale", 0.707)
        dense_size = (
            self.required_int("intermediate_size", "dense MLP layers")
            if "dense" in mlp_types
            else 0
        )
        return ModelConfig(
            **common,
            layer_types=types,
            mlp_layer_types=mlp_types,
            sliding_window_size=self.window(types),
            full_attention=full,
            swa_attention=swa,
            attention_bias=bool(self.hf.get("attention_bias", False)),
            o_proj_bias=False,
            attention_value_scale=None if scale is None else float(scale),
            hidden_act=act,
            intermediate_size=dense_size,
            moe=self._moe() if "sparse" in mlp_types else MoEConfig(0, 0, 0),
        )

    def _default_layer_types(self, n: int) -> list[str]:
        """HF's default (full at layer 0 and every 6th), or the older `hybrid_layer_pattern`
        (1 = SWA, 0 = full) when config.json has no `layer_types`."""
        pattern = self.hf.get("hybrid_layer_pattern")
        if pattern is None:
            return [
                FULL_ATTENTION if i == 0 or not (i + 1) % 6 else SLIDING_ATTENTION for i in range(n)
            ]
        if (
            not isinstance(pattern, list)
            or len(pattern) != n
            or any(p not in (0, 1) for p in pattern)
        ):
            raise self.fail(
                f"hybrid_layer_pattern must list 0 (full) or 1 (SWA) for each of {n} layers"
            )
        return [SLIDING_ATTENTION if p == 1 else FULL_ATTENTION for p in pattern]

    def _mlp_layer_types(self, n: int) -> tuple[str, ...]:
        types = self.hf.get("mlp_layer_types")
        if types is None and isinstance(self.hf.get("moe_layer_freq"), list):
            types = ["sparse" if f else "dense" for f in self.hf["moe_layer_freq"]]
        if types is None:
            types = ["dense"] + ["sparse"] * (n - 1)
        if (
            not isinstance(types, list)
            or len(types) != n
            or any(t not in ("dense", "sparse") for t in types)
        ):
            raise self.fail(f"mlp_layer_types must list 'dense' or 'sparse' for each of {n} layers")
        return tuple(types)

    def _moe(self) -> MoEConfig:
        if self.hf.get("n_routed_experts") is None and self.hf.get("num_local_experts") is not None:
            experts = self.required_int("num_local_experts")
        else:
            experts = self.required_int("n_routed_experts", "sparse MLP layers")
        scaling = self.hf.get("routed_scaling_factor")
        moe = MoEConfig(
            num_experts=experts,
            num_experts_per_tok=self.required_int("num_experts_per_tok", "sparse MLP layers"),
            intermediate_size=self.required_int("moe_intermediate_size", "sparse MLP layers"),
            n_group=self.optional_int("n_group", 1),
            topk_group=self.optional_int("topk_group", 1),
            norm_topk_prob=bool(self.hf.get("norm_topk_prob", True)),
            routed_scaling_factor=1.0 if scaling is None else float(scaling),
        )
        if experts % moe.n_group or experts // moe.n_group < 2:
            raise self.fail(
                f"n_routed_experts={experts} must split into n_group={moe.n_group} groups of at least 2"
            )
        if moe.topk_group > moe.n_group:
            raise self.fail(f"topk_group={moe.topk_group} exceeds n_group={moe.n_group}")
        if moe.num_experts_per_tok > moe.topk_group * (experts // moe.n_group):
            raise self.fail("num_experts_per_tok exceeds the experts of the selected groups")
        return moe


class Gemma3ConfigParser(DenseConfigParser):
    """transformers' Gemma3TextConfig: local (sliding) and global layers, 5:1 by default
    (`sliding_window_pattern`), one KV shape, no sinks; per-kind RoPE (nested
    `rope_parameters`, or the older `rope_theta` for global layers, `rope_local_base_freq` for
    local ones and `rope_scaling` for global ones only); softmax scale
    query_pre_attn_scalar^-0.5; GeGLU MLP; tied embeddings by default."""

    architecture = GEMMA3
    activations = ("gelu_pytorch_tanh", "silu")
    _DEFAULT_THETA: Mapping[str, float] = {FULL_ATTENTION: 1_000_000.0, SLIDING_ATTENTION: 10_000.0}

    def parse(self) -> ModelConfig:
        common = self.common()
        common["rms_norm_eps"] = self.number("rms_norm_eps", 1e-6)
        common["tie_word_embeddings"] = bool(self.hf.get("tie_word_embeddings", True))
        if self.hf.get("use_bidirectional_attention"):
            raise self.fail("use_bidirectional_attention (an encoder's mask) is not supported")
        if self.hf.get("attn_logit_softcapping") is not None:
            raise self.fail("attn_logit_softcapping is not supported (Gemma 3 does not use it)")
        n = self.required_int("num_hidden_layers")
        head_dim = self.optional_int("head_dim", 256)
        cap = self.hf.get("final_logit_softcapping")
        return self.dense_config(
            common,
            self.every_nth_global(n, 6),
            head_dim,
            self.required_int("num_key_value_heads"),
            self._rope_by_kind(head_dim),
            self.activation("hidden_activation"),
            attention_scale=self.number("query_pre_attn_scalar", 256.0) ** -0.5,
            final_logit_softcapping=None
            if cap is None
            else self.number("final_logit_softcapping", 0.0),
        )

    def _rope_by_kind(self, head_dim: int) -> dict[str, RopeConfig]:
        nested = self.hf.get("rope_parameters")
        out = {}
        for kind in (FULL_ATTENTION, SLIDING_ATTENTION):
            params = dict(nested.get(kind) or {}) if isinstance(nested, Mapping) else {}
            if not params:
                if kind == FULL_ATTENTION:
                    params = dict(self.hf.get("rope_scaling") or {})
                    theta = self.hf.get("rope_theta")
                else:
                    theta = self.hf.get("rope_local_base_freq")
                params.setdefault("rope_type", "default")
                params.setdefault("rope_theta", theta or self._DEFAULT_THETA[kind])
            params.setdefault("rope_theta", self._DEFAULT_THETA[kind])
            params["partial_rotary_factor"] = 1.0
            out[kind] = self.rope(params, head_dim, 1.0)
        return out


class Cohere2ConfigParser(DenseConfigParser):
    """transformers' Cohere2Config: three sliding layers per global one by default
    (`sliding_window_pattern` 4), global layers without position encoding, interleaved RoPE on
    the sliding ones (one `rope_parameters`, or `rope_theta`), head dim hidden / heads whatever
    config.json says, LayerNorm with `layer_norm_eps`, `logit_scale` (default 0.0625), tied
    embeddings by default."""

    architecture = COHERE2

    def parse(self) -> ModelConfig:
        common = self.common()
        common["rms_norm_eps"] = self.number("layer_norm_eps", 1e-5)
        common["tie_word_embeddings"] = bool(self.hf.get("tie_word_embeddings", True))
        heads = common["num_heads"]
        if common["hidden_size"] % heads:
            raise self.fail("hidden_size is not a multiple of num_attention_heads")
        head_dim = common["hidden_size"] // heads  # as Cohere2Config sets it
        rope = dataclasses.replace(self.flat_rope(head_dim), interleaved=True)
        return self.dense_config(
            common,
            self.every_nth_global(self.required_int("num_hidden_layers"), 4),
            head_dim,
            self.optional_int("num_key_value_heads", heads),
            {FULL_ATTENTION: None, SLIDING_ATTENTION: rope},
            self.activation(),
            logit_scale=self.number("logit_scale", 0.0625),
        )


class Olmo3ConfigParser(DenseConfigParser):
    """transformers' Olmo3Config: three sliding layers per global one by default, one KV
    shape, no sinks; per-kind RoPE (nested `rope_parameters`, or the older `rope_theta` with
    `rope_scaling` for the global layers only — the sliding ones then keep θ 5·10⁵, as
    `Olmo3Config` reads it), rotated in float32 as its model does; SwiGLU MLP."""

    architecture = OLMO3
    DEFAULT_THETA = 500_000.0

    def parse(self) -> ModelConfig:
        common = self.common()
        n = self.required_int("num_hidden_layers")
        heads = common["num_heads"]
        head_dim = self.optional_int("head_dim", common["hidden_size"] // heads)
        kv_heads = self.optional_int("num_key_value_heads", heads)
        nested = self.hf.get("rope_parameters")
        ropes = {}
        for kind in (FULL_ATTENTION, SLIDING_ATTENTION):
            params = dict(nested.get(kind) or {}) if isinstance(nested, Mapping) else {}
            if not params:
                if kind == FULL_ATTENTION:
                    params = dict(self.hf.get("rope_scaling") or {})
                    params.setdefault("rope_theta", self.hf.get("rope_theta", self.DEFAULT_THETA))
                params.setdefault("rope_type", "default")
            params.setdefault("rope_theta", self.DEFAULT_THETA)
            if params.get("rope_type", params.get("type")) == "default":
                params["partial_rotary_factor"] = 1.0
            ropes[kind] = dataclasses.replace(self.rope(params, head_dim, 1.0), float32=True)
        return self.dense_config(
            common, self.every_nth_global(n, 4), head_dim, kv_heads, ropes, self.activation()
        )


class Exaone4ConfigParser(DenseConfigParser):
    """transformers' Exaone4Config: local and global layers by `layer_types`, or by
    `sliding_window_pattern` (an int: every n-th layer global; a string such as "LLLG",
    repeated); with a window the global layers have no position encoding, without one every
    layer has RoPE (one `rope_parameters`, Llama 3 scaling in the published checkpoints);
    SwiGLU MLP; no biases."""

    architecture = EXAONE4

    def parse(self) -> ModelConfig:
        common = self.common()
        n = self.required_int("num_hidden_layers")
        hybrid = self.hf.get("sliding_window") is not None
        types = self.layer_types(
            n, self._default_layer_types(n) if hybrid else [FULL_ATTENTION] * n
        )
        heads = common["num_heads"]
        head_dim = self.optional_int("head_dim", common["hidden_size"] // heads)
        rope = self.flat_rope(head_dim)
        return self.dense_config(
            common,
            types,
            head_dim,
            self.optional_int("num_key_value_heads", heads),
            {FULL_ATTENTION: None if hybrid else rope, SLIDING_ATTENTION: rope},
            self.activation(),
        )

    def _default_layer_types(self, n: int) -> list[str]:
        pattern = self.hf.get("sliding_window_pattern", 4)
        if isinstance(pattern, str):
            if not pattern or set(pattern) - {"L", "G"}:
                raise self.fail(f"sliding_window_pattern {pattern!r} is not made of L and G")
            return [
                SLIDING_ATTENTION if pattern[i % len(pattern)] == "L" else FULL_ATTENTION
                for i in range(n)
            ]
        if not is_int(pattern) or pattern < 1:
            raise self.fail("sliding_window_pattern must be an int >= 1 or a string of L / G")
        return [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(n)]


class Gemma4ConfigParser(DenseConfigParser):
    """transformers' Gemma4TextConfig: local and global layers (5:1 by default, the last layer
    always global); global layers with their own head dim and KV heads (`per_layer_config`, or
    `global_head_dim` / `num_global_key_value_heads`), K = V on them with `attention_k_eq_v`;
    per-kind RoPE (global: proportional); q / k / v RMS-normalized per head (v without
    weight), softmax scale 1; the last `num_kv_shared_layers` layers read the KV of the last
    earlier layer of their kind (and, with `use_double_wide_mlp`, have a twice as wide MLP);
    per-layer inputs of `hidden_size_per_layer_input`; GeGLU; final logit soft-cap; with
    `enable_moe_block` a MoE block (`num_experts`, `top_k_experts`, `moe_intermediate_size`)
    beside every layer's MLP."""

    architecture = GEMMA4
    activations = ("gelu_pytorch_tanh", "silu")
    _DEFAULT_ROPE: Mapping[str, Mapping[str, Any]] = {
        SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL_ATTENTION: {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
        },
    }

    def parse(self) -> ModelConfig:
        common = self.common()
        common["rms_norm_eps"] = self.number("rms_norm_eps", 1e-6)
        common["tie_word_embeddings"] = bool(self.hf.get("tie_word_embeddings", True))
        if self.hf.get("use_bidirectional_attention"):
            raise self.fail("use_bidirectional_attention (an encoder's mask) is not supported")
        n = self.required_int("num_hidden_layers")
        types = list(self.every_nth_global(n, 6))
        types[-1] = FULL_ATTENTION  # as Gemma4TextConfig forces it
        heads = common["num_heads"]
        head_dim = self.optional_int("head_dim", 256)
        kv_heads = self.optional_int("num_key_value_heads", 4)
        k_eq_v = bool(self.hf.get("attention_k_eq_v", False))
        global_dim, global_kv = self._global_shape(types, head_dim, kv_heads, k_eq_v)
        nested = self.hf.get("rope_parameters") or {}
        ropes = {}
        for kind, dim in ((SLIDING_ATTENTION, head_dim), (FULL_ATTENTION, global_dim)):
            params = dict(nested.get(kind) or self._DEFAULT_ROPE[kind])
            params.setdefault("rope_theta", self._DEFAULT_ROPE[kind]["rope_theta"])
            ropes[kind] = self.rope(params, dim, 1.0)
        full = AttentionKindConfig(
            global_kv, global_dim, global_dim, False, ropes[FULL_ATTENTION], k_eq_v
        )
        local = AttentionKindConfig(kv_heads, head_dim, head_dim, False, ropes[SLIDING_ATTENTION])
        self.check_heads(heads, full, "global")
        self.check_heads(heads, local, "local")
        cap = self.hf.get("final_logit_softcapping")
        per_layer = self.optional_int("hidden_size_per_layer_input", 256, minimum=0)
        moe = MoEConfig(0, 0, 0)
        if self.hf.get("enable_moe_block"):  # a MoE block beside every layer's MLP (26B-A4B)
            experts = self.required_int("num_experts", "enable_moe_block")
            top_k = self.required_int("top_k_experts", "enable_moe_block")
            if top_k > experts:
                raise self.fail(f"top_k_experts={top_k} exceeds num_experts={experts}")
            moe = MoEConfig(
                experts, top_k, self.required_int("moe_intermediate_size", "enable_moe_block")
            )
        return ModelConfig(
            **common,
            layer_types=tuple(types),
            mlp_layer_types=("sparse" if moe.num_experts else "dense",) * n,
            sliding_window_size=self.window(tuple(types)) if SLIDING_ATTENTION in types else None,
            full_attention=full,
            swa_attention=local,
            attention_bias=bool(self.hf.get("attention_bias", False)),
            o_proj_bias=bool(self.hf.get("attention_bias", False)),
            attention_value_scale=None,
            hidden_act=self.activation("hidden_activation"),
            intermediate_size=self.required_int("intermediate_size"),
            moe=moe,
            attention_scale=1.0,
            final_logit_softcapping=None
            if cap is None
            else self.number("final_logit_softcapping", 0.0),
            kv_source_layers=self._kv_sources(types),
            value_norm=True,
            per_layer_input_size=per_layer,
            per_layer_input_vocab_size=self.optional_int(
                "vocab_size_per_layer_input", common["vocab_size"]
            )
            if per_layer
            else 0,
            double_wide_shared_mlp=bool(self.hf.get("use_double_wide_mlp", False)),
        )

    def _global_shape(
        self, types: list[str], head_dim: int, kv_heads: int, k_eq_v: bool
    ) -> tuple[int, int]:
        """(head dim, KV heads) of the global layers: `per_layer_config`'s override, the same
        for every global layer and none for a local one; else `global_head_dim` (512) and
        `num_global_key_value_heads` (with K = V)."""
        overrides = self.hf.get("per_layer_config")
        if overrides is None:
            dim = self.optional_int("global_head_dim", 512)
            global_kv = self.hf.get("num_global_key_value_heads") if k_eq_v else None
            return dim, self.int_field(
                "num_global_key_value_heads", global_kv, 1
            ) if global_kv else kv_heads
        if not isinstance(overrides, Mapping):
            raise self.fail("per_layer_config must map layer ids to overrides")
        seen = set()
        for key, value in overrides.items():
            if (
                not str(key).isdigit()
                or not 0 <= int(key) < len(types)
                or not isinstance(value, Mapping)
            ):
                raise self.fail(f"per_layer_config entry {key!r} is not a layer id with overrides")
            if types[int(key)] != FULL_ATTENTION:
                raise self.fail(f"per_layer_config overrides local layer {key}: not supported")
            if set(value) - {"head_dim", "num_key_value_heads"}:
                raise self.fail(f"per_layer_config[{key}] overrides {sorted(value)}: not supported")
            seen.add((value.get("head_dim", head_dim), value.get("num_key_value_heads", kv_heads)))
        globals_ = {i for i, kind in enumerate(types) if kind == FULL_ATTENTION}
        if overrides and {int(key) for key in overrides} != globals_:
            raise self.fail("per_layer_config must override every global layer alike, or none")
        if len(seen) > 1:
            raise self.fail(f"the global layers' per_layer_config differ ({sorted(seen)})")
        dim, global_kv = seen.pop() if seen else (head_dim, kv_heads)
        return self.int_field("head_dim", dim, 1), self.int_field(
            "num_key_value_heads", global_kv, 1
        )

    def _kv_sources(self, types: list[str]) -> tuple[int, ...]:
        """Per layer, the layer whose KV it reads: the last `num_kv_shared_layers` layers read
        the last earlier layer of their kind (Gemma4TextConfig.kv_sharing_modes)."""
        n = len(types)
        shared = self.optional_int("num_kv_shared_layers", 0, minimum=0)
        if shared >= n and shared:
            raise self.fail(f"num_kv_shared_layers={shared} leaves no layer that owns KV")
        first = n - shared
        sources = list(range(n))
        for i in range(first, n):
            owners = [j for j in range(first) if types[j] == types[i]]
            if not owners:
                raise self.fail(f"layer {i} shares the KV of a {types[i]} layer, and none owns KV")
            sources[i] = owners[-1]
        return tuple(sources) if shared else ()


class Llama4ConfigParser(ConfigParser):
    """transformers' Llama4TextConfig (or the `text_config` of a Llama4Config): chunked local
    layers with RoPE (interleaved pairs, float32) and, by `use_qk_norm`, a weightless per-head
    RMS norm of q and k after it; global layers without position encoding, their queries scaled
    by the temperature tuning (`attn_temperature_tuning`, `floor_scale`, `attn_scale`). The
    kinds follow `layer_types` ("chunked_attention" / "full_attention", derived from
    `no_rope_layers` and `attention_chunk_size` when absent); a RoPE layer must be a chunked
    one and a NoPE layer a global one. MoE layers (`moe_layers`, else every
    `interleave_moe_layer_step`-th) route each token to `num_experts_per_tok` of
    `num_local_experts` SwiGLU experts by a sigmoid of the top logits, plus a shared expert;
    the other layers have a dense SwiGLU of `intermediate_size_mlp`."""

    architecture = LLAMA4

    def parse(self) -> ModelConfig:
        common = self.common()
        common["max_position_embeddings"] = self.optional_int("max_position_embeddings", 4096 * 32)
        n = self.required_int("num_hidden_layers")
        heads = common["num_heads"]
        head_dim = self.optional_int("head_dim", common["hidden_size"] // heads)
        kv_heads = self.optional_int("num_key_value_heads", heads)
        chunk = self.hf.get("attention_chunk_size", 8192)
        if chunk is not None and (not is_int(chunk) or chunk < 2):
            raise self.fail(f"attention_chunk_size must be an int >= 2, got {chunk!r}")
        interval = self.optional_int("no_rope_layer_interval", 4)
        no_rope = self.hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        if not isinstance(no_rope, list) or len(no_rope) != n:
            raise self.fail(f"no_rope_layers must list one flag per layer ({n})")
        raw_types = self.hf.get("layer_types") or [
            "chunked_attention" if r and chunk is not None else FULL_ATTENTION for r in no_rope
        ]
        if not isinstance(raw_types, list) or len(raw_types) != n:
            raise self.fail(f"layer_types must list one kind per layer ({n})")
        types = []
        for i, (kind, rope_on) in enumerate(zip(raw_types, no_rope, strict=True)):
            if kind not in ("chunked_attention", FULL_ATTENTION):
                raise self.fail(f"layer_types entry {kind!r} is not chunked or full attention")
            if (kind == "chunked_attention") != bool(rope_on):
                raise self.fail(
                    f"layer {i} is {kind} with RoPE {'on' if rope_on else 'off'}: swaserve serves "
                    "Llama 4 with RoPE exactly on its chunked layers"
                )
            types.append(SLIDING_ATTENTION if kind == "chunked_attention" else FULL_ATTENTION)
        chunked = SLIDING_ATTENTION in types
        if chunked and chunk is None:
            raise MissingConfigFieldError("attention_chunk_size", self.source, "chunked layers")
        params = dict(self.hf.get("rope_parameters") or self.hf.get("rope_scaling") or {})
        params.setdefault("rope_type", "default")
        params.setdefault("rope_theta", self.hf.get("rope_theta", 500_000.0))
        params["partial_rotary_factor"] = 1.0
        rope = dataclasses.replace(self.rope(params, head_dim, 1.0), interleaved=True, float32=True)
        full = AttentionKindConfig(kv_heads, head_dim, head_dim, False, None)
        local = AttentionKindConfig(kv_heads, head_dim, head_dim, False, rope)
        self.check_heads(heads, full, "attention")
        step = self.optional_int("interleave_moe_layer_step", 1)
        moe_layers = self.hf.get("moe_layers")
        if moe_layers is None:
            moe_layers = list(range(step - 1, n, step))
        if not isinstance(moe_layers, list) or any(
            not is_int(i) or not 0 <= i < n for i in moe_layers
        ):
            raise self.fail(f"moe_layers must list layer ids in [0, {n})")
        experts = self.optional_int("num_local_experts", 16)
        top_k = self.optional_int("num_experts_per_tok", 1)
        if top_k > experts:
            raise self.fail(f"num_experts_per_tok={top_k} exceeds num_local_experts={experts}")
        expert_size = self.optional_int("intermediate_size", 8192)
        act = str(self.hf.get("hidden_act") or "silu")
        if act != "silu":
            raise self.fail(f"hidden_act {act!r} is not supported; supported: ('silu',)")
        bias = bool(self.hf.get("attention_bias", False))
        temperature = None
        if self.hf.get("attn_temperature_tuning", True):
            temperature = (self.number("floor_scale", 8192.0), self.number("attn_scale", 0.1))
        return ModelConfig(
            **common,
            layer_types=tuple(types),
            mlp_layer_types=tuple("sparse" if i in moe_layers else "dense" for i in range(n)),
            sliding_window_size=chunk - 1 if chunked else None,
            attention_chunk_size=chunk if chunked else None,
            full_attention=full,
            swa_attention=local,
            attention_bias=bias,
            o_proj_bias=bias,
            attention_value_scale=None,
            hidden_act=act,
            intermediate_size=self.optional_int("intermediate_size_mlp", 16384),
            moe=MoEConfig(
                experts,
                top_k,
                expert_size,
                norm_topk_prob=False,
                shared_expert_intermediate_size=expert_size,
            ),
            attention_temperature=temperature,
            qk_l2_norm_after_rope=bool(self.hf.get("use_qk_norm", True)),
        )


PARSERS: dict[str, type[ConfigParser]] = {
    GPT_OSS: GptOssConfigParser,
    MIMO_V2_FLASH: MiMoConfigParser,
    GEMMA3: Gemma3ConfigParser,
    COHERE2: Cohere2ConfigParser,
    OLMO3: Olmo3ConfigParser,
    EXAONE4: Exaone4ConfigParser,
    LLAMA4: Llama4ConfigParser,
    GEMMA4: Gemma4ConfigParser,
}
