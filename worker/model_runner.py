"""ModelRunner: device and dtype, the KV memory, the attention backend and the model; turns a
scheduled batch into logits. It never decides policy."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from swaserve.worker.attention.base import ForwardBatch
from swaserve.worker.attention.registry import select_backend
from swaserve.worker.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from swaserve.worker.kv.memory import KVMemory, build_kv_memory
from swaserve.worker.models.config import ModelConfig, load_model_config
from swaserve.worker.models.loader import load_model
from swaserve.worker.scheduler import ScheduledBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def checkpoint_numel(model_dir: str | Path) -> int:
    """Number of weight elements (from the safetensors headers), to size the KV budget on CUDA."""
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        for name, meta in header.items():
            if name != "__metadata__":
                numel = 1
                for dim in meta["shape"]:
                    numel *= dim
                total += numel
    return total


class ModelRunner:
    """Loads the model on its device with its KV memory, and runs forward passes."""

    def __init__(self, config: EngineConfig) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config: ModelConfig = load_model_config(config.model)
        spec = self.model_config.kv_spec()
        kv_config = config.kv_memory_config(kv_cache_bytes=self._default_kv_bytes(config))
        self.memory: KVMemory = build_kv_memory(
            spec, kv_config, dtype=self.dtype, device=self.device
        )
        backend_cls = select_backend(self.device, config.attention_backend, dtype=self.dtype)
        self.backend = backend_cls(self.memory, self.model_config.sliding_window_size)  # type: ignore[call-arg]
        self.model = load_model(config.model, self.backend, dtype=self.dtype, device=self.device)

    def _default_kv_bytes(self, config: EngineConfig) -> int | None:
        if config.kv_cache_bytes is not None or config.max_total_tokens is not None:
            return None
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        free_bytes, _ = torch.cuda.mem_get_info(self.device)
        weights = checkpoint_numel(config.model) * torch.empty((), dtype=self.dtype).element_size()
        budget = int((free_bytes - weights) * config.mem_fraction_static)
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache: {free_bytes} B free, weights ≈ {weights} B"
            )
        return budget

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> torch.Tensor:  # [B, vocab] float32
        """Logits of the last computed token of every request in the batch."""
        device = self.device
        input_ids, positions, slots = [], [], []
        for req, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True):
            input_ids.extend(req.token_slice(start, start + n))
            positions.append(torch.arange(start, start + n))
            slots.append(req.slots[: start + n].to(device))
        prefix = torch.tensor(batch.prefix_lens)  # [B] int64
        fwd = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),  # [T] int64
            positions=torch.cat(positions).to(device),  # [T] int64
            prefix_lens=prefix,
            seq_lens=prefix + torch.tensor(batch.extend_lens),
            req_token_slots=slots,
            out_full_loc=batch.out_full_loc.to(device),
            logits_positions="last",
        )
        return self.model(fwd).float()
