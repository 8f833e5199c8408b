"""Build a worker's KV memory — allocator and KV buffers — from the model's layer kinds and the
user's knobs. This is the one place that picks single pool, two pools at a fixed ratio, two pools
at the auto ratio, or the chunk-capped plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from swaserve.worker.kv.allocator import SWATokenAllocator, TokenAllocator
from swaserve.worker.kv.kv_pool import KVLayout, KVPool, SWAKVPool
from swaserve.worker.kv.pool_plan import (
    DEFAULT_SWA_EVICTION_INTERVAL,
    LayerShape,
    PoolPlan,
    auto_swa_full_tokens_ratio,
    check_swa_pool,
    plan_pools,
    plan_pools_chunk_capped,
    plan_single_pool,
)


@dataclass(frozen=True, slots=True)
class KVModelSpec:
    """What the KV memory needs to know about a model."""

    full_layer_ids: list[int]
    swa_layer_ids: list[int]
    full_layout: KVLayout
    swa_layout: KVLayout
    sliding_window_size: int
    # Layers that own no KV: they read another layer's (Gemma 4's KV-shared layers).
    shared_layer_ids: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.full_layer_ids) + len(self.swa_layer_ids) + len(self.shared_layer_ids)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.swa_layer_ids)

    def layer_shape(self, dtype: torch.dtype) -> LayerShape:
        """Layer counts and per-token, per-layer KV bytes (F, S) at `dtype`, for the planners."""
        return LayerShape(
            num_full_layers=len(self.full_layer_ids),
            num_swa_layers=len(self.swa_layer_ids),
            full_token_bytes=self.full_layout.token_bytes(dtype),
            swa_token_bytes=self.swa_layout.token_bytes(dtype),
            sliding_window_size=self.sliding_window_size,
        )

    @property
    def kv_layer_ids(self) -> list[int]:
        """The layers that own KV, ascending."""
        return sorted([*self.full_layer_ids, *self.swa_layer_ids])

    def layouts_by_layer(self) -> list[KVLayout]:
        """The layout of each layer of `kv_layer_ids`, in that order."""
        swa = set(self.swa_layer_ids)
        return [self.swa_layout if i in swa else self.full_layout for i in self.kv_layer_ids]


@dataclass(frozen=True, slots=True)
class KVMemoryConfig:
    """The KV knobs of `EngineConfig`. Give either `kv_cache_bytes` or `max_total_tokens`
    (full-pool tokens). With a byte budget, prefix cache off, chunked prefill on and
    `max_running_requests` set, the chunk-capped plan is used and the ratio does not apply."""

    page_size: int = 1
    kv_cache_bytes: int | None = None
    max_total_tokens: int | None = None
    swa_full_tokens_ratio: float | Literal["auto"] = 0.8
    expected_seq_len: int | None = None
    disable_hybrid_swa_memory: bool = False
    enable_prefix_cache: bool = True
    chunked_prefill_size: int | None = None
    max_running_requests: int | None = None
    swa_eviction_interval: int = DEFAULT_SWA_EVICTION_INTERVAL
    draft_tokens: int = 0  # k: the drafts a decoding request verifies per step (0: none)


@dataclass(slots=True)
class KVMemory:
    """A worker's KV memory: the plan, rank 0's host allocator (`SWATokenAllocator` for two
    pools, `TokenAllocator` for one) and one rank's KV buffers (`SWAKVPool` or `KVPool`)."""

    plan: PoolPlan
    allocator: SWATokenAllocator | TokenAllocator
    kv_pool: SWAKVPool | KVPool

    @property
    def two_pools(self) -> bool:
        """A full and an SWA pool (else one pool). Whether a model runs hybrid is
        `kv_manager.is_hybrid`: two pools *and* SWA layers."""
        return isinstance(self.allocator, SWATokenAllocator)


def plan_kv_memory(spec: KVModelSpec, config: KVMemoryConfig, dtype: torch.dtype) -> PoolPlan:
    """Choose the pool plan for `spec` under `config` (raises ValueError with the reason)."""
    if (config.kv_cache_bytes is None) == (config.max_total_tokens is None):
        raise ValueError("give exactly one of kv_cache_bytes and max_total_tokens")
    ls = spec.layer_shape(dtype)
    f, s, l_full, l_swa = (
        ls.full_token_bytes,
        ls.swa_token_bytes,
        ls.num_full_layers,
        ls.num_swa_layers,
    )
    p = config.page_size
    single = config.disable_hybrid_swa_memory or not spec.is_hybrid
    ratio = config.swa_full_tokens_ratio

    budget = config.kv_cache_bytes
    if budget is None:
        assert config.max_total_tokens is not None
        return _plan_from_tokens(ls, config, single)

    shape = dict(
        num_full_layers=l_full, num_swa_layers=l_swa, full_token_bytes=f, swa_token_bytes=s
    )
    if single:
        return plan_single_pool(**shape, kv_cache_bytes=budget, page_size=p)
    w = spec.sliding_window_size
    chunk_capped = (
        not config.enable_prefix_cache
        and config.chunked_prefill_size is not None
        and config.max_running_requests is not None
    )
    if chunk_capped:
        # No tree keeps SWA KV, so the SWA need is bounded exactly; r is not used.
        return plan_pools_chunk_capped(
            **shape,
            sliding_window_size=w,
            kv_cache_bytes=budget,
            max_running_requests=config.max_running_requests,
            chunked_prefill_size=config.chunked_prefill_size,
            swa_eviction_interval=config.swa_eviction_interval,
            page_size=p,
            draft_tokens=config.draft_tokens,
        )
    if ratio == "auto":
        if config.expected_seq_len is None:
            raise ValueError('swa_full_tokens_ratio="auto" needs expected_seq_len')
        ratio = auto_swa_full_tokens_ratio(
            **shape,
            sliding_window_size=w,
            kv_cache_bytes=budget,
            expected_seq_len=config.expected_seq_len,
            max_running_requests=config.max_running_requests,
            chunked_prefill_size=config.chunked_prefill_size,
            swa_eviction_interval=config.swa_eviction_interval,
            page_size=p,
        )
    return plan_pools(
        **shape,
        sliding_window_size=w,
        kv_cache_bytes=budget,
        swa_full_tokens_ratio=ratio,
        page_size=p,
    )


def _plan_from_tokens(shape: LayerShape, config: KVMemoryConfig, single: bool) -> PoolPlan:
    tokens = config.max_total_tokens
    p = config.page_size
    if not isinstance(tokens, int) or tokens <= p:
        raise ValueError(f"max_total_tokens must be an int > page_size={p}, got {tokens!r}")
    full_tokens = tokens // p * p
    f, s, l_full, l_swa = (
        shape.full_token_bytes,
        shape.swa_token_bytes,
        shape.num_full_layers,
        shape.num_swa_layers,
    )
    if single:
        cell = f * l_full + s * l_swa
        return PoolPlan(full_tokens, 0, full_tokens * cell, 0, p, 0.0, single_pool=True)
    ratio = config.swa_full_tokens_ratio
    if ratio == "auto":
        raise ValueError('swa_full_tokens_ratio="auto" needs kv_cache_bytes, not max_total_tokens')
    if not 0 < ratio <= 1:
        raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {ratio}")
    swa_tokens = int(full_tokens * ratio) // p * p
    check_swa_pool(
        swa_tokens,
        shape.sliding_window_size,
        p,
        source=f"r={ratio} of max_total_tokens={full_tokens}",
        remedy="Raise max_total_tokens or swa_full_tokens_ratio.",
    )
    return PoolPlan(
        full_tokens,
        swa_tokens,
        full_tokens * f * l_full,
        swa_tokens * s * l_swa,
        p,
        swa_tokens / full_tokens,
    )


def build_kv_allocator(plan: PoolPlan) -> SWATokenAllocator | TokenAllocator:
    """Rank 0's allocator for `plan`, on the host (allocation, `full_to_swa`, the tree's slots
    are host state whatever the model's device)."""
    if plan.single_pool:
        return TokenAllocator(plan.full_tokens, plan.page_size)
    return SWATokenAllocator(plan.full_tokens, plan.swa_tokens, plan.page_size)


def build_kv_pool(
    spec: KVModelSpec,
    plan: PoolPlan,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    scratch_rows: int = 0,
    scratch_layer_ids: frozenset[int] = frozenset(),
) -> SWAKVPool | KVPool:
    """Every rank's KV buffers for `plan` on `device` (the same slot ids on every rank);
    `scratch_rows` past the slots, from `scratch_base`, in the buffers of `scratch_layer_ids`
    (the MTP layers: SWA layers, in whichever pool holds those)."""
    p = plan.page_size
    if plan.single_pool:
        return KVPool(
            plan.full_tokens,
            spec.layouts_by_layer(),
            dtype=dtype,
            page_size=p,
            device=device,
            layer_ids=spec.kv_layer_ids,
            scratch_rows=scratch_rows,
            scratch_layer_ids=scratch_layer_ids,
        )
    return SWAKVPool(
        full_size=plan.full_tokens,
        swa_size=plan.swa_tokens,
        full_layer_ids=spec.full_layer_ids,
        swa_layer_ids=spec.swa_layer_ids,
        full_layout=spec.full_layout,
        swa_layout=spec.swa_layout,
        dtype=dtype,
        page_size=p,
        device=device,
        scratch_rows=scratch_rows,
        scratch_layer_ids=scratch_layer_ids,
    )


def scratch_base(plan: PoolPlan) -> int:
    """The first scratch id of the pool that holds the SWA layers (`build_kv_pool`): past its
    slots and its padding page."""
    return (plan.full_tokens if plan.single_pool else plan.swa_tokens) + plan.page_size


def build_kv_memory(
    spec: KVModelSpec,
    config: KVMemoryConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> KVMemory:
    """Plan the pools, then build the host allocator and the KV buffers on `device`."""
    plan = plan_kv_memory(spec, config, dtype)
    return KVMemory(
        plan=plan,
        allocator=build_kv_allocator(plan),
        kv_pool=build_kv_pool(spec, plan, dtype=dtype, device=device),
    )
