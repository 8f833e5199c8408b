from __future__ import annotations

import pytest
import torch
from attention_scenario import Scenario, Shape, make_layers, make_memory

from swaserve.worker.attention import MissingSWAKV, TorchAttentionBackend, cpu_kernels
from swaserve.worker.attention import torch_backend as torch_backend_module
from swaserve.worker.attention.sdpa import attention, decode_attention_loops

# Steps of a mixed workload: prefills of different lengths, a one-token prefill, decodes, a
# prefill chunk after a cached prefix (R1's second and R2's third step), a new request joining.
STEPS = [
    {0: 7, 1: 3, 2: 1},
    {0: 1, 1: 5, 2: 1, 3: 9},
    {3: 4, 0: 1, 1: 1, 2: 6},
    {0: 1, 1: 1, 2: 1, 3: 1},
    {2: 1, 3: 1, 0: 1, 1: 1},
]
SHAPES = {
    "gqa": Shape(num_heads=4, full_kv_heads=2, swa_kv_heads=2, head_dim=8, v_head_dim=8),
    # MiMo-like: SWA layers have more KV heads than full ones, K dim > V dim (192 / 128 scaled).
    "mimo": Shape(num_heads=8, full_kv_heads=1, swa_kv_heads=2, head_dim=12, v_head_dim=8),
    "mha_v_wider": Shape(num_heads=2, full_kv_heads=2, swa_kv_heads=2, head_dim=4, v_head_dim=6),
}
TOL = {torch.float32: 2e-6, torch.float64: 1e-12}


def run_and_compare(
    sc: Scenario,
    steps: list[dict[int, int]],
    *,
    free_window: int | None = None,
    poison: bool = False,
) -> list[dict[int, dict[int, torch.Tensor]]]:
    """Run the steps; after each, optionally free out-of-window SWA KV and NaN-fill unused rows.
    Every output must match the dense reference."""
    tol = TOL[sc.dtype]
    results = []
    for extends in steps:
        prefix = {r: sc.requests[r].cached for r in extends}
        outs = sc.step(extends)
        for rid, n in extends.items():
            for layer in sc.layers:
                got = outs[rid][layer.layer_id]
                assert got.dtype == sc.dtype
                want = sc.expected(rid, layer, prefix[rid], prefix[rid] + n)
                torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        if free_window is not None:
            sc.free_out_of_window(free_window)
        if poison:
            sc.poison_unused_rows()
        results.append(outs)
    return results


def build(
    shape: Shape,
    window: int | None,
    *,
    page_size: int,
    single_pool: bool,
    sinks: bool,
    dtype: torch.dtype = torch.float32,
    kinds: str = "FSS",
) -> Scenario:
    layers = make_layers(shape, window, kinds)
    memory = make_memory(layers, window, page_size=page_size, single_pool=single_pool, dtype=dtype)
    sc = Scenario(
        TorchAttentionBackend(memory.kv_pool, window), memory, layers, sinks=sinks, dtype=dtype
    )
    for rid in range(4):
        sc.add_request(rid, 32)
    return sc


def without_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes take the gathered attention (as where the C++ kernel did not build)."""
    monkeypatch.setattr(cpu_kernels, "_state", {"op": None})


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gathered"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("single_pool", [False, True], ids=["two_pools", "one_pool"])
@pytest.mark.parametrize("window", [0, 1, 3, 64])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_mixed_batches_match_the_dense_reference(
    page_size: int,
    single_pool: bool,
    window: int,
    shape: str,
    kernel: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sc = build(
        SHAPES[shape], window, page_size=page_size, single_pool=single_pool, sinks=shape != "gqa"
    )
    if kernel:
        assert cpu_kernels.decode_attention_op() is not None  # the backend loaded it
    else:
        without_kernel(monkeypatch)
    run_and_compare(sc, STEPS, free_window=None if single_pool else window, poison=True)


@pytest.mark.parametrize("sinks", [False, True])
def test_a_decode_rows_attention_is_the_same_whatever_the_batch_holds(sinks: bool) -> None:
    """The CPU decodes' kernel computes each row alone: a row equals itself in any batch, any
    padding (what keeps a verified draft's row equal to the plain decode of its position)."""
    layers = make_layers(SHAPES["mimo"], 3, "F")
    memory = make_memory(layers, 3, page_size=4, single_pool=True)
    TorchAttentionBackend(memory.kv_pool, 3)
    assert cpu_kernels.decode_attention_op() is not None
    gen = torch.Generator().manual_seed(5)
    layer, rows = layers[0], 64
    k_buf = torch.randn(rows, 1, 12, generator=gen)
    v_buf = torch.randn(rows, 1, 8, generator=gen)
    q = torch.randn(9, 8, 12, generator=gen)
    slots = torch.randint(0, rows, (9, 40), generator=gen)
    seen = torch.randint(1, 41, (9,), generator=gen)
    bias = torch.zeros(9, 40).masked_fill_(torch.arange(40) >= seen[:, None], -torch.inf)
    sink = torch.randn(8, generator=gen) if sinks else None
    batch = torch_backend_module.decode_attention(q, k_buf, v_buf, slots, bias, layer, sink)
    for i in range(9):
        width = int(seen[i])  # alone, padded only to its own read
        alone = torch_backend_module.decode_attention(
            q[i : i + 1],
            k_buf,
            v_buf,
            slots[i : i + 1, :width],
            bias[i : i + 1, :width],
            layer,
            sink,
        )
        assert torch.equal(alone[0], batch[i])


@pytest.mark.parametrize("sinks", [False, True])
def test_matmul_path_in_float64_is_exact(sinks: bool) -> None:
    sc = build(SHAPES["mimo"], 3, page_size=4, single_pool=False, sinks=sinks, dtype=torch.float64)
    run_and_compare(sc, STEPS, free_window=3, poison=True)


def test_full_attention_only_model() -> None:
    layers = make_layers(SHAPES["gqa"], None, "FF")
    memory = make_memory(layers, None, page_size=4, single_pool=False)
    assert not memory.two_pools  # no SWA layers: one pool
    sc = Scenario(TorchAttentionBackend(memory.kv_pool, None), memory, layers, sinks=True)
    for rid in range(4):
        sc.add_request(rid, 32)
    run_and_compare(sc, STEPS, poison=True)


def test_query_tiles_and_decode_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tiny budget forces several query tiles per prefill and several decode groups.
    without_kernel(monkeypatch)
    monkeypatch.setattr(torch_backend_module, "SCORE_BUDGET_ELEMENTS", 64)
    assert torch_backend_module.query_tile(8, 9, 9, None) == 1
    assert torch_backend_module.query_tile(2, 9, 12, None) == 2  # 2 * 2 * 12 <= 64
    assert torch_backend_module.query_tile(2, 20, 23, 3) == 1  # keys capped at tile + W = 23
    monkeypatch.setattr(torch_backend_module, "QUERY_TILE_TOKENS", 4)
    assert torch_backend_module.query_tile(2, 20, 23, 3) == 4  # 2 * 4 * (4 + 3) <= 64
    for window, single_pool in ((2, False), (64, True)):
        sc = build(SHAPES["mimo"], window, page_size=4, single_pool=single_pool, sinks=True)
        run_and_compare(sc, STEPS, free_window=None if single_pool else window, poison=True)


@pytest.mark.parametrize("page_size", [1, 4])
def test_swa_reads_only_the_window(page_size: int) -> None:
    """Freed out-of-window SWA slots and every unused row hold NaN: outputs are bit-identical to
    a twin run on clean pools."""
    window = 2
    clean = build(SHAPES["mimo"], window, page_size=page_size, single_pool=False, sinks=True)
    dirty = build(SHAPES["mimo"], window, page_size=page_size, single_pool=False, sinks=True)
    alloc = dirty.memory.allocator
    swa_total = alloc.swa_available_size()  # type: ignore[union-attr]
    clean_out = run_and_compare(clean, STEPS)
    freed = 0
    for i, extends in enumerate(STEPS):
        dirty_out = dirty.step(extends)
        freed += dirty.free_out_of_window(window)
        dirty.poison_unused_rows()
        for rid in extends:
            for lid, got in dirty_out[rid].items():
                assert torch.isfinite(got).all()
                assert torch.equal(got, clean_out[i][rid][lid])
    # The SWA side really was freed: every request now holds about W + P SWA slots, not its length.
    assert freed > 0
    held = sum(r.cached for r in dirty.requests.values())
    assert swa_total - alloc.swa_available_size() < held  # type: ignore[union-attr]
    swa_k = dirty.memory.kv_pool.swa_pool.k_buffer[0]  # type: ignore[union-attr]
    assert torch.isnan(swa_k).any()


def test_a_missing_swa_slot_raises_before_any_layer_runs() -> None:
    sc = build(SHAPES["gqa"], 2, page_size=1, single_pool=False, sinks=False)
    run_and_compare(sc, STEPS[:1])
    # R0 holds 7 tokens; its next window is [5, 8): free position 6 too early.
    sc.memory.allocator.free_swa(sc.requests[0].slots[6:7])  # type: ignore[union-attr]
    batch = sc.batch({0: 1, 1: 1})
    with pytest.raises(MissingSWAKV, match=r"request 0: .*position 6"):
        sc.backend.init_forward_metadata(batch)


def test_bad_calls_raise_value_errors() -> None:
    sc = build(SHAPES["gqa"], 2, page_size=1, single_pool=False, sinks=False)
    batch = sc.batch({0: 3})
    layer = sc.layers[0]
    q = torch.zeros(3, 4, 8)
    k = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="call init_forward_metadata"):
        sc.backend.forward(q, k, k, layer, batch)
    sc.backend.init_forward_metadata(batch)
    with pytest.raises(ValueError, match=r"layer 0: k has shape \(3, 4, 8\), expected \(3, 2, 8\)"):
        sc.backend.forward(q, q, k, layer, batch)
    with pytest.raises(ValueError, match=r"sinks have shape \(2,\), expected \(4,\)"):
        sc.backend.forward(q, k, k, layer, batch, sinks=torch.zeros(2))


def test_sdpa_fused_and_matmul_paths_agree() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 5, 6, 12, generator=gen)  # [B, Lq, H, Dk]
    k = torch.randn(3, 9, 2, 12, generator=gen)  # [B, L, Hkv, Dk]
    v = torch.randn(3, 9, 2, 8, generator=gen)  # [B, L, Hkv, Dv]
    bias = torch.zeros(3, 5, 9).masked_fill_(torch.rand(3, 5, 9, generator=gen) < 0.4, -torch.inf)
    bias[..., 0] = 0.0  # every query sees a key
    sinks = torch.randn(6, generator=gen)
    fused = attention(q, k, v, bias, 0.3, sinks, fused=True)
    plain = attention(q, k, v, bias, 0.3, sinks, fused=False)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    # Dv > Dk pads Q and K instead of V.
    fused = attention(q[..., :4], k[..., :4], v, bias, 0.3, None, fused=True)
    plain = attention(q[..., :4], k[..., :4], v, bias, 0.3, None, fused=False)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


def test_bfloat16_stays_close_to_the_reference() -> None:
    sc = build(SHAPES["gqa"], 3, page_size=4, single_pool=False, sinks=True, dtype=torch.bfloat16)
    for extends in STEPS[:3]:
        prefix = {r: sc.requests[r].cached for r in extends}
        outs = sc.step(extends)
        for rid, n in extends.items():
            for layer in sc.layers:
                want = sc.expected(rid, layer, prefix[rid], prefix[rid] + n)
                got = outs[rid][layer.layer_id]
                assert got.dtype == torch.bfloat16
                torch.testing.assert_close(got.double(), want, rtol=0.05, atol=0.05)
        sc.free_out_of_window(3)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize(("kv_heads", "dk", "dv"), [(2, 12, 8), (6, 8, 12), (1, 8, 8)])
def test_decode_attention_loops_equal_the_gathered_attention(
    sinks: bool, kv_heads: int, dk: int, dv: int
) -> None:
    """The compiled step's decode attention, run eager: the same as gathering the rows and
    calling `attention`, for GQA, MHA and MQA, Dk ≠ Dv, sinks, padded columns, bf16 pools."""
    gen = torch.Generator().manual_seed(2)
    rows, b, width, heads = 40, 4, 7, 6
    k_buf = torch.randn(rows, kv_heads, dk, generator=gen)
    v_buf = torch.randn(rows, kv_heads, dv, generator=gen)
    q = torch.randn(b, heads, dk, generator=gen)
    slots = torch.randint(0, rows, (b, width), generator=gen)
    seen = torch.tensor([7, 1, 4, 6])
    bias = torch.zeros(b, width).masked_fill_(torch.arange(width) >= seen[:, None], -torch.inf)
    sink = torch.randn(heads, generator=gen) if sinks else None
    keys = k_buf[slots]  # [B, L, Hkv, Dk]
    values = v_buf[slots]
    want = attention(q[:, None], keys, values, bias[:, None], 0.4, sink, fused=False)[:, 0]
    got = decode_attention_loops(q, k_buf, v_buf, slots, bias, 0.4, sink)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    half = decode_attention_loops(
        q.bfloat16(), k_buf.bfloat16(), v_buf.bfloat16(), slots, bias, 0.4, sink
    )
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), want, rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="7 query heads are not a multiple"):
        decode_attention_loops(q[:, [0] * 7], k_buf[:, [0, 0]], v_buf, slots, bias, 0.4, None)
