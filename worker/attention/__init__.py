"""Attention backends: the interface, the per-batch metadata, a torch backend (CPU, and the CUDA
fallback) and a vllm-flash-attn backend (CUDA, imported lazily), chosen by `select_backend`."""

from swaserve.worker.attention.base import AttentionBackend, AttentionLayer, ForwardBatch
from swaserve.worker.attention.flash_backend import FlashAttentionBackend
from swaserve.worker.attention.metadata import (
    AttentionMetadata,
    KVReads,
    MissingSWAKV,
    build_attention_metadata,
)
from swaserve.worker.attention.registry import (
    ATTENTION_BACKENDS,
    backend_class,
    flash_attn_available,
    select_backend,
)
from swaserve.worker.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionLayer",
    "AttentionMetadata",
    "FlashAttentionBackend",
    "ForwardBatch",
    "KVReads",
    "MissingSWAKV",
    "TorchAttentionBackend",
    "backend_class",
    "build_attention_metadata",
    "flash_attn_available",
    "select_backend",
]
