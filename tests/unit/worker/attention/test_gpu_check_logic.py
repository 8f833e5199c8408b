"""bench/gpu_check.py's flash checks, run on CPU with the kernel faked (`fake_flash_attn`, bf16
accepted), so that what the GPU machine will run is known to work and to fail: the attention and
logits checks pass, and a flash backend that takes MiMo's V from the wrong columns fails both on
the paged path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from fake_flash_attn import FakeFlashAttn

from swaserve.worker.attention import flash_backend
from swaserve.worker.runner import model_runner as model_runner_module

BENCH = Path(__file__).resolve().parents[4] / "bench" / "gpu_check.py"


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script's module, its flash backend on the fake kernel, its engines on the CPU."""
    spec = importlib.util.spec_from_file_location("bench_gpu_check", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    fake = FakeFlashAttn()
    monkeypatch.setattr(
        flash_backend, "load_flash_kernel", lambda: flash_backend.adapt_varlen(fake.v2_6)
    )
    real_engine = module.make_engine

    def cpu_engine(model_dir: Path, device: str, backend: str, page_size: int, **extra: object):
        # EngineConfig refuses "flash" on CPU: build a "torch" engine whose runner gets flash.
        classes = {"flash": flash_backend.FlashAttentionBackend}
        real_select = model_runner_module.select_backend
        with monkeypatch.context() as patch:
            patch.setattr(
                model_runner_module,
                "select_backend",
                lambda dev, name, dtype=None: (
                    classes.get(backend) or real_select(dev, name, dtype=dtype)
                ),
            )
            return real_engine(model_dir, device, "torch", page_size, **extra)

    monkeypatch.setattr(module, "make_engine", cpu_engine)
    return module


def test_the_flash_checks_pass(gpu_check: ModuleType, tmp_path: Path) -> None:
    results = gpu_check.check_attention(tmp_path, "cpu") + gpu_check.check_logits(tmp_path, "cpu")
    assert [r.status for r in results] == ["pass"] * 12, "\n".join(r.line() for r in results)
    assert {r.case for r in results if r.check == "logits"} == {
        f"{arch} P={p} ({'paged' if p == 16 else 'gathered'})"
        for arch in ("gpt-oss", "mimo-v2-flash", "llama4", "gemma4")
        for p in (1, 16)
    }


def test_the_flash_checks_fail_on_a_broken_value_view(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = flash_backend.paged_kv

    def wrong_columns(k_buf: torch.Tensor, v_buf: torch.Tensor) -> flash_backend.PagedKV | None:
        view = real(k_buf, v_buf)
        return None if view is None else flash_backend.PagedKV(view.keys, view.values, 0)

    monkeypatch.setattr(flash_backend, "paged_kv", wrong_columns)
    monkeypatch.setattr(gpu_check, "ARCHS", ("mimo-v2-flash",))
    monkeypatch.setattr(gpu_check, "FAMILY_MODELS", {})
    monkeypatch.setattr(gpu_check, "ATTN_SHAPES", {"mimo dims": gpu_check.ATTN_SHAPES["mimo dims"]})
    results = gpu_check.check_attention(tmp_path, "cpu") + gpu_check.check_logits(tmp_path, "cpu")
    status = {(r.check, r.case): r.status for r in results}
    assert status == {
        ("attn", "mimo dims P=1 (gathered)"): "pass",
        ("attn", "mimo dims P=16 (paged)"): "fail",
        ("logits", "mimo-v2-flash P=1 (gathered)"): "pass",
        ("logits", "mimo-v2-flash P=16 (paged)"): "fail",
    }
