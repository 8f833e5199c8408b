"""`QuantizationConfig`: what config.json's `quantization_config` says the checkpoint stores.

Two methods are read, the two these models are published in:

- `mxfp4` (GPT-OSS): expert weights as `<name>_blocks` (uint8, two FP4 e2m1 values per byte,
  32 values per block) and `<name>_scales` (uint8 E8M0 exponents, one per block);
- `fp8` (MiMo-V2-Flash, DeepSeek-style): `<name>` in float8_e4m3fn and `<name>_scale_inv`, one
  float scale per `weight_block_size` block of the last two dimensions.

The engine keeps both in memory as stored (`quantized_weights.keep_quantized`, which reads this
config to know what is stored quantized) and dequantizes per layer and step; with
`EngineConfig.dequantize_weights` the loader dequantizes them to the model's dtype instead.
`modules_to_not_convert` (alias `ignored_layers`) lists modules stored unquantized, matched as
transformers' `should_convert_module` matches them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from swaserve.worker.models.errors import UnsupportedQuantizationError

MXFP4 = "mxfp4"
FP8 = "fp8"
QUANT_METHODS = (MXFP4, FP8)
DEFAULT_FP8_BLOCK_SIZE = (128, 128)
_MODULE_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """One checkpoint's quantization, as config.json declares it."""

    method: str  # MXFP4 or FP8
    weight_block_size: tuple[int, int] | None  # FP8: (rows, cols) per scale; MXFP4: None
    modules_to_not_convert: tuple[str, ...] = ()

    def converts(self, module_name: str) -> bool:
        """Whether `module_name` (e.g. "model.layers.0.self_attn.o_proj") is stored quantized:
        not when a `modules_to_not_convert` entry matches it from the start up to a module
        boundary (as a regex: "model.layers.*.self_attn"), or as a suffix ("lm_head")."""
        return not any(
            re.match(rf"(?:{key}){_MODULE_BOUNDARY}", module_name) or module_name.endswith(key)
            for key in self.modules_to_not_convert
        )


def parse_quantization_config(
    hf: Mapping[str, Any], source: str = "config.json"
) -> QuantizationConfig | None:
    """The `quantization_config` of an HF config dict, or None when there is none."""
    raw = hf.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise UnsupportedQuantizationError(f"{source}: quantization_config must be an object")
    method = raw.get("quant_method")
    if method not in QUANT_METHODS:
        raise UnsupportedQuantizationError(
            f"{source}: quantization_config.quant_method {method!r} is not supported; "
            f"supported: {', '.join(QUANT_METHODS)}"
        )
    skip = raw.get("modules_to_not_convert")
    if skip is None:
        skip = raw.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise UnsupportedQuantizationError(
            f"{source}: quantization_config.modules_to_not_convert must list module names"
        )
    block: tuple[int, int] | None = None
    if method == FP8:
        block = _block_size(raw.get("weight_block_size", DEFAULT_FP8_BLOCK_SIZE), source)
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise UnsupportedQuantizationError(
                f"{source}: quantization_config.fmt {fmt!r} is not supported (only 'e4m3')"
            )
    return QuantizationConfig(method, block, tuple(skip))


def _block_size(value: Any, source: str) -> tuple[int, int]:
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise UnsupportedQuantizationError(
            f"{source}: quantization_config.weight_block_size must be two positive ints "
            f"(per-tensor FP8 scales are not supported), got {value!r}"
        )
    return int(value[0]), int(value[1])
