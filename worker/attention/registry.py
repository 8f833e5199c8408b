"""Attention backends by name, and the choice for a device.

"flash" (vllm-flash-attn) only on CUDA with the package importable and float16 / bfloat16 KV;
"torch" everywhere else — on CPU, and as the fallback on CUDA without vllm-flash-attn. The flash
backend reads the pool in place (paged) when the page size is a multiple of 16
(`flash_backend.BLOCK_TOKENS`), and gathers each layer's K/V otherwise: serve with
`page_size=16` on CUDA.
"""

from __future__ import annotations

import importlib

import torch

from swaserve.worker.attention.base import AttentionBackend
from swaserve.worker.attention.flash_backend import FLASH_DTYPES, FlashAttentionBackend
from swaserve.worker.attention.torch_backend import TorchAttentionBackend

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "flash": FlashAttentionBackend,
}
AUTO = "auto"


def flash_attn_available() -> bool:
    """Whether vllm_flash_attn imports (it needs a CUDA build of torch)."""
    try:
        importlib.import_module("vllm_flash_attn")
    except Exception:  # a broken CUDA install raises more than ImportError
        return False
    return True


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend registered as `name`; ValueError listing the choices otherwise."""
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        choices = ", ".join(repr(n) for n in [AUTO, *ATTENTION_BACKENDS])
        raise ValueError(f"unknown attention backend {name!r}; choose one of {choices}") from None


def select_backend(
    device: str | torch.device, name: str = AUTO, *, dtype: torch.dtype | None = None
) -> type[AttentionBackend]:
    """The backend class for `device`. `"auto"`: flash on CUDA when vllm-flash-attn imports (and
    `dtype`, if given, is float16 / bfloat16), else torch. An explicit name is honoured, except
    "flash" where it cannot run, which raises with the reason."""
    device = torch.device(device)
    if name != AUTO:
        cls = backend_class(name)
        if cls is FlashAttentionBackend:
            if device.type != "cuda":
                raise ValueError(f"the 'flash' attention backend needs a CUDA device, got {device}")
            if not flash_attn_available():
                raise ValueError(
                    "the 'flash' attention backend needs vllm-flash-attn "
                    "(pip install 'swaserve[gpu]'); use 'torch' or 'auto'"
                )
        return cls
    usable_dtype = dtype is None or dtype in FLASH_DTYPES
    if device.type == "cuda" and usable_dtype and flash_attn_available():
        return FlashAttentionBackend
    return TorchAttentionBackend
