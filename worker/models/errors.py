"""Typed errors of model config parsing and weight loading. Each message names the file and the
field or tensor at fault, so that a broken model dir can be fixed from the message alone."""

from __future__ import annotations


class ModelError(Exception):
    """Base class of model config and weight errors."""


class ModelConfigError(ModelError, ValueError):
    """config.json is unreadable, inconsistent, or asks for something swaserve does not support."""


class UnknownArchitectureError(ModelConfigError):
    """config.json names an architecture that is not in the model registry."""


class MissingConfigFieldError(ModelConfigError):
    """config.json lacks a field the architecture needs."""

    def __init__(self, field: str, path: str, reason: str = "") -> None:
        self.field = field
        self.path = path
        detail = f" ({reason})" if reason else ""
        super().__init__(f"missing required field {field!r} in {path}{detail}")


class WeightLoadError(ModelError):
    """The checkpoint does not match the model built from config.json."""


class MissingTensorError(WeightLoadError):
    """A parameter of the model has no tensor in the checkpoint."""


class TensorShapeError(WeightLoadError):
    """A checkpoint tensor has another shape than the parameter it loads into."""


class UnexpectedTensorError(WeightLoadError):
    """The checkpoint holds tensors that no parameter of the model takes."""


class CheckpointFileError(WeightLoadError):
    """A safetensors file is unreadable or shorter than its header says (e.g. a cut-off
    download); the message names the file and the first tensor whose bytes are missing."""


class QuantizedTensorError(WeightLoadError):
    """A quantized tensor does not fit its parameter: wrong MXFP4 block count, scales of the
    wrong shape or dtype, or a float8 weight without its scales."""


class UnsupportedQuantizationError(ModelConfigError):
    """config.json's `quantization_config` names a method or option swaserve cannot load."""
