"""KV memory of one worker: allocators, KV buffers, pool sizing, out-of-window SWA freeing."""

from swaserve.worker.kv.allocator import NO_LAST_LOC, SWATokenAllocator, TokenAllocator
from swaserve.worker.kv.errors import AllocatorCorrupted, InvalidFree, KVError
from swaserve.worker.kv.kv_pool import KVLayout, KVPool, LayerSlot, SWAKVPool
from swaserve.worker.kv.memory import (
    KVMemory,
    KVMemoryConfig,
    KVModelSpec,
    build_kv_memory,
    plan_kv_memory,
)
from swaserve.worker.kv.pool_plan import (
    AUTO_RATIO_SWA_MARGIN,
    DEFAULT_SWA_EVICTION_INTERVAL,
    DEFAULT_SWA_FULL_TOKENS_RATIO,
    LayerShape,
    PoolPlan,
    auto_swa_full_tokens_ratio,
    plan_pools,
    plan_pools_chunk_capped,
    plan_single_pool,
    request_bound,
    requests_that_fit,
)
from swaserve.worker.kv.swa_freeing import (
    SWAFreeState,
    free_swa_out_of_window_slots,
    swa_free_boundary,
)

__all__ = [
    "AUTO_RATIO_SWA_MARGIN",
    "DEFAULT_SWA_EVICTION_INTERVAL",
    "DEFAULT_SWA_FULL_TOKENS_RATIO",
    "NO_LAST_LOC",
    "AllocatorCorrupted",
    "InvalidFree",
    "KVError",
    "KVLayout",
    "KVMemory",
    "KVMemoryConfig",
    "KVModelSpec",
    "KVPool",
    "LayerShape",
    "LayerSlot",
    "PoolPlan",
    "SWAFreeState",
    "SWAKVPool",
    "SWATokenAllocator",
    "TokenAllocator",
    "auto_swa_full_tokens_ratio",
    "build_kv_memory",
    "free_swa_out_of_window_slots",
    "plan_kv_memory",
    "plan_pools",
    "plan_pools_chunk_capped",
    "plan_single_pool",
    "request_bound",
    "requests_that_fit",
    "swa_free_boundary",
]
