from __future__ import annotations

import pytest

from swaserve.worker.kv import (
    LayerShape,
    auto_swa_full_tokens_ratio,
    plan_pools,
    plan_pools_chunk_capped,
    plan_single_pool,
    request_bound,
    requests_that_fit,
)

F = 1024  # bytes of one token in one full layer
MIMO = dict(
    num_full_layers=9,
    num_swa_layers=39,
    full_token_bytes=F,
    swa_token_bytes=2 * F,
    sliding_window_size=128,
)


def cell_in_f(plan_kwargs: dict, r: float) -> float:
    budget = 10**9
    plan = plan_pools(**plan_kwargs, kv_cache_bytes=budget, swa_full_tokens_ratio=r)
    return budget / plan.full_tokens / F


def test_mimo_cell_sizes() -> None:
    assert cell_in_f(MIMO, 0.8) == pytest.approx(71.4, rel=1e-4)
    assert cell_in_f(MIMO, 0.05) == pytest.approx(12.9, rel=1e-4)


def test_plan_numbers_exact() -> None:
    plan = plan_pools(
        **MIMO, kv_cache_bytes=71_400 * F * 10, swa_full_tokens_ratio=0.8, page_size=16
    )
    # N_full = floor(714000 F / 71.4 F) = 10000 → floored to 16: 10000; N_swa = 8000.
    assert (plan.full_tokens, plan.swa_tokens) == (10_000, 8_000)
    assert plan.full_bytes == 10_000 * 9 * F
    assert plan.swa_bytes == 8_000 * 39 * 2 * F
    assert plan.total_bytes <= 71_400 * F * 10


def test_too_small_swa_pool_raises_naming_the_terms() -> None:
    # 50 full tokens at r = 0.05 → 2 SWA tokens, not > W + P = 129.
    with pytest.raises(ValueError, match=r"r=0\.05.*W=128.*P=1.*kv_cache_bytes=") as err:
        plan_pools(**MIMO, kv_cache_bytes=int(12.9 * F * 50), swa_full_tokens_ratio=0.05)
    assert "SWA pool is too small" in str(err.value)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_bad_ratio_raises(bad: float) -> None:
    with pytest.raises(ValueError, match="swa_full_tokens_ratio"):
        plan_pools(**MIMO, kv_cache_bytes=10**9, swa_full_tokens_ratio=bad)


@pytest.mark.parametrize(
    "override",
    [
        {"num_full_layers": -1},
        {"full_token_bytes": -5},
        {"sliding_window_size": -1},
        {"num_full_layers": 0, "num_swa_layers": 0},
    ],
)
def test_bad_shape_raises(override: dict) -> None:
    with pytest.raises(ValueError):
        plan_pools(**{**MIMO, **override}, kv_cache_bytes=10**9)


@pytest.mark.parametrize(("budget", "page"), [(0, 1), (-1, 1), (10**9, 0), (10**9, -4)])
def test_bad_budget_raises(budget: int, page: int) -> None:
    with pytest.raises(ValueError):
        plan_pools(**MIMO, kv_cache_bytes=budget, page_size=page)


def test_no_swa_layers_is_one_pool() -> None:
    plan = plan_pools(
        num_full_layers=4,
        num_swa_layers=0,
        full_token_bytes=F,
        swa_token_bytes=0,
        sliding_window_size=0,
        kv_cache_bytes=400 * F,
    )
    assert (plan.full_tokens, plan.swa_tokens) == (100, 0)


def test_single_pool_counts_every_layer() -> None:
    plan = plan_single_pool(
        num_full_layers=9,
        num_swa_layers=39,
        full_token_bytes=F,
        swa_token_bytes=2 * F,
        kv_cache_bytes=87 * F * 100,
    )
    assert plan.single_pool and plan.full_tokens == 100 and plan.swa_tokens == 0


def test_chunk_capped_plan() -> None:
    budget = 10**6 * F
    plan = plan_pools_chunk_capped(
        **MIMO,
        kv_cache_bytes=budget,
        max_running_requests=8,
        chunked_prefill_size=512,
        swa_eviction_interval=128,
        page_size=16,
    )
    # per request ceil16(128 + 128 + 16) = 272; 8 × 272 + 512 + 16 = 2704 → 2704 (multiple of 16)
    assert plan.swa_tokens == 2704
    rest = budget - 2704 * 39 * 2 * F
    assert plan.full_tokens == rest // (9 * F) // 16 * 16
    assert plan.total_bytes <= budget


def test_chunk_capped_plan_counts_each_requests_draft_pages() -> None:
    """k drafts per decoding request and step hold ceil_P(k) more SWA slots each."""
    shape = dict(**MIMO, kv_cache_bytes=10**6 * F, max_running_requests=8, chunked_prefill_size=512)
    plain = plan_pools_chunk_capped(**shape, page_size=16)
    for k, pages in ((3, 16), (16, 16), (17, 32)):
        drafting = plan_pools_chunk_capped(**shape, page_size=16, draft_tokens=k)
        assert drafting.swa_tokens == plain.swa_tokens + 8 * pages
    assert plan_pools_chunk_capped(**shape, draft_tokens=3).swa_tokens == (
        plan_pools_chunk_capped(**shape).swa_tokens + 8 * 3
    )
    with pytest.raises(ValueError, match="draft_tokens"):
        plan_pools_chunk_capped(**shape, draft_tokens=-1)


def test_chunk_capped_plan_too_small_raises() -> None:
    with pytest.raises(ValueError, match="max_running_requests=64"):
        plan_pools_chunk_capped(
            **MIMO, kv_cache_bytes=10_000 * F, max_running_requests=64, chunked_prefill_size=512
        )
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        plan_pools_chunk_capped(
            **MIMO, kv_cache_bytes=10**9, max_running_requests=8, chunked_prefill_size=0
        )


def test_auto_ratio_approaches_the_bound_at_long_context() -> None:
    budget = 80 * 10**9
    shape = LayerShape(**MIMO)
    for seq_len in (32_768, 131_072):
        r = auto_swa_full_tokens_ratio(
            **MIMO, kv_cache_bytes=budget, expected_seq_len=seq_len, chunked_prefill_size=8192
        )
        plan = plan_pools(**MIMO, kv_cache_bytes=budget, swa_full_tokens_ratio=r)
        fit = requests_that_fit(plan, seq_len, sliding_window_size=128)
        bound = request_bound(shape, seq_len, budget)
        assert fit >= 0.95 * bound
        fixed = requests_that_fit(
            plan_pools(**MIMO, kv_cache_bytes=budget, swa_full_tokens_ratio=0.8),
            seq_len,
            sliding_window_size=128,
        )
        assert fit > 5 * fixed


def test_auto_ratio_respects_max_running_requests() -> None:
    budget = 80 * 10**9
    free_r = auto_swa_full_tokens_ratio(**MIMO, kv_cache_bytes=budget, expected_seq_len=4096)
    capped_r = auto_swa_full_tokens_ratio(
        **MIMO, kv_cache_bytes=budget, expected_seq_len=4096, max_running_requests=16
    )
    assert capped_r < free_r
    plan = plan_pools(**MIMO, kv_cache_bytes=budget, swa_full_tokens_ratio=capped_r)
    assert plan.swa_tokens >= 16 * (128 + 128 + 1)


def test_auto_ratio_short_requests_clamped_to_one() -> None:
    r = auto_swa_full_tokens_ratio(**MIMO, kv_cache_bytes=10**9, expected_seq_len=64)
    assert r == 1.0


def test_auto_ratio_bad_input() -> None:
    with pytest.raises(ValueError, match="expected_seq_len"):
        auto_swa_full_tokens_ratio(**MIMO, kv_cache_bytes=10**9, expected_seq_len=0)
