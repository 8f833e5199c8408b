"""Test helpers that edit or inspect a single-file model checkpoint and a loaded model."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from swaserve.worker.models.loader import SINGLE_FILE


def edit_checkpoint(model_dir: Path, changes: dict[str, torch.Tensor | None]) -> None:
    """Replace or add (tensor) or drop (None) checkpoint entries by name."""
    path = model_dir / SINGLE_FILE
    tensors = load_file(path)
    for name, tensor in changes.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, path, metadata={"format": "pt"})


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}
