"""Write a tiny random GPT-OSS or MiMo-V2-Flash model dir: config.json (loadable by
transformers' AutoConfig and model classes), random safetensors weights, and a byte-level
tokenizer (tokenizer.json + tokenizer_config.json with a simple chat template).

Weights follow our model classes' parameter shapes, drawn from one seeded generator: the same
arguments give the same bytes. Every checkpoint layout the loader reads can be written:

- `checkpoint_format`: "hf" writes the packed in-memory names; "original" the layout the
  architecture is published in and transformers' `save_pretrained` writes (MiMo-V2-Flash:
  per-expert gate/up/down_proj and `attention_sink_bias`; GPT-OSS: the packed names, as
  published), through the architecture's `WeightMap`;
- `quantization`: "mxfp4" (GPT-OSS: experts as random MXFP4 blocks and scales, the config of
  the published checkpoints) or "fp8" (projection weights as float8_e4m3fn with block scales,
  DeepSeek / MiMo-V2-Flash style; `modules_to_not_convert` stay float).

Used by tests, benches and the demo; `swaserve make-tiny-model DIR --arch gpt-oss|mimo-v2-flash|
gemma3|gemma4|cohere2|olmo3|exaone4|llama4 [--format hf|original] [--quantization none|mxfp4|fp8]` runs
it from the command line. For llama4 the window argument is the chunk C (`attention_chunk_size`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from swaserve.proto.text import mimo
from swaserve.proto.text.harmony import SPECIAL_TOKENS as HARMONY_SPECIAL_TOKENS
from swaserve.worker.models.causal_lm import UnboundBackend
from swaserve.worker.models.checkpoint import INDEX_FILE, SINGLE_FILE
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
    parse_model_config,
)
from swaserve.worker.models.fp8 import quantize_fp8
from swaserve.worker.models.mxfp4 import random_mxfp4
from swaserve.worker.models.quantization import FP8, MXFP4
from swaserve.worker.models.registry import get_model_class
from swaserve.worker.models.weight_maps import weight_map
from swaserve.worker.models.weight_sources import FP8_SCALE, MXFP4_BLOCKS, MXFP4_SCALES

WEIGHTS_DTYPES = ("float32", "bfloat16")  # torch dtype names

ARCHITECTURES = {
    "gpt-oss": GPT_OSS,
    "mimo-v2-flash": MIMO_V2_FLASH,
    "gemma3": GEMMA3,
    "cohere2": COHERE2,
    "olmo3": OLMO3,
    "exaone4": EXAONE4,
    "llama4": LLAMA4,
    "gemma4": GEMMA4,
}
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258  # byte tokens are 0..255, then SPECIAL_TOKENS in order
HARMONY_TOKENS = HARMONY_SPECIAL_TOKENS
"""With `harmony=True` a GPT-OSS tokenizer also has harmony's special tokens (ids from 262,
after SPECIAL_TOKENS): its chat goes through the harmony renderer and parser, as the published
model's does."""
MIMO_MTP_LAYERS = 3
"""MiMo-V2-Flash's multi-token-prediction depths (`model.mtp.layers.{0,1,2}`)."""
MIMO_SPECIAL_TOKENS = mimo.SPECIAL_TOKENS
MIMO_ADDED_TOKENS = mimo.ADDED_TOKENS
"""With `native_chat=True` a MiMo-V2-Flash tokenizer also has ChatML's special tokens and the
`<think>` / `<tool_call>` tokens (ids from 262, special ones first), and its chat template is
MiMo's format (`proto.text.mimo.CHAT_TEMPLATE`): its chat is rendered and parsed as the
published model's is."""
GEMMA_SPECIAL_TOKENS = ("<start_of_turn>", "<end_of_turn>")
GEMMA_CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- set first = messages[0].content + '\n\n' if messages and messages[0].role == 'system' else '' -%}
{%- set turns = messages[1:] if messages and messages[0].role == 'system' else messages -%}
{%- for m in turns -%}
{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' -}}
{{- (first if loop.first else '') + m.content | trim + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"""
"""Gemma's chat format (with `native_chat`): `<start_of_turn>user|model ... <end_of_turn>`, a
system message folded into the first user turn; `<end_of_turn>` joins the EOS ids."""
LLAMA4_SPECIAL_TOKENS = ("<|header_start|>", "<|header_end|>", "<|eot|>")
LLAMA4_CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- for m in messages -%}
{{- '<|header_start|>' + m.role + '<|header_end|>\n\n' + m.content | trim + '<|eot|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|header_start|>assistant<|header_end|>\n\n' -}}{%- endif -%}"""
"""Llama 4's chat format (with `native_chat`): `<|header_start|>ROLE<|header_end|>` then two
newlines, the content and `<|eot|>`; `<|eot|>` joins the EOS ids."""
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
    "{{ message['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHECKPOINT_FORMATS = ("hf", "original")
QUANTIZATIONS = ("none", MXFP4, FP8)
# As the published GPT-OSS config.json: only the experts are MXFP4.
MXFP4_MODULES_TO_NOT_CONVERT = (
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
)
# Layer 0's attention stays float, so that a tiny FP8 model exercises the rule.
FP8_MODULES_TO_NOT_CONVERT = ("model.layers.0.self_attn", "lm_head", "model.embed_tokens")
_MXFP4_EXPERTS = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)$")
_FP8_PROJECTIONS = re.compile(r"^model\.layers\..*_proj(\.weight)?$")  # not routers, norms, biases


def make_tiny_model(
    model_dir: str | Path,
    arch: str = "gpt-oss",
    num_layers: int = 4,
    sliding_window_size: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    hidden_size: int = 32,
    seed: int = 0,
    *,
    layer_types: list[str] | None = None,
    head_dim: int | None = None,
    v_head_dim: int | None = None,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    vocab_size: int | None = None,
    num_shards: int = 1,
    checkpoint_format: str = "hf",
    quantization: str = "none",
    fp8_block_size: tuple[int, int] = (128, 128),
    harmony: bool = False,
    native_chat: bool = False,
    mtp_layers: int | None = None,
    weights_dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Write the model dir and return its path.

    `num_kv_heads` is the full layers' KV heads (MiMo's SWA layers get twice as many); W is
    `sliding_window_size` (config.json stores `sliding_window = W + 1`, as HF expects).
    `layer_types` defaults to each architecture's HF pattern. `overrides` are extra or replaced
    config.json fields (e.g. `swiglu_limit=0.5`, `tie_word_embeddings=True`, `n_group=2`).
    `num_shards > 1` writes a sharded checkpoint with `model.safetensors.index.json`.
    `native_chat`: the tokenizer has the family's own chat tokens and template (GPT-OSS:
    harmony's special tokens, `HARMONY_TOKENS`; MiMo-V2-Flash: its ChatML, `<think>` and
    `<tool_call>` tokens and template); off, a simple chat template (tests that compare raw
    output text use it). `harmony`: the same, GPT-OSS only.
    `checkpoint_format`, `quantization`: see the module docstring; `fp8_block_size` is FP8's
    `weight_block_size` (rows, cols). `mtp_layers`: MiMo-V2-Flash's multi-token-prediction
    depths (`model.mtp.layers.{j}`, `models.mtp`), 3 by default as the published model; the
    other families have none. `weights_dtype`: the dtype the float weights are stored in
    ("bfloat16" as the published checkpoints; FP8 scales stay float32); the engine computes in
    float32 on CPU either way.
    """
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {sorted(WEIGHTS_DTYPES)}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}")
    if quantization == MXFP4 and arch != "gpt-oss":
        raise ValueError("mxfp4 is GPT-OSS's checkpoint format; use fp8 for mimo-v2-flash")
    if sliding_window_size < 0 or num_layers < 1 or num_shards < 1:
        raise ValueError("need sliding_window_size >= 0, num_layers >= 1 and num_shards >= 1")
    if harmony and arch != "gpt-oss":
        raise ValueError("harmony is GPT-OSS's format")
    if mtp_layers is None:
        mtp_layers = MIMO_MTP_LAYERS if arch == "mimo-v2-flash" else 0
    if mtp_layers < 0 or (mtp_layers and arch != "mimo-v2-flash"):
        raise ValueError("mtp_layers: MiMo-V2-Flash's multi-token-prediction depths, >= 0")
    special: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    template = CHAT_TEMPLATE
    if harmony or (native_chat and arch == "gpt-oss"):
        special = HARMONY_TOKENS
    elif native_chat and arch == "gemma3":
        special, template = GEMMA_SPECIAL_TOKENS, GEMMA_CHAT_TEMPLATE
    elif native_chat and arch == "llama4":
        special, template = LLAMA4_SPECIAL_TOKENS, LLAMA4_CHAT_TEMPLATE
    elif native_chat and arch == "mimo-v2-flash":
        special, added, template = MIMO_SPECIAL_TOKENS, MIMO_ADDED_TOKENS, mimo.CHAT_TEMPLATE
    elif native_chat:
        raise ValueError(
            f"no native chat format for {arch}; the families with one: gpt-oss, mimo-v2-flash, "
            "gemma3, llama4"
        )
    tokens = 256 + len(SPECIAL_TOKENS) + len(special) + len(added)
    vocab = vocab_size or 32 * math.ceil(tokens / 32)
    if vocab < tokens:
        raise ValueError(f"vocab_size must hold the {tokens} tokenizer tokens")
    head = hidden_size // num_heads
    common: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "sliding_window": sliding_window_size + 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "num_experts_per_tok": num_experts_per_tok,
    }
    if arch == "gpt-oss":
        hf = common | {
            "model_type": "gpt_oss",
            "head_dim": head_dim or head,
            "layer_types": layer_types
            or [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)],
            "intermediate_size": hidden_size,
            "num_local_experts": num_experts,
            "attention_bias": True,
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
        }
    elif arch == "gemma3":
        dk = head_dim or head
        hf = common | {
            "model_type": "gemma3_text",
            "head_dim": dk,
            "layer_types": layer_types
            or [SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(num_layers)],
            "intermediate_size": 2 * hidden_size,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 3 * dk // 2,  # not Dk: the scale is its own
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
            "rope_parameters": {
                FULL_ATTENTION: {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 4.0},
                SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0},
            },
        }
        del hf["hidden_act"], hf["num_experts_per_tok"]
    elif arch == "llama4":
        kinds = layer_types or [
            SLIDING_ATTENTION if (i + 1) % 4 else FULL_ATTENTION for i in range(num_layers)
        ]
        hf = common | {
            "model_type": "llama4_text",
            "head_dim": head_dim or head,
            "attention_chunk_size": sliding_window_size,  # C: the local span of this family
            "layer_types": [
                "chunked_attention" if k == SLIDING_ATTENTION else FULL_ATTENTION for k in kinds
            ],
            "no_rope_layers": [int(k == SLIDING_ATTENTION) for k in kinds],
            "moe_layers": list(range(1, num_layers, 2)),  # dense and MoE layers both
            "num_local_experts": num_experts,
            "intermediate_size": hidden_size,
            "intermediate_size_mlp": 2 * hidden_size,
            "use_qk_norm": True,
            "attn_temperature_tuning": True,
            "floor_scale": 4,  # the temperature changes every 4 positions (8192 published)
            "attn_scale": 0.1,
            "attention_bias": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        }
        del hf["sliding_window"]
    elif arch == "gemma4":
        dk = head_dim or head
        kinds = list(
            layer_types
            or [SLIDING_ATTENTION if (i + 1) % 3 else FULL_ATTENTION for i in range(num_layers)]
        )
        kinds[-1] = FULL_ATTENTION  # Gemma4TextConfig forces it
        hf = common | {
            "model_type": "gemma4_text",
            "head_dim": dk,
            "layer_types": kinds,
            # global layers: twice the head dim, one KV head, K = V (as the published ones)
            "per_layer_config": {
                str(i): {"head_dim": 2 * dk, "num_key_value_heads": 1}
                for i, kind in enumerate(kinds)
                if kind == FULL_ATTENTION
            },
            "attention_k_eq_v": True,
            "num_kv_shared_layers": 2 if num_layers >= 5 else 0,
            "use_double_wide_mlp": True,
            "hidden_size_per_layer_input": 4,
            "vocab_size_per_layer_input": vocab,
            "intermediate_size": 2 * hidden_size,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
            "rope_parameters": {
                FULL_ATTENTION: {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1_000_000.0,
                },
                SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0},
            },
        }
        if overrides.get("enable_moe_block"):
            hf |= {"num_experts": num_experts, "top_k_experts": num_experts_per_tok}
            hf["moe_intermediate_size"] = hidden_size
        del hf["hidden_act"], hf["num_experts_per_tok"]
    elif arch == "exaone4":
        hf = common | {
            "model_type": "exaone4",
            "head_dim": head_dim or head,
            "layer_types": layer_types
            or [SLIDING_ATTENTION if (i + 1) % 4 else FULL_ATTENTION for i in range(num_layers)],
            "intermediate_size": 2 * hidden_size,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 1_000_000.0,
                "factor": 16.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        }
        del hf["num_experts_per_tok"]
    elif arch == "olmo3":
        hf = common | {
            "model_type": "olmo3",
            "head_dim": head_dim or head,
            "layer_types": layer_types
            or [SLIDING_ATTENTION if (i + 1) % 4 else FULL_ATTENTION for i in range(num_layers)],
            "intermediate_size": 2 * hidden_size,
            "attention_bias": False,
            "rope_parameters": {
                FULL_ATTENTION: {
                    "rope_type": "yarn",
                    "rope_theta": 500_000.0,
                    "factor": 8.0,
                    "original_max_position_embeddings": 1024,
                    "attention_factor": 1.2,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                },
                SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 500_000.0},
            },
        }
        del hf["num_experts_per_tok"]
    elif arch == "cohere2":
        hf = common | {
            "model_type": "cohere2",
            "layer_types": layer_types
            or [SLIDING_ATTENTION if (i + 1) % 4 else FULL_ATTENTION for i in range(num_layers)],
            "intermediate_size": 2 * hidden_size,
            "layer_norm_eps": 1e-5,
            "logit_scale": 0.5,  # the default 0.0625 flattens a tiny model's logits
            "attention_bias": False,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
        }
        del hf["num_experts_per_tok"], hf["rms_norm_eps"]
    else:
        full_every_6th = [
            FULL_ATTENTION if i == 0 or (i + 1) % 6 == 0 else SLIDING_ATTENTION
            for i in range(num_layers)
        ]
        hf = common | {
            "model_type": "mimo_v2_flash",
            "head_dim": head_dim or 3 * head,  # as MiMo-V2-Flash: Dk = 192, Dv = 128 at D/H = 64
            "v_head_dim": v_head_dim or 2 * head,
            "layer_types": layer_types or full_every_6th,
            "mlp_layer_types": ["dense"] + ["sparse"] * (num_layers - 1),
            "intermediate_size": 2 * hidden_size,
            "moe_intermediate_size": hidden_size,
            "n_routed_experts": num_experts,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "attention_bias": False,
            "attention_value_scale": 0.707,
            "rope_parameters": {
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
            },
        }
    if quantization == MXFP4:
        hf["quantization_config"] = {
            "quant_method": MXFP4,
            "modules_to_not_convert": list(MXFP4_MODULES_TO_NOT_CONVERT),
        }
    elif quantization == FP8:
        hf["quantization_config"] = {
            "quant_method": FP8,
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(fp8_block_size),
            "modules_to_not_convert": list(FP8_MODULES_TO_NOT_CONVERT),
        }
    if special == LLAMA4_SPECIAL_TOKENS:  # generation ends at <|eot|>, as Llama 4's does
        hf["eos_token_id"] = [EOS_ID, 256 + len(SPECIAL_TOKENS) + 2]
    if special == GEMMA_SPECIAL_TOKENS:  # generation ends at a turn's end, as Gemma's does
        hf["eos_token_id"] = [EOS_ID, 256 + len(SPECIAL_TOKENS) + 1]
    if weights_dtype != "float32":
        hf["torch_dtype"] = weights_dtype
    hf |= overrides
    root = Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    weights = checkpoint_weights(hf, seed, checkpoint_format, mtp_layers)
    if weights_dtype != "float32":
        stored = getattr(torch, weights_dtype)
        for name, tensor in weights.items():
            if tensor.dtype == torch.float32 and not name.endswith(FP8_SCALE):
                weights[name] = tensor.to(stored)
    _write_weights(root, weights, num_shards)
    write_byte_tokenizer(root, special, added, template)
    return root


def checkpoint_weights(
    hf_config: dict[str, Any], seed: int, checkpoint_format: str = "hf", mtp_layers: int = 0
) -> dict[str, torch.Tensor]:
    """Checkpoint name → tensor as `make_tiny_model` writes them: `random_weights`, MXFP4 experts
    drawn at random (from the same generator, after the float weights), `mtp_layers` MTP
    depths (from a generator of their own: the stack's weights are the same with or without
    them), renamed to `checkpoint_format`, FP8 projections quantized per
    `quantization_config`."""
    config = parse_model_config(hf_config, source="<tiny model config>")
    weights = random_weights(hf_config, seed)
    if mtp_layers:
        weights |= random_weights(hf_config, seed + 2, mtp_layers=mtp_layers, prefix="model.mtp.")
    quant = config.quantization
    if quant is not None and quant.method == MXFP4:
        gen = torch.Generator().manual_seed(seed + 1)
        for name in [n for n in weights if _MXFP4_EXPERTS.search(n)]:
            blocks, scales = random_mxfp4(tuple(weights.pop(name).shape), gen)
            weights[name + MXFP4_BLOCKS], weights[name + MXFP4_SCALES] = blocks, scales
    if checkpoint_format == "original":
        weights = weight_map(config.architecture).to_original(weights)
    if quant is not None and quant.method == FP8:
        block = quant.weight_block_size or (128, 128)
        for name in [n for n in weights if _FP8_PROJECTIONS.search(n)]:
            if quant.converts(name.removesuffix(".weight")):
                weights[name], weights[name + FP8_SCALE] = quantize_fp8(weights[name], block)
    return weights


def random_weights(
    hf_config: dict[str, Any], seed: int, *, mtp_layers: int = 0, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """HF name → random tensor for every parameter and persistent buffer of the model that
    `hf_config` describes (a tied LM head appears once, as model.embed_tokens.weight), with
    `mtp_layers` MTP depths; only the names that start with `prefix`."""
    config = parse_model_config(hf_config, source="<tiny model config>")
    config = dataclasses.replace(config, num_mtp_layers=mtp_layers)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, UnboundBackend())
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, meta in model.state_dict(keep_vars=True).items():
        if id(meta) in seen or not name.startswith(prefix):
            continue
        seen.add(id(meta))
        noise = torch.randn(meta.shape, generator=gen, dtype=torch.float32)  # [param shape] float32
        weights[name] = (_mean(name, config.architecture) + _std(name) * noise).to(meta.dtype)
    return weights


def _mean(name: str, architecture: str) -> float:
    """Norm weights and layer scalars near 1 (norms near 0 for Gemma 3, whose norms scale by
    1 + weight)."""
    if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
        return 1.0
    return 1.0 if name.endswith("norm.weight") and architecture != GEMMA3 else 0.0


def _std(name: str) -> float:
    if name.endswith("norm.weight"):
        return 0.1
    if name.endswith(".sinks"):
        return 0.5
    if name.endswith("e_score_correction_bias"):
        return 0.05
    if name.endswith("bias"):
        return 0.02
    return 0.1


def _write_weights(root: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    for stale in [root / SINGLE_FILE, root / INDEX_FILE, *root.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if num_shards == 1:
        save_file(weights, str(root / SINGLE_FILE), metadata={"format": "pt"})
        return
    names = list(weights)
    weight_map: dict[str, str] = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[shard::num_shards]}
        save_file(part, str(root / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (the ByteLevel pre-tokenizer's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def write_byte_tokenizer(
    model_dir: str | Path,
    extra_special: tuple[str, ...] = (),
    added: tuple[str, ...] = (),
    chat_template: str = CHAT_TEMPLATE,
) -> Tokenizer:
    """tokenizer.json: token id = byte value for 0..255, then SPECIAL_TOKENS, then
    `extra_special`, then `added` (single tokens that decode to their text); no merges, so any
    text round-trips. tokenizer_config.json names bos/eos/pad and holds `chat_template`."""
    root = Path(model_dir)
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + extra_special]
    )
    if added:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tokenizer.save(str(root / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "model_max_length": 4096,
        "chat_template": chat_template,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="model dir to write (created if missing)")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="gpt-oss")
    parser.add_argument("--layers", type=int, default=4, help="number of layers")
    parser.add_argument("--window", type=int, default=4, help="W: tokens before the current one")
    parser.add_argument("--heads", type=int, default=4, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads of the full layers")
    parser.add_argument("--hidden", type=int, default=32, help="hidden size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--format",
        choices=CHECKPOINT_FORMATS,
        default="hf",
        help="hf: packed in-memory names; original: the published / save_pretrained layout",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="mxfp4: GPT-OSS experts as MXFP4 blocks + scales; fp8: block-scaled float8 weights",
    )
    parser.add_argument(
        "--native-chat",
        action="store_true",
        help="the family's own chat tokens and template: harmony (GPT-OSS), MiMo's <think> / "
        "<tool_call> format (MiMo-V2-Flash); chats are rendered and parsed as the published "
        "models' are",
    )
    parser.add_argument("--harmony", action="store_true", help="GPT-OSS: the same as --native-chat")
    parser.add_argument(
        "--weights-dtype",
        choices=sorted(WEIGHTS_DTYPES),
        default="float32",
        help="dtype the float weights are stored in (bfloat16: as the published checkpoints)",
    )
    parser.add_argument(
        "--mtp-layers",
        type=int,
        default=None,
        help="MiMo-V2-Flash: multi-token-prediction depths to write (default 3, as published)",
    )


def run(args: argparse.Namespace) -> int:
    root = make_tiny_model(
        args.dir,
        arch=args.arch,
        num_layers=args.layers,
        sliding_window_size=args.window,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        hidden_size=args.hidden,
        seed=args.seed,
        checkpoint_format=args.format,
        quantization=args.quantization,
        harmony=args.harmony,
        native_chat=args.native_chat,
        mtp_layers=args.mtp_layers,
        weights_dtype=args.weights_dtype,
    )
    config = parse_model_config(json.loads((root / "config.json").read_text()))
    print(
        f"wrote {args.arch} to {root}: {config.num_layers} layers "
        f"(full {config.full_layer_ids}, SWA {config.swa_layer_ids}), W={config.sliding_window_size}, "
        f"hidden {config.hidden_size}, vocab {config.vocab_size}, {args.format} layout, "
        f"quantization {args.quantization}"
    )
    return 0
