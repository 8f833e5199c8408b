from __future__ import annotations

import pytest
import torch

from swaserve.worker.attention import (
    ATTENTION_BACKENDS,
    FlashAttentionBackend,
    TorchAttentionBackend,
    backend_class,
    select_backend,
)
from swaserve.worker.attention import registry as registry_module


def test_names_map_to_classes() -> None:
    assert dict(ATTENTION_BACKENDS) == {
        "torch": TorchAttentionBackend,
        "flash": FlashAttentionBackend,
    }
    assert backend_class("torch") is TorchAttentionBackend
    assert backend_class("flash") is FlashAttentionBackend
    assert TorchAttentionBackend.name == "torch" and FlashAttentionBackend.name == "flash"


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(
        ValueError, match=r"unknown attention backend 'triton'; .*'auto', 'torch', 'flash'"
    ):
        backend_class("triton")
    with pytest.raises(ValueError, match="unknown attention backend 'triton'"):
        select_backend("cpu", "triton")


def test_cpu_always_gets_torch() -> None:
    assert select_backend("cpu") is TorchAttentionBackend
    assert select_backend(torch.device("cpu"), "torch") is TorchAttentionBackend
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        select_backend("cpu", "flash")


@pytest.mark.parametrize("installed", [True, False])
def test_cuda_gets_flash_only_when_vllm_flash_attn_imports(
    monkeypatch: pytest.MonkeyPatch, installed: bool
) -> None:
    monkeypatch.setattr(registry_module, "flash_attn_available", lambda: installed)
    expected = FlashAttentionBackend if installed else TorchAttentionBackend
    assert select_backend("cuda") is expected
    assert select_backend("cuda:1", dtype=torch.bfloat16) is expected
    # flash-attn has no float32 kernels: auto falls back to torch.
    assert select_backend("cuda", dtype=torch.float32) is TorchAttentionBackend
    assert select_backend("cuda", "torch") is TorchAttentionBackend
    if installed:
        assert select_backend("cuda", "flash") is FlashAttentionBackend
    else:
        with pytest.raises(ValueError, match=r"needs vllm-flash-attn \(pip install"):
            select_backend("cuda", "flash")


def test_flash_availability_is_probed_by_import(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str) -> None:
        raise OSError(f"{name}: libcudart.so not found")

    monkeypatch.setattr(registry_module.importlib, "import_module", broken)
    assert registry_module.flash_attn_available() is False
