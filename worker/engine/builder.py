"""`build_host_state`: the wiring of one engine's host side, from its config, the model's shape
and the KV budget. Every rule that depends on the model and the pools together is decided here,
once: whether the engine has two pools (`hybrid`), the prefill chunk, the window repair's R
(0: this engine does not repair), the request limits.

    config + ModelShape + KV budget
      → PoolPlan → allocator → prefix cache (R) → slot table → KVCacheManager
      → RequestLimits, SchedulerLimits → Scheduler
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from swaserve.proto.kv_rules import (
    max_swa_extend_tokens,
    page_ceil,
    page_floor,
    window_repair_tokens,
)
from swaserve.proto.messages import Headroom
from swaserve.proto.request_limits import RequestLimits
from swaserve.worker.config import EngineConfig
from swaserve.worker.engine.kv_manager import KVCacheManager, is_hybrid
from swaserve.worker.engine.ngram import NgramDrafter
from swaserve.worker.engine.scheduler import Scheduler, SchedulerLimits
from swaserve.worker.engine.stats import EngineStats
from swaserve.worker.kv.allocator import SWATokenAllocator, TokenAllocator
from swaserve.worker.kv.memory import build_kv_allocator, plan_kv_memory
from swaserve.worker.kv.pool_plan import PoolPlan
from swaserve.worker.kv.radix_cache import PureSWARadixCache, SWARadixCache
from swaserve.worker.kv.slot_table import RequestSlotTable


class ModelShape(Protocol):
    """What the host side needs to know of the model (`models.ModelConfig` provides it)."""

    sliding_window_size: int
    attention_chunk_size: int | None  # C of chunked local layers (then W = C - 1)
    swa_layer_ids: Sequence[int]
    full_layer_ids: Sequence[int]
    max_position_embeddings: int
    eos_token_ids: Any  # a collection of token ids

    def kv_spec(self, tp_size: int) -> Any: ...


@dataclass(slots=True)
class HostState:
    """One engine's host state, wired (see the module docstring)."""

    plan: PoolPlan
    allocator: SWATokenAllocator | TokenAllocator
    window: int | None  # W when the model has SWA layers
    hybrid: bool  # two pools for a model with SWA layers (`kv_manager.is_hybrid`)
    window_repair_tokens: int  # R of a window repair; 0: this engine does not repair
    tree: SWARadixCache | None
    slot_table: RequestSlotTable
    kv: KVCacheManager
    request_limits: RequestLimits
    scheduler: Scheduler
    stats: EngineStats
    max_model_len: int
    spec_method: str = ""  # the drafter (`speculative_method`); "": none

    @property
    def slot_table_shape(self) -> tuple[int, int]:
        return (self.slot_table.num_rows, self.slot_table.max_len)

    def headroom(self) -> Headroom:
        """What this engine can still take (`proto.messages.Headroom`): free and evictable
        tokens of each pool, queues, the prefix cache's counters, and what a router must know
        of its rules (W, P, the chunk, R)."""
        plan = self.plan
        tree = self.tree
        full_free = self.allocator.full_available_size()
        swa_free = self.allocator.swa_available_size()
        swa_total = plan.swa_tokens if self.hybrid else plan.full_tokens
        full_reserved, swa_reserved = self.scheduler.reserved_tokens()
        full_evictable = tree.full_evictable_size() if tree else 0
        full_protected = tree.full_protected_size() if tree else 0
        # One pool: its SWA figures are the pool's own (what eviction frees serves SWA layers too).
        swa_evictable = tree.swa_evictable_size() if tree and self.hybrid else full_evictable
        swa_protected = tree.swa_protected_size() if tree and self.hybrid else full_protected
        return Headroom(
            full_total_tokens=plan.full_tokens,
            full_free_tokens=full_free,
            full_evictable_tokens=full_evictable,
            swa_total_tokens=swa_total,
            swa_free_tokens=swa_free,
            swa_evictable_tokens=swa_evictable,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            full_protected_tokens=full_protected,
            swa_protected_tokens=swa_protected,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens(),
            prefilling_tokens=self.scheduler.prefilling_tokens(),
            prompt_tokens_total=self.stats.prompt_tokens,
            cached_tokens_total=self.stats.cached_tokens,
            window_repair_tokens_total=self.stats.window_repair_tokens,
            prefill_tokens_total=self.stats.prefill_tokens,
            prefill_s_total=self.stats.prefill_s,
            decode_steps_total=self.stats.decode_steps,
            decode_s_total=self.stats.decode_s,
            spec_verifies_total=self.stats.spec_verifies,
            spec_draft_tokens_total=self.stats.spec_draft_tokens,
            spec_accepted_tokens_total=self.stats.spec_accepted_tokens,
            spec_method=self.spec_method,
            sliding_window_size=self.window or 0,
            attention_chunk_size=(self.tree.attention_chunk_size or 0) if self.tree else 0,
            page_size=self.plan.page_size,
            chunked_prefill_size=self.scheduler.limits.chunked_prefill_size or 0,
            hybrid=self.hybrid,
            full_reserved_tokens=full_reserved,
            swa_reserved_tokens=swa_reserved,
            window_repair_tokens=self.window_repair_tokens,
        )


def build_host_state(
    config: EngineConfig, model: ModelShape, kv_cache_bytes: int | None, dtype: Any
) -> HostState:
    """Plan the pools (each TP rank holds its shard of the KV heads: token counts are the
    group's) and wire the host side around them."""
    kv_config = config.kv_memory_config(kv_cache_bytes=kv_cache_bytes)
    plan = plan_kv_memory(model.kv_spec(config.tp_size), kv_config, dtype)
    allocator = build_kv_allocator(plan)  # host state: rank 0's, whatever the device
    p = config.page_size
    window = model.sliding_window_size if model.swa_layer_ids else None
    attn_chunk = model.attention_chunk_size if model.swa_layer_ids else None
    hybrid = is_hybrid(allocator, window)
    repairs = (
        config.enable_prefix_cache and config.enable_window_repair and bool(model.full_layer_ids)
    )
    repair = (
        window_repair_tokens(len(model.swa_layer_ids), window, p, attn_chunk)
        if repairs and hybrid and window
        else 0
    )
    stats = EngineStats()
    tree = _prefix_cache(config, model, allocator, window, hybrid, repair, attn_chunk)
    max_model_len = min(
        config.max_model_len or model.max_position_embeddings, model.max_position_embeddings
    )
    slot_table = RequestSlotTable(
        config.max_running_requests, page_ceil(min(max_model_len, plan.full_tokens), p)
    )
    kv = KVCacheManager(
        allocator,
        tree,
        slot_table,
        page_size=p,
        sliding_window_size=window,
        window_repair_tokens=repair,
        attention_chunk_size=attn_chunk,
        stats=stats,
    )
    chunk = _chunk_size(config, plan, window, hybrid)
    request_limits = RequestLimits(
        max_model_len=max_model_len,
        full_pool_tokens=plan.full_tokens,
        page_size=p,
        sliding_window_size=window or 0,
        swa_pool_tokens=plan.swa_tokens if hybrid else 0,
        chunked_prefill_size=chunk,
        attention_chunk_size=attn_chunk,
    )
    limits = SchedulerLimits(
        page_size=p,
        max_running_requests=config.max_running_requests,
        max_prefill_tokens=config.max_prefill_tokens,
        chunked_prefill_size=chunk,
        max_model_len=max_model_len,
        swa_eviction_interval=config.swa_eviction_interval,
        sliding_window_size=window,
        attention_chunk_size=attn_chunk,
        schedule_policy=config.schedule_policy,
        schedule_conservativeness=config.schedule_conservativeness,
        num_speculative_tokens=config.num_speculative_tokens if config.speculative_method else 0,
        speculative_max_batch=config.speculative_disable_by_batch_size,
    )
    drafter = None
    if config.speculative_method == "ngram":
        drafter = NgramDrafter(
            min_n=config.speculative_ngram_min, max_n=config.speculative_ngram_max
        )
    scheduler = Scheduler(limits, kv, stats, frozenset(model.eos_token_ids), drafter)
    return HostState(
        plan,
        allocator,
        window,
        hybrid,
        repair,
        tree,
        slot_table,
        kv,
        request_limits,
        scheduler,
        stats,
        max_model_len,
        config.speculative_method or "",
    )


def _prefix_cache(
    config: EngineConfig,
    model: ModelShape,
    allocator: SWATokenAllocator | TokenAllocator,
    window: int | None,
    hybrid: bool,
    repair: int,
    attn_chunk: int | None,
) -> SWARadixCache | None:
    """The prefix cache (none when disabled): pure-SWA models get `PureSWARadixCache`; a
    single pool keeps every token, so its window is 1 (no tombstone ever ends a match) and it
    has no chunk rule."""
    if not config.enable_prefix_cache:
        return None
    cls = PureSWARadixCache if hybrid and not model.full_layer_ids else SWARadixCache
    tree_window = window if hybrid and window else 1
    return cls(  # type: ignore[arg-type]
        allocator,
        tree_window,
        config.page_size,
        window_repair_tokens=repair,
        checkpoint_slack_tokens=config.window_checkpoint_slack_tokens if hybrid and window else 0,
        attention_chunk_size=attn_chunk if hybrid and window else None,
    )


def _chunk_size(
    config: EngineConfig, plan: PoolPlan, window: int | None, hybrid: bool
) -> int | None:
    """Chunked-prefill size, capped so that a chunk plus the window fits the SWA pool (the
    planners made the pool hold at least one request: `pool_plan.check_swa_pool`)."""
    chunk = config.chunked_prefill_size
    if not hybrid or window is None or chunk is None:
        return chunk
    p = config.page_size
    longest = max_swa_extend_tokens(plan.swa_tokens, window, p)
    return max(p, min(chunk, page_floor(longest, p)))
