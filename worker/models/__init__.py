"""Model side of a worker: HF config parsing (`ModelConfig`), the hybrid-SWA model classes
(GPT-OSS, MiMo-V2-Flash) behind a registry, the safetensors loader, and the tiny-model maker."""

from __future__ import annotations

from swaserve.worker.models.causal_lm import HybridCausalLM
from swaserve.worker.models.config import (
    ModelConfig,
    load_model_config,
    parse_model_config,
    sliding_window_size_from_hf,
)
from swaserve.worker.models.errors import (
    MissingConfigFieldError,
    MissingTensorError,
    ModelConfigError,
    ModelError,
    TensorShapeError,
    UnexpectedTensorError,
    UnknownArchitectureError,
    WeightLoadError,
)
from swaserve.worker.models.loader import build_model, load_model, load_weights
from swaserve.worker.models.registry import MODEL_REGISTRY, get_model_class
from swaserve.worker.models.tiny import make_tiny_model

__all__ = [
    "MODEL_REGISTRY",
    "HybridCausalLM",
    "MissingConfigFieldError",
    "MissingTensorError",
    "ModelConfig",
    "ModelConfigError",
    "ModelError",
    "TensorShapeError",
    "UnexpectedTensorError",
    "UnknownArchitectureError",
    "WeightLoadError",
    "build_model",
    "get_model_class",
    "load_model",
    "load_model_config",
    "load_weights",
    "make_tiny_model",
    "parse_model_config",
    "sliding_window_size_from_hf",
]
