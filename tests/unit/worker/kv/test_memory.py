from __future__ import annotations

import pytest
import torch

from swaserve.proto.kv_rules import min_swa_pool_tokens
from swaserve.worker.kv import KVLayout, KVPool, SWAKVPool, SWATokenAllocator, TokenAllocator
from swaserve.worker.kv.memory import KVMemoryConfig, KVModelSpec, build_kv_memory, plan_kv_memory

SPEC = KVModelSpec(
    full_layer_ids=[0, 3],
    swa_layer_ids=[1, 2, 4, 5],
    full_layout=KVLayout(2, 8, 4),
    swa_layout=KVLayout(4, 8, 4),
    sliding_window_size=16,
)
F = 2 * 12 * 4  # float32
S = 4 * 12 * 4


def test_two_pools_at_fixed_ratio() -> None:
    mem = build_kv_memory(
        SPEC,
        KVMemoryConfig(kv_cache_bytes=1000 * (2 * F) + 500 * (4 * S), swa_full_tokens_ratio=0.5),
    )
    assert isinstance(mem.allocator, SWATokenAllocator) and isinstance(mem.kv_pool, SWAKVPool)
    assert (mem.plan.full_tokens, mem.plan.swa_tokens) == (1000, 500)
    assert mem.allocator.full_available_size() == 1000 and mem.allocator.swa_available_size() == 500
    assert mem.kv_pool.swa_pool.size == 500


def test_disable_hybrid_is_one_pool_for_every_layer() -> None:
    mem = build_kv_memory(SPEC, KVMemoryConfig(max_total_tokens=64, disable_hybrid_swa_memory=True))
    assert isinstance(mem.allocator, TokenAllocator) and isinstance(mem.kv_pool, KVPool)
    assert mem.kv_pool.num_layers == 6
    assert tuple(mem.kv_pool.get_key_buffer(1).shape) == (65, 4, 8)
    assert tuple(mem.kv_pool.get_key_buffer(3).shape) == (65, 2, 8)


def test_max_total_tokens_with_ratio() -> None:
    plan = plan_kv_memory(
        SPEC,
        KVMemoryConfig(max_total_tokens=256, swa_full_tokens_ratio=0.25, page_size=8),
        torch.float32,
    )
    assert (plan.full_tokens, plan.swa_tokens) == (256, 64)
    with pytest.raises(ValueError, match="too small"):
        plan_kv_memory(
            SPEC, KVMemoryConfig(max_total_tokens=64, swa_full_tokens_ratio=0.25), torch.float32
        )


def test_auto_ratio_and_chunk_cap_are_chosen() -> None:
    budget = 10**7
    auto = plan_kv_memory(
        SPEC,
        KVMemoryConfig(kv_cache_bytes=budget, swa_full_tokens_ratio="auto", expected_seq_len=4096),
        torch.float32,
    )
    fixed = plan_kv_memory(SPEC, KVMemoryConfig(kv_cache_bytes=budget), torch.float32)
    assert auto.full_tokens > fixed.full_tokens
    capped = plan_kv_memory(
        SPEC,
        KVMemoryConfig(
            kv_cache_bytes=budget,
            enable_prefix_cache=False,
            chunked_prefill_size=64,
            max_running_requests=4,
            swa_eviction_interval=16,
        ),
        torch.float32,
    )
    assert capped.swa_tokens == 4 * (16 + 16 + 1) + 64 + 1


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        plan_kv_memory(SPEC, KVMemoryConfig(), torch.float32)
    with pytest.raises(ValueError, match="exactly one"):
        plan_kv_memory(
            SPEC, KVMemoryConfig(kv_cache_bytes=10**6, max_total_tokens=10), torch.float32
        )
    with pytest.raises(ValueError, match="expected_seq_len"):
        plan_kv_memory(
            SPEC, KVMemoryConfig(kv_cache_bytes=10**6, swa_full_tokens_ratio="auto"), torch.float32
        )
    with pytest.raises(ValueError, match="needs kv_cache_bytes"):
        plan_kv_memory(
            SPEC, KVMemoryConfig(max_total_tokens=1000, swa_full_tokens_ratio="auto"), torch.float32
        )


@pytest.mark.parametrize("page_size", [1, 4, 32])
def test_every_planner_holds_the_swa_pool_to_min_swa_pool_tokens(page_size: int) -> None:
    """One floor (`min_swa_pool_tokens`, W = 16): a pool of exactly the floor is planned, one
    page less is refused, from tokens and from bytes alike (W < P included)."""
    need = min_swa_pool_tokens(16, page_size)  # 18, 24, 96
    for swa_tokens, ok in ((need, True), (need - page_size, False)):
        full_tokens = 4 * need  # ratio 1/4 gives exactly swa_tokens
        ratio = swa_tokens / full_tokens
        by_tokens = KVMemoryConfig(
            max_total_tokens=full_tokens, swa_full_tokens_ratio=ratio, page_size=page_size
        )
        by_bytes = KVMemoryConfig(
            kv_cache_bytes=full_tokens * 2 * F + swa_tokens * 4 * S,
            swa_full_tokens_ratio=ratio,
            page_size=page_size,
        )
        for config in (by_tokens, by_bytes):
            if ok:
                assert plan_kv_memory(SPEC, config, torch.float32).swa_tokens == swa_tokens
            else:
                with pytest.raises(
                    ValueError, match=f"gives {swa_tokens} SWA tokens; one request needs {need} "
                ):
                    plan_kv_memory(SPEC, config, torch.float32)
