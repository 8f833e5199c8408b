"""`Checkpoint`: the safetensors files of an HF model dir, `model.safetensors` or shards listed
by `model.safetensors.index.json`. Headers are read and checked up front (names, dtypes, shapes,
and that each file holds every byte its header promises), so that the loader can check the
whole checkpoint before it reads any data; tensors are then read one at a time (memory-mapped),
whole, one leading index at a time, or as a slice (a TP rank reads only its shard).
"""

from __future__ import annotations

import json
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from swaserve.worker.models.errors import CheckpointFileError, WeightLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_HEADER_LENGTH_BYTES = 8


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's header entry."""

    name: str
    path: Path
    dtype: str  # safetensors' name: "F32", "BF16", "F8_E4M3", "U8", ...
    shape: tuple[int, ...]
    num_bytes: int


class Checkpoint:
    """Tensor name → header entry over all files of one model dir; `open()` before `read`."""

    def __init__(self, model_dir: str | Path) -> None:
        self.root = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path, names in _files(self.root).items():
            header = read_header(path)
            for name in names if names is not None else sorted(header):
                if name not in header:
                    raise WeightLoadError(
                        f"{INDEX_FILE} puts {name!r} in {path.name}, which lacks it"
                    )
                self.tensors[name] = header[name]
        self._stack: ExitStack | None = None
        self._handles: dict[Path, Any] = {}

    @property
    def files(self) -> list[Path]:
        return sorted({info.path for info in self.tensors.values()})

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __enter__(self) -> Checkpoint:
        self._stack = ExitStack()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack, self._handles = None, {}

    def read(self, name: str, index: int | tuple[int | slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name`, as stored: whole, or `tensor[index]` read as a safetensors slice (an
        int: one row along dim 0; a tuple of ints and slices). Within `with checkpoint:`."""
        info = self.tensors[name]
        handle = self._handle(info.path)
        try:
            if index is None:
                return handle.get_tensor(name)
            return handle.get_slice(name)[index]
        except SafetensorError as exc:
            raise CheckpointFileError(
                f"cannot read tensor {name!r} from {info.path}: {exc}"
            ) from exc

    def _handle(self, path: Path) -> Any:
        if self._stack is None:
            raise RuntimeError("open the checkpoint with `with checkpoint:` before reading")
        if path not in self._handles:
            try:
                self._handles[path] = self._stack.enter_context(
                    safe_open(str(path), framework="pt")
                )
            except SafetensorError as exc:
                raise CheckpointFileError(f"cannot open {path}: {exc}") from exc
        return self._handles[path]


def _files(root: Path) -> dict[Path, list[str] | None]:
    """File → the tensor names the index puts there (None: all of a single file's)."""
    index_path = root / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            names_by_file: dict[Path, list[str]] = {}
            for name, shard in weight_map.items():
                names_by_file.setdefault(root / shard, []).append(name)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise WeightLoadError(f"cannot read the weight_map of {index_path}: {exc}") from exc
        for shard in sorted(names_by_file):
            if not shard.is_file():
                raise WeightLoadError(f"{index_path} names shard {shard.name}, which is missing")
        return dict(names_by_file)
    single = root / SINGLE_FILE
    if not single.is_file():
        raise WeightLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")
    return {single: None}


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, checked against the file's size: a file cut short
    raises `CheckpointFileError` naming the first tensor whose bytes are missing."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            prefix = f.read(_HEADER_LENGTH_BYTES)
            if len(prefix) < _HEADER_LENGTH_BYTES:
                raise CheckpointFileError(
                    f"{path} is truncated: {size} bytes, no safetensors header"
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if _HEADER_LENGTH_BYTES + header_len > size:
                raise CheckpointFileError(
                    f"{path} is truncated: its header needs {header_len} bytes, the file has {size}"
                )
            header = json.loads(f.read(header_len))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFileError(f"cannot read the safetensors header of {path}: {exc}") from exc
    data_start = _HEADER_LENGTH_BYTES + header_len
    tensors: dict[str, TensorInfo] = {}
    entries = sorted(
        ((n, e) for n, e in header.items() if n != "__metadata__"),
        key=lambda item: item[1]["data_offsets"][1],
    )
    for name, entry in entries:
        begin, end = entry["data_offsets"]
        if data_start + end > size:
            raise CheckpointFileError(
                f"{path} is truncated: tensor {name!r} needs bytes [{data_start + begin}, "
                f"{data_start + end}) but the file has {size}"
            )
        tensors[name] = TensorInfo(name, path, entry["dtype"], tuple(entry["shape"]), end - begin)
    return tensors
