"""How many token slots each KV pool gets from a byte budget.

Terms (architecture §2): F / S are the KV bytes of one token in one full / one SWA layer, L_full /
L_swa the layer counts, W the window, P the page size, I the SWA eviction interval and r the
SWA-pool ÷ full-pool token ratio.

Three plans:

- `plan_pools` (SGLang's rule): `cell = F·L_full + r·S·L_swa` bytes per full-pool token,
  `N_full = floor(bytes / cell)`, `N_swa = r·N_full`, both floored to pages.
- `plan_pools_chunk_capped`: with the prefix cache off, chunked prefill on and a cap on running
  requests, SWA need is bounded: each running request keeps at most `W + I + P` SWA tokens
  (`decode_swa_tokens`), plus the pages of one step's drafts with speculative decoding, and one
  chunk is in flight. The SWA pool gets exactly that; the full pool the rest.
- `auto_swa_full_tokens_ratio`: choose r from the expected sequence length (see its docstring).

`plan_single_pool` is the baseline (`disable_hybrid_swa_memory`): one pool for every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swaserve.proto.kv_rules import decode_swa_tokens, min_swa_pool_tokens, page_ceil, page_floor

DEFAULT_SWA_FULL_TOKENS_RATIO = 0.8
DEFAULT_SWA_EVICTION_INTERVAL = 128
AUTO_RATIO_SWA_MARGIN = 1.25
"""Auto ratio: SWA pool = 1.25 × what the running requests' windows need.

The extra quarter keeps the windows of recently finished requests alive in the prefix cache (a
cached prefix is only reusable where its last W tokens still have SWA KV, so without spare SWA
the tree turns into tombstones at once) and absorbs the burst of a chunked prefill. A larger
margin trades full-pool tokens for prefix hits; 1.25 keeps the plan within 4% of the bound at
32K tokens on MiMo-V2-Flash and GPT-OSS shapes (bench/kv_capacity.py).
"""


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """Token counts and bytes of each pool. `swa_tokens == 0` when there are no SWA layers or
    one pool serves every layer (`single_pool`)."""

    full_tokens: int
    swa_tokens: int
    full_bytes: int
    swa_bytes: int
    page_size: int
    swa_full_tokens_ratio: float
    single_pool: bool = False

    @property
    def total_bytes(self) -> int:
        return self.full_bytes + self.swa_bytes


@dataclass(frozen=True, slots=True)
class LayerShape:
    """KV shape of a model: layer counts and per-token, per-layer bytes of each kind."""

    num_full_layers: int
    num_swa_layers: int
    full_token_bytes: int
    swa_token_bytes: int
    sliding_window_size: int

    def __post_init__(self) -> None:
        _check_shape(
            self.num_full_layers,
            self.num_swa_layers,
            self.full_token_bytes,
            self.swa_token_bytes,
            self.sliding_window_size,
        )

    @staticmethod
    def from_heads(
        *,
        num_full_layers: int,
        num_swa_layers: int,
        full_kv_heads: int,
        full_head_dim: int,
        full_v_head_dim: int,
        swa_kv_heads: int,
        swa_head_dim: int,
        swa_v_head_dim: int,
        dtype_bytes: int,
        sliding_window_size: int,
    ) -> LayerShape:
        return LayerShape(
            num_full_layers=num_full_layers,
            num_swa_layers=num_swa_layers,
            full_token_bytes=full_kv_heads * (full_head_dim + full_v_head_dim) * dtype_bytes,
            swa_token_bytes=swa_kv_heads * (swa_head_dim + swa_v_head_dim) * dtype_bytes,
            sliding_window_size=sliding_window_size,
        )


def _check_shape(l_full: int, l_swa: int, f: int, s: int, w: int) -> None:
    for name, value in (
        ("num_full_layers", l_full),
        ("num_swa_layers", l_swa),
        ("full_token_bytes", f),
        ("swa_token_bytes", s),
        ("sliding_window_size", w),
    ):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if l_full + l_swa == 0:
        raise ValueError(
            "the model has no attention layers (num_full_layers + num_swa_layers == 0)"
        )
    if (l_full and f == 0) or (l_swa and s == 0):
        raise ValueError("full_token_bytes / swa_token_bytes must be positive for present layers")


def _check_budget(kv_cache_bytes: int, page_size: int) -> None:
    if not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not isinstance(kv_cache_bytes, int) or kv_cache_bytes <= 0:
        raise ValueError(f"kv_cache_bytes must be a positive int, got {kv_cache_bytes!r}")


def _floor_page(num_tokens: float, page_size: int) -> int:
    return page_floor(int(num_tokens), page_size)


def check_swa_pool(
    swa_tokens: int, sliding_window_size: int, page_size: int, *, source: str, remedy: str
) -> None:
    """Raise ValueError when an SWA pool of `swa_tokens` cannot serve one request (fewer than
    `min_swa_pool_tokens`). Every planner that sizes an SWA pool from the user's numbers calls
    it; `source` says where the size came from, `remedy` what to raise."""
    need = min_swa_pool_tokens(sliding_window_size, page_size)
    if swa_tokens < need:
        raise ValueError(
            f"the SWA pool is too small for one request: {source} gives {swa_tokens} SWA "
            f"tokens; one request needs {need} (window W={sliding_window_size}, page size "
            f"P={page_size}, the next token) {remedy}"
        )


def plan_pools(
    *,
    num_full_layers: int,
    num_swa_layers: int,
    full_token_bytes: int,
    swa_token_bytes: int,
    sliding_window_size: int,
    kv_cache_bytes: int,
    swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO,
    page_size: int = 1,
) -> PoolPlan:
    """Split `kv_cache_bytes` between the full and SWA pools at token ratio r.

    Raises ValueError on bad input and when the SWA pool could not hold a single request
    (`check_swa_pool`: fewer than `min_swa_pool_tokens(W, P)` tokens, i.e. `<= W + P` for W >= P).
    """
    _check_shape(
        num_full_layers, num_swa_layers, full_token_bytes, swa_token_bytes, sliding_window_size
    )
    _check_budget(kv_cache_bytes, page_size)
    r = swa_full_tokens_ratio
    if not isinstance(r, (int, float)) or not 0 < r <= 1 or math.isnan(r):
        raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {r!r}")
    if num_swa_layers == 0:
        return _full_only(num_full_layers * full_token_bytes, kv_cache_bytes, page_size)

    full_cell = full_token_bytes * num_full_layers
    swa_cell = swa_token_bytes * num_swa_layers
    cell = full_cell + r * swa_cell
    full_tokens = _floor_page(kv_cache_bytes / cell, page_size)
    swa_tokens = _floor_page(r * full_tokens, page_size)
    check_swa_pool(
        swa_tokens,
        sliding_window_size,
        page_size,
        source=f"swa_full_tokens_ratio r={r} of {full_tokens} full tokens",
        remedy=f"(kv_cache_bytes={kv_cache_bytes}, {cell:.0f} bytes per full token) Raise "
        "kv_cache_bytes or r.",
    )
    return PoolPlan(
        full_tokens=full_tokens,
        swa_tokens=swa_tokens,
        full_bytes=full_tokens * full_cell,
        swa_bytes=swa_tokens * swa_cell,
        page_size=page_size,
        swa_full_tokens_ratio=swa_tokens / full_tokens if full_tokens else float(r),
    )


def plan_pools_chunk_capped(
    *,
    num_full_layers: int,
    num_swa_layers: int,
    full_token_bytes: int,
    swa_token_bytes: int,
    sliding_window_size: int,
    kv_cache_bytes: int,
    max_running_requests: int,
    chunked_prefill_size: int,
    swa_eviction_interval: int = DEFAULT_SWA_EVICTION_INTERVAL,
    page_size: int = 1,
    draft_tokens: int = 0,
) -> PoolPlan:
    """Plan for prefix cache off + chunked prefill on + bounded running requests.

    No tree holds SWA KV, so the SWA pool only serves running requests: each keeps at most
    `W + I + P` SWA tokens once past the window, and one prefill chunk is in flight:
    `N_swa = ceil_P(R·(W + I + P) + C + P)`. The full pool takes every remaining byte.
    `draft_tokens` (k, speculative decoding): a decoding request also holds the slots of its
    k drafts during a step, at most `ceil_P(k)` new tokens' pages, so each request counts
    those too (the scheduler reserves as much: `Scheduler.reserved_tokens`).
    """
    _check_shape(
        num_full_layers, num_swa_layers, full_token_bytes, swa_token_bytes, sliding_window_size
    )
    _check_budget(kv_cache_bytes, page_size)
    for name, value in (
        ("max_running_requests", max_running_requests),
        ("chunked_prefill_size", chunked_prefill_size),
        ("swa_eviction_interval", swa_eviction_interval),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(draft_tokens, int) or draft_tokens < 0:
        raise ValueError(f"draft_tokens must be an int >= 0, got {draft_tokens!r}")
    if num_swa_layers == 0:
        return _full_only(num_full_layers * full_token_bytes, kv_cache_bytes, page_size)

    w, p = sliding_window_size, page_size
    per_request = page_ceil(decode_swa_tokens(w, swa_eviction_interval, p), p)
    per_request += page_ceil(draft_tokens, p)
    swa_tokens = page_ceil(max_running_requests * per_request + chunked_prefill_size + p, p)
    full_cell = full_token_bytes * num_full_layers
    swa_cell = swa_token_bytes * num_swa_layers
    rest = kv_cache_bytes - swa_tokens * swa_cell
    if full_cell:
        full_tokens = _floor_page(rest / full_cell, p) if rest > 0 else 0
    else:
        full_tokens = swa_tokens  # pure SWA: the full pool is only an address space
    if full_tokens < swa_tokens or rest < 0:
        raise ValueError(
            f"kv_cache_bytes={kv_cache_bytes} cannot hold the capped SWA pool of {swa_tokens} "
            f"tokens (max_running_requests={max_running_requests} × (W={w} + I="
            f"{swa_eviction_interval} + P={p}"
            + (f" + drafts {page_ceil(draft_tokens, p)}" if draft_tokens else "")
            + f") + chunk {chunked_prefill_size} + P) and a full pool at least as large; "
            f"lower max_running_requests or chunked_prefill_size"
        )
    return PoolPlan(
        full_tokens=full_tokens,
        swa_tokens=swa_tokens,
        full_bytes=full_tokens * full_cell,
        swa_bytes=swa_tokens * swa_cell,
        page_size=p,
        swa_full_tokens_ratio=swa_tokens / full_tokens,
    )


def plan_single_pool(
    *,
    num_full_layers: int,
    num_swa_layers: int,
    full_token_bytes: int,
    swa_token_bytes: int,
    kv_cache_bytes: int,
    page_size: int = 1,
) -> PoolPlan:
    """`disable_hybrid_swa_memory`: one pool, every layer keeps every token's KV."""
    _check_shape(num_full_layers, num_swa_layers, full_token_bytes, swa_token_bytes, 0)
    _check_budget(kv_cache_bytes, page_size)
    cell = full_token_bytes * num_full_layers + swa_token_bytes * num_swa_layers
    return _full_only(cell, kv_cache_bytes, page_size)


def _full_only(cell: int, kv_cache_bytes: int, page_size: int) -> PoolPlan:
    tokens = _floor_page(kv_cache_bytes / cell, page_size)
    if tokens <= page_size:
        raise ValueError(
            f"kv_cache_bytes={kv_cache_bytes} holds {tokens} tokens at {cell} bytes per token; "
            f"need more than one page (page_size={page_size})"
        )
    return PoolPlan(
        full_tokens=tokens,
        swa_tokens=0,
        full_bytes=tokens * cell,
        swa_bytes=0,
        page_size=page_size,
        swa_full_tokens_ratio=0.0,
        single_pool=True,
    )


def auto_swa_full_tokens_ratio(
    *,
    num_full_layers: int,
    num_swa_layers: int,
    full_token_bytes: int,
    swa_token_bytes: int,
    sliding_window_size: int,
    kv_cache_bytes: int,
    expected_seq_len: int,
    max_running_requests: int | None = None,
    chunked_prefill_size: int | None = None,
    swa_eviction_interval: int = DEFAULT_SWA_EVICTION_INTERVAL,
    page_size: int = 1,
    swa_margin: float = AUTO_RATIO_SWA_MARGIN,
) -> float:
    """Choose r so that the full pool gets what requests of `expected_seq_len` tokens need.

    A request of T tokens needs T full slots but only about `W + I + P` SWA slots once past the
    window. With n requests running the SWA pool must hold `n·(W + I + P)` plus one prefill
    chunk; n is what the full pool fits (`N_full / T`), or `max_running_requests` if smaller.
    The SWA need is multiplied by `swa_margin` (default 1.25, see `AUTO_RATIO_SWA_MARGIN`) so
    that finished requests' windows can stay in the prefix cache. Solved by fixed-point
    iteration (N_full depends on r), clamped to `[r_min, 1]` where r_min still gives the SWA
    pool `min_swa_pool_tokens(W, P)`.
    """
    _check_shape(
        num_full_layers, num_swa_layers, full_token_bytes, swa_token_bytes, sliding_window_size
    )
    _check_budget(kv_cache_bytes, page_size)
    if not isinstance(expected_seq_len, int) or expected_seq_len <= 0:
        raise ValueError(f"expected_seq_len must be a positive int, got {expected_seq_len!r}")
    if swa_margin < 1:
        raise ValueError(f"swa_margin must be >= 1, got {swa_margin}")
    if num_swa_layers == 0:
        return 1.0
    w, p = sliding_window_size, page_size
    per_request = decode_swa_tokens(w, swa_eviction_interval, p)
    chunk = chunked_prefill_size or 0
    full_cell = full_token_bytes * num_full_layers
    swa_cell = swa_token_bytes * num_swa_layers

    r = min(1.0, swa_margin * per_request / expected_seq_len)
    for _ in range(8):
        full_tokens = kv_cache_bytes / (full_cell + r * swa_cell)
        running = full_tokens / expected_seq_len
        if max_running_requests is not None:
            running = min(running, max_running_requests)
        swa_need = swa_margin * running * per_request + chunk + p
        r = min(1.0, swa_need / full_tokens)
    # Smallest r whose SWA pool still holds one request, plus a page for the pools' floors.
    full_tokens = kv_cache_bytes / (full_cell + r * swa_cell)
    r_min = min(1.0, (min_swa_pool_tokens(w, p) + p) / full_tokens)
    return max(r, r_min)


def requests_that_fit(
    plan: PoolPlan,
    seq_len: int,
    *,
    sliding_window_size: int,
    swa_eviction_interval: int = DEFAULT_SWA_EVICTION_INTERVAL,
) -> int:
    """Concurrent requests of `seq_len` tokens a plan holds once they decode past the window.

    Each takes `ceil_P(seq_len)` full tokens and (hybrid) `ceil_P(W + I + P)` SWA tokens.
    """
    p = plan.page_size
    by_full = plan.full_tokens // page_ceil(seq_len, p)
    if plan.single_pool:
        return by_full
    per_request_swa = page_ceil(
        min(seq_len, decode_swa_tokens(sliding_window_size, swa_eviction_interval, p)), p
    )
    return min(by_full, plan.swa_tokens // per_request_swa)


def request_bound(
    shape: LayerShape,
    seq_len: int,
    kv_cache_bytes: int,
    *,
    page_size: int = 1,
    swa_eviction_interval: int = DEFAULT_SWA_EVICTION_INTERVAL,
) -> int:
    """Upper bound on concurrent requests: full KV for all tokens in full layers plus
    `W + I + P` tokens in SWA layers, nothing else."""
    p = page_size
    full = page_ceil(seq_len, p) * shape.full_token_bytes * shape.num_full_layers
    swa_tokens = page_ceil(
        min(seq_len, decode_swa_tokens(shape.sliding_window_size, swa_eviction_interval, p)), p
    )
    swa = swa_tokens * shape.swa_token_bytes * shape.num_swa_layers
    return kv_cache_bytes // (full + swa)
