"""The C++ decode-attention kernel of the compiled CPU step (`cpu_kernels`): built with this
machine's compiler, equal to the gathered attention and to the loops it replaces, with clear
errors; a failed build leaves the loops in place."""

from __future__ import annotations

import logging

import pytest
import torch

from swaserve.worker.attention import cpu_kernels
from swaserve.worker.attention.sdpa import attention, decode_attention_loops


@pytest.fixture(scope="module")
def kernel():
    op = cpu_kernels.load()
    assert op is not None, "the kernel did not build (see the warning logged)"
    assert cpu_kernels.decode_attention_op() is op
    return op


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "dk", "dv", "width"),
    [
        (4, 6, 2, 12, 8, 7),  # GQA, Dk > Dv
        (3, 6, 6, 8, 12, 40),  # MHA, Dk < Dv, wider than a vector
        (2, 4, 1, 64, 64, 1),  # MQA, one key
        (5, 4, 2, 64, 64, 192),  # the decode bench's GPT-OSS shape
        (1, 4, 2, 192, 128, 33),  # MiMo-V2-Flash's head sizes, one request
        (2, 8, 2, 128, 16, 50),  # four query heads a KV head, the widest unrolled Dk
    ],
)
def test_kernel_equals_the_gathered_attention_and_the_loops(
    kernel, sinks: bool, batch: int, heads: int, kv_heads: int, dk: int, dv: int, width: int
) -> None:
    gen = torch.Generator().manual_seed(width)
    rows = 300
    k_buf = torch.randn(rows, kv_heads, dk, generator=gen)
    v_buf = torch.randn(rows, kv_heads, dv, generator=gen)
    q = torch.randn(batch, heads, dk, generator=gen)
    slots = torch.randint(0, rows, (batch, width), generator=gen)
    seen = torch.randint(1, width + 1, (batch,), generator=gen)  # keys each query sees
    bias = torch.zeros(batch, width).masked_fill_(torch.arange(width) >= seen[:, None], -torch.inf)
    sink = torch.randn(heads, generator=gen) if sinks else None
    want = attention(q[:, None], k_buf[slots], v_buf[slots], bias[:, None], 0.3, sink, fused=False)[
        :, 0
    ]
    got = kernel(q, k_buf, v_buf, slots, bias, 0.3, sink)
    assert got.shape == (batch, heads, dv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    loops = decode_attention_loops(q, k_buf, v_buf, slots, bias, 0.3, sink)
    torch.testing.assert_close(got, loops, rtol=1e-5, atol=1e-5)


def test_kernel_errors_are_clear(kernel) -> None:
    k_buf, v_buf = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    q, bias = torch.randn(2, 4, 8), torch.zeros(2, 3)
    slots = torch.tensor([[0, 1, 2], [3, 4, 10]])
    with pytest.raises(RuntimeError, match="a slot is outside the pool: 10"):
        kernel(q, k_buf, v_buf, slots, bias, 1.0, None)
    slots[1, 2] = 5
    with pytest.raises(RuntimeError, match="must be float32"):
        kernel(q.double(), k_buf, v_buf, slots, bias, 1.0, None)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kernel(torch.randn(2, 3, 8), k_buf, v_buf, slots, bias, 1.0, None)
    with pytest.raises(RuntimeError, match="sinks must be"):
        kernel(q, k_buf, v_buf, slots, bias, 1.0, torch.zeros(3))


def test_a_failed_build_leaves_the_loops(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(cpu_kernels, "_state", {})
    with caplog.at_level(logging.WARNING, logger="swaserve.worker.attention.cpu_kernels"):
        assert cpu_kernels.load() is None
    assert "did not build (no C++ compiler): using loops" in caplog.text
    assert cpu_kernels.decode_attention_op() is None
    assert cpu_kernels.load() is None  # tried once per process


def test_the_build_flags_are_kept_per_cpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    probes: list[str] = []
    cpu = {"id": "cpu-a"}
    monkeypatch.setattr(cpu_kernels, "build_flags", lambda: probes.append(cpu["id"]) or ["-DX"])
    monkeypatch.setattr(cpu_kernels, "_cpu_fingerprint", lambda: cpu["id"])
    assert cpu_kernels.cached_build_flags(tmp_path) == ["-DX"]
    assert cpu_kernels.cached_build_flags(tmp_path) == ["-DX"]
    assert probes == ["cpu-a"]  # the second start read the record
    cpu["id"] = "cpu-b"  # a cache directory shared with another machine: probe again
    assert cpu_kernels.cached_build_flags(tmp_path) == ["-DX"]
    assert probes == ["cpu-a", "cpu-b"]
    (tmp_path / "flags.json").write_text("{not json")
    assert cpu_kernels.cached_build_flags(tmp_path) == ["-DX"]
    assert probes == ["cpu-a", "cpu-b", "cpu-b"]
    assert list(tmp_path.iterdir()) == [tmp_path / "flags.json"]  # no temporary file left


def test_the_cpu_fingerprint_is_stable() -> None:
    assert cpu_kernels._cpu_fingerprint() == cpu_kernels._cpu_fingerprint()
