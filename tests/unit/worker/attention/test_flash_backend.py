"""The flash backend on CPU: block tables, the LSE sink correction, MiMo's strided V view and the
kernel call, with vllm-flash-attn replaced by a stand-in of the same signature
(`fake_flash_attn`) that enforces the kernel's checks and computes from the paged cache."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from attention_scenario import Scenario, Shape, dense_reference, make_layers, make_memory
from fake_flash_attn import FakeFlashAttn, kernel_api

from swaserve.worker.attention import FlashAttentionBackend
from swaserve.worker.attention.flash_backend import (
    adapt_varlen,
    apply_sinks,
    load_flash_kernel,
    paged_kv,
)

# Mixed steps over longer sequences, so that block tables span several 16-token blocks and SWA
# windows (W = 5) start inside a block: prefills, decodes, a chunk after a cached prefix.
STEPS = [
    {0: 20, 1: 3, 2: 1},
    {0: 1, 1: 17, 2: 1, 3: 33},
    {3: 4, 0: 1, 1: 1, 2: 18},
    {0: 1, 1: 1, 2: 1, 3: 1},
    {2: 12, 3: 1, 0: 1, 1: 1},
]
WINDOW = 5
SHAPES = {
    "gqa": Shape(4, 2, 2, 8, 8),
    "mimo": Shape(8, 1, 2, 12, 8),  # SWA layers have more KV heads; K dim > V dim (192 / 128)
    "v_wider": Shape(2, 2, 2, 4, 6),
}


def build(
    shape: Shape, *, page_size: int, single_pool: bool, api: str = "2.6"
) -> tuple[Scenario, FakeFlashAttn, FlashAttentionBackend]:
    layers = make_layers(shape, WINDOW, "FSS")
    memory = make_memory(
        layers, WINDOW, page_size=page_size, single_pool=single_pool, full_tokens=512
    )
    fake = FakeFlashAttn()
    backend = FlashAttentionBackend(memory.kv_pool, WINDOW, kernel=kernel_api(fake, api))
    sc = Scenario(backend, memory, layers, sinks=True)
    for rid in range(4):
        sc.add_request(rid, 64)
    return sc, fake, backend


@pytest.mark.parametrize("api", ["2.6", "newer"])
@pytest.mark.parametrize("page_size", [1, 4, 16, 32])
@pytest.mark.parametrize("single_pool", [False, True], ids=["two_pools", "one_pool"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_backend_matches_the_dense_reference_through_the_kernel(
    api: str, page_size: int, single_pool: bool, shape: Shape
) -> None:
    """Through both API generations of the kernel's signature: outputs equal the dense
    reference while unused pool rows hold NaN, and the kernel reads the pool in place (a block
    table over 16-token blocks) exactly when the page size is a multiple of 16 and V is not
    wider than K — MiMo's K dim > V dim included."""
    sc, fake, backend = build(shape, page_size=page_size, single_pool=single_pool, api=api)
    paged = page_size % 16 == 0 and shape.v_head_dim <= shape.head_dim
    assert backend.paged == paged
    for extends in STEPS:
        prefix = {r: sc.requests[r].cached for r in extends}
        outs = sc.step(extends)
        for rid, n in extends.items():
            for layer in sc.layers:
                want = sc.expected(rid, layer, prefix[rid], prefix[rid] + n)
                got = outs[rid][layer.layer_id]
                torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)
        if not single_pool:
            sc.free_out_of_window(WINDOW)
        sc.poison_unused_rows()
    assert {c.paged for c in fake.calls} == {paged}
    assert {c.window for c in fake.calls} == {(-1, -1), (WINDOW, 0)}
    assert {c.seqused_k for c in fake.calls} == {api == "newer" and paged}
    # Paged, the kernel gets V at K's head dim through the strided view: no padded copy.
    assert {c.head_dim for c in fake.calls} == {max(shape.head_dim, shape.v_head_dim)}


def test_the_block_table_lists_16_token_blocks_of_the_pool() -> None:
    """P = 32: request 3 holds two full-pool pages; its table lists their 16-token blocks (less
    the skipped padding block), and an SWA window starting inside a block starts there."""
    sc, _, backend = build(SHAPES["gqa"], page_size=32, single_pool=False)
    sc.step({3: 40})
    batch = sc.batch({3: 1})
    backend.init_forward_metadata(batch)
    meta = batch.attn_metadata
    pages = sc.requests[3].slots[::32] // 32  # [2] full-pool pages of request 3
    blocks = (torch.stack([2 * pages, 2 * pages + 1], 1).flatten() - 1).tolist()
    assert meta.full.block_table.tolist() == [blocks[:3]]  # 41 keys: 3 blocks
    assert (meta.full.seqused_k.tolist(), meta.full.max_seqlen_k) == ([41], 41)
    assert meta.full.cu_seqlens_k.tolist() == [0, 41]
    window_start = 40 - WINDOW  # position 35, inside the block [32, 48)
    swa_slot = int(sc.memory.allocator.translate(sc.requests[3].slots[window_start]))
    assert meta.swa.block_table.tolist() == [[swa_slot // 16 - 1]]
    assert (meta.swa.seqused_k.tolist(), meta.swa.max_seqlen_k) == ([41 - 32], 9)
    assert meta.cu_seqlens_q.tolist() == [0, 1] and meta.max_seqlen_q == 1


def test_mimo_values_are_a_strided_view_of_the_pool() -> None:
    """K dim 12 > V dim 8: the kernel's V block b, columns [4, 12), is V of pool rows
    [(b + 1)·16, (b + 2)·16); the view shares the pool's memory."""
    k_buf = torch.randn(64, 2, 12)  # [rows, Hkv, Dk]
    v_buf = torch.randn(64, 2, 8)  # [rows, Hkv, Dv]
    view = paged_kv(k_buf, v_buf)
    assert view is not None and view.v_column == 4
    assert view.values.shape == view.keys.shape == (3, 16, 2, 12)
    assert view.values.untyped_storage().data_ptr() == v_buf.untyped_storage().data_ptr()
    assert torch.equal(view.values[:, :, :, 4:].reshape(48, 2, 8), v_buf[16:])
    assert torch.equal(view.keys.reshape(48, 2, 12), k_buf[16:])
    assert paged_kv(k_buf[:, :, :6], v_buf) is None  # V wider than K
    assert paged_kv(k_buf[:16], v_buf[:16]) is None  # no block after the padding one


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
