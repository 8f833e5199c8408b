"""Load an HF model dir: config.json → model class (built on the meta device) → safetensors
weights by HF parameter name, from `model.safetensors` or a sharded checkpoint with
`model.safetensors.index.json`. Local files only; nothing is ever downloaded.

Every mismatch is a typed error that names the tensor: a parameter without a tensor
(`MissingTensorError`), a tensor of another shape (`TensorShapeError`), tensors no parameter takes
(`UnexpectedTensorError`, except those the model class declares ignorable).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from swaserve.worker.attention.base import AttentionBackend
from swaserve.worker.models.causal_lm import HybridCausalLM
from swaserve.worker.models.config import ModelConfig, load_model_config
from swaserve.worker.models.errors import (
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    WeightLoadError,
)
from swaserve.worker.models.registry import get_model_class

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES_IN_MESSAGE = 8


def load_model(
    model_dir: str | Path,
    backend: AttentionBackend,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> HybridCausalLM:
    """Parse config.json, build the model on `device` in `dtype`, load its weights (eval mode)."""
    config = load_model_config(model_dir)
    model = build_model(config, backend, dtype=dtype, device=device)
    load_weights(model, model_dir)
    return model


def build_model(
    config: ModelConfig,
    backend: AttentionBackend,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> HybridCausalLM:
    """The registered class for `config.architecture`, built on meta, then given uninitialized
    storage on `device`: load weights before running it."""
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config, backend, dtype=dtype)
    return model.materialize(device).eval()


def checkpoint_index(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name → safetensors file that holds it."""
    root = Path(model_dir)
    index_path = root / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightLoadError(f"cannot read the weight_map of {index_path}: {exc}") from exc
        files = {name: root / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise WeightLoadError(f"{index_path} names shard {shard.name}, which is missing")
        return files
    single = root / SINGLE_FILE
    if not single.is_file():
        raise WeightLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def load_weights(model: HybridCausalLM, model_dir: str | Path) -> None:
    """Copy every parameter and persistent buffer of `model` from the checkpoint in `model_dir`
    (cast to the parameter's dtype, moved to its device). Checks names before reading any data."""
    index = checkpoint_index(model_dir)
    targets, aliases = _load_targets(model)
    sources: dict[str, str] = {}
    for name in targets:
        alias = next((a for a, canonical in aliases.items() if canonical == name), None)
        if name in index:
            sources[name] = name
        elif alias is not None and alias in index:
            sources[name] = alias
    missing = [name for name in targets if name not in sources]
    if missing:
        raise MissingTensorError(
            f"checkpoint in {model_dir} has no tensor for {_names(missing)} "
            f"({len(missing)} missing)"
        )
    ignored = [re.compile(p) for p in model.ignored_checkpoint_tensors]
    used = set(sources.values())
    unexpected = [
        name
        for name in index
        if name not in used and name not in aliases and not any(p.search(name) for p in ignored)
    ]
    if unexpected:
        raise UnexpectedTensorError(
            f"checkpoint in {model_dir} has tensors the {model.config.architecture} model does "
            f"not take: {_names(unexpected)} ({len(unexpected)} unexpected)"
        )
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, source in sources.items():
        by_file[index[source]].append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    target = targets[name]
                    shape = tuple(f.get_slice(sources[name]).get_shape())
                    if shape != tuple(target.shape):
                        raise TensorShapeError(
                            f"tensor {sources[name]!r} in {path.name}: expected shape "
                            f"{tuple(target.shape)}, got {shape}"
                        )
                    target.copy_(f.get_tensor(sources[name]))


def _load_targets(model: HybridCausalLM) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name → tensor to fill, for each parameter and persistent buffer once;
    alias name → canonical name, for tied parameters)."""
    targets: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in first_name:
            aliases[name] = first_name[key]
            continue
        first_name[key] = name
        targets[name] = tensor
    return targets, aliases


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_NAMES_IN_MESSAGE])
    return shown + (", ..." if len(names) > _MAX_NAMES_IN_MESSAGE else "")
