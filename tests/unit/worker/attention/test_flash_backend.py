"""The flash backend's pure-torch parts on CPU: block tables, the LSE sink correction, V padding and
the kernel call, with vllm-flash-attn replaced by a torch emulation of its documented semantics."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from attention_scenario import Scenario, Shape, dense_reference, make_layers, make_memory

from swaserve.worker.attention import FlashAttentionBackend
from swaserve.worker.attention.flash_backend import adapt_varlen, apply_sinks, load_flash_kernel

STEPS = [
    {0: 7, 1: 3, 2: 1},
    {0: 1, 1: 5, 2: 1, 3: 9},
    {3: 4, 0: 1, 1: 1, 2: 6},
    {0: 1, 1: 1, 2: 1, 3: 1},
]


class FakeVarlen:
    """flash_attn_varlen_func's contract in torch (the VarlenKernel convention): bottom-right
    causal, window (left, 0), GQA, paged K/V through a block table, lse [H, T]. Records calls."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens_q: torch.Tensor,
        max_seqlen_q: int,
        cu_seqlens_k: torch.Tensor,
        seqused_k: torch.Tensor | None,
        max_seqlen_k: int,
        softmax_scale: float,
        window_size: tuple[int, int],
        block_table: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "the kernel wants one head dim"
        assert q.dtype == k.dtype == v.dtype
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        self.calls.append({"paged": block_table is not None, "window": window_size})
        outs, lses = [], []
        for i in range(cu_seqlens_q.numel() - 1):
            qi = q[int(cu_seqlens_q[i]) : int(cu_seqlens_q[i + 1])]  # [m, H, D]
            if block_table is not None:
                assert seqused_k is not None and block_table.dtype == torch.int32
                n, page = int(seqused_k[i]), k.shape[1]
                assert int(cu_seqlens_k[i + 1] - cu_seqlens_k[i]) == n
                pages = block_table[i, : -(-n // page)].long()
                ki = k[pages].flatten(0, 1)[:n]  # [n, Hkv, D]
                vi = v[pages].flatten(0, 1)[:n]
            else:
                ki = k[int(cu_seqlens_k[i]) : int(cu_seqlens_k[i + 1])]
                vi = v[int(cu_seqlens_k[i]) : int(cu_seqlens_k[i + 1])]
            m, n = qi.shape[0], ki.shape[0]
            assert m <= max_seqlen_q and n <= max_seqlen_k
            group = qi.shape[1] // ki.shape[1]
            ki, vi = ki.repeat_interleave(group, 1), vi.repeat_interleave(group, 1)
            scores = torch.einsum("mhd,nhd->hmn", qi.double(), ki.double()) * softmax_scale
            row = torch.arange(m)[:, None] + n - m  # query i aligned to the bottom right
            col = torch.arange(n)[None, :]
            hidden = col > row
            if window_size[0] >= 0:
                hidden |= col < row - window_size[0]
            scores = scores.masked_fill(hidden, float("-inf"))
            lse = torch.logsumexp(scores, -1)  # [H, m]
            probs = torch.exp(scores - lse[..., None])
            outs.append(torch.einsum("hmn,nhd->mhd", probs, vi.double()).to(q.dtype))
            lses.append(lse.float())
        return torch.cat(outs), torch.cat(lses, dim=1)


def build(
    shape: Shape, window: int, *, page_size: int, single_pool: bool
) -> tuple[Scenario, FakeVarlen]:
    layers = make_layers(shape, window, "FSS")
    memory = make_memory(layers, window, page_size=page_size, single_pool=single_pool)
    kernel = FakeVarlen()
    backend = FlashAttentionBackend(memory.kv_pool, window, kernel=kernel)
    sc = Scenario(backend, memory, layers, sinks=True)
    for rid in range(4):
        sc.add_request(rid, 32)
    return sc, kernel


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "gathered"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("single_pool", [False, True], ids=["two_pools", "one_pool"])
@pytest.mark.parametrize(
    "shape",
    [Shape(4, 2, 2, 8, 8), Shape(8, 1, 2, 12, 8)],  # GQA, MiMo-like (K dim > V dim)
    ids=["gqa", "mimo"],
)
def test_backend_matches_the_dense_reference_through_the_kernel_contract(
    monkeypatch: pytest.MonkeyPatch, paged: bool, page_size: int, single_pool: bool, shape: Shape
) -> None:
    monkeypatch.setattr(FlashAttentionBackend, "PAGED_PAGE_SIZE_MULTIPLE", 1 if paged else 64)
    window = 2
    sc, kernel = build(shape, window, page_size=page_size, single_pool=single_pool)
    for extends in STEPS:
        prefix = {r: sc.requests[r].cached for r in extends}
        outs = sc.step(extends)
        for rid, n in extends.items():
            for layer in sc.layers:
                want = sc.expected(rid, layer, prefix[rid], prefix[rid] + n)
                got = outs[rid][layer.layer_id]
                torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)
        if not single_pool:
            sc.free_out_of_window(window)
        sc.poison_unused_rows()
    # Equal K/V dims go through the block table when the page size allows it; MiMo's never do.
    assert {c["paged"] for c in kernel.calls} == {paged and shape.head_dim == shape.v_head_dim}
    assert {c["window"] for c in kernel.calls} == {(-1, -1), (window, 0)}


def test_lse_sink_correction_equals_the_sink_softmax() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 6, 8, generator=gen, dtype=torch.float64)  # [E, H, Dk]
    k = torch.randn(9, 3, 8, generator=gen, dtype=torch.float64)  # [S, Hkv, Dk]
    v = torch.randn(9, 3, 4, generator=gen, dtype=torch.float64)  # [S, Hkv, Dv]
    sinks = torch.randn(6, generator=gen, dtype=torch.float64)
    prefix, window, scale = 4, 2, 0.35
    plain = dense_reference(q, k, v, prefix, window, scale, None)  # [E, H, Dv]
    # The lse flash-attn returns: logsumexp of the masked, scaled scores, laid out [H, E].
    logits = torch.einsum("ehd,shd->hes", q, k.repeat_interleave(2, 1)) * scale
    q_pos, k_pos = torch.arange(prefix, 9)[:, None], torch.arange(9)[None, :]
    logits = logits.masked_fill((k_pos > q_pos) | (k_pos < q_pos - window), float("-inf"))
    lse = torch.logsumexp(logits, -1)  # [H, E]
    got = apply_sinks(plain, lse, sinks)
    want = dense_reference(q, k, v, prefix, window, scale, sinks)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match=r"lse of shape \(5, 6\), expected \(6, 5\)"):
        apply_sinks(plain, lse.t(), sinks)


def api_262(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
            causal=False, window_size=(-1, -1), return_attn_probs=False, block_table=None):  # fmt: skip
    """vllm-flash-attn 2.6.2's flash_attn_varlen_func (the parameters we use); hands back its
    arguments in place of the lse."""
    args = dict(locals())
    return q, {name: args[name] for name in args if name not in ("q", "k", "v")}, None


def api_newer(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
              seqused_k=None, softmax_scale=None, causal=False, window_size=None,
              block_table=None, return_softmax_lse=False):  # fmt: skip
    """Later releases: seqused_k with a block table, and return_softmax_lse."""
    args = dict(locals())
    return q, {name: args[name] for name in args if name not in ("q", "k", "v")}


def test_adapt_varlen_speaks_both_api_generations() -> None:
    x = torch.zeros(2, 1, 4)
    cu_q = torch.tensor([0, 2], dtype=torch.int32)
    cu_k = torch.tensor([0, 5], dtype=torch.int32)
    seqused = torch.tensor([5], dtype=torch.int32)
    table = torch.zeros(1, 2, dtype=torch.int32)

    def call(fn: Any, block_table: torch.Tensor | None) -> dict[str, Any]:
        out, args = adapt_varlen(fn)(
            x, x, x, cu_seqlens_q=cu_q, max_seqlen_q=2, cu_seqlens_k=cu_k, seqused_k=seqused,
            max_seqlen_k=5, softmax_scale=0.5, window_size=(3, 0), block_table=block_table,
        )  # fmt: skip
        assert out is x
        return args

    common = dict(cu_seqlens_q=cu_q, max_seqlen_q=2, max_seqlen_k=5, softmax_scale=0.5,
                  causal=True, window_size=(3, 0))  # fmt: skip
    # 2.6.2: cu_seqlens_k in both modes (cumulative key counts), lse through return_attn_probs.
    for table_arg in (table, None):
        args = call(api_262, table_arg)
        assert args == {**common, "cu_seqlens_k": cu_k, "return_attn_probs": True,
                        "block_table": table_arg}  # fmt: skip
    # Newer: seqused_k with a block table, cu_seqlens_k without; lse through return_softmax_lse.
    args = call(api_newer, table)
    assert args == {**common, "cu_seqlens_k": None, "seqused_k": seqused,
                    "return_softmax_lse": True, "block_table": table}  # fmt: skip
    args = call(api_newer, None)
    assert args == {**common, "cu_seqlens_k": cu_k, "seqused_k": None,
                    "return_softmax_lse": True, "block_table": None}  # fmt: skip


def test_float32_kv_is_refused_without_an_injected_kernel() -> None:
    layers = make_layers(Shape(), 2, "FS")
    memory = make_memory(layers, 2, page_size=1, single_pool=False)
    with pytest.raises(ValueError, match=r"float16 or bfloat16 KV, the pool holds torch\.float32"):
        FlashAttentionBackend(memory.kv_pool, 2)


@pytest.mark.skipif(
    importlib.util.find_spec("vllm_flash_attn") is not None, reason="vllm-flash-attn installed"
)
def test_missing_vllm_flash_attn_is_a_clear_import_error() -> None:
    with pytest.raises(ImportError, match=r"pip install 'swaserve\[gpu\]'"):
        load_flash_kernel()
