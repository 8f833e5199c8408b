"""KV capacity report: concurrent requests a KV budget holds with one pool, two pools at r = 0.8,
SGLang's treatment of the model (`SGLANG_TREATMENT`), and two pools at the auto ratio, against
the bound. Used by `bench/kv_capacity.py` and `swaserve kv-capacity`."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from swaserve.worker.kv.pool_plan import (
    DEFAULT_SWA_EVICTION_INTERVAL,
    LayerShape,
    auto_swa_full_tokens_ratio,
    plan_pools,
    plan_single_pool,
    request_bound,
    requests_that_fit,
)
from swaserve.worker.runner.parallel import num_kv_heads_per_rank

BF16_BYTES = 2


def one_kv_shape(
    num_full_layers: int, num_swa_layers: int, kv_heads: int, head_dim: int, window: int
) -> dict[str, int]:
    """`MODEL_HEADS`' entry of a model whose two layer kinds have one KV shape."""
    return dict(
        num_full_layers=num_full_layers,
        num_swa_layers=num_swa_layers,
        full_kv_heads=kv_heads,
        full_head_dim=head_dim,
        full_v_head_dim=head_dim,
        swa_kv_heads=kv_heads,
        swa_head_dim=head_dim,
        swa_v_head_dim=head_dim,
        sliding_window_size=window,
    )


# Real layer counts, KV heads and dims (bf16 KV). W is the number of tokens *before* the current
# one an SWA query sees (architecture §2): GPT-OSS's HF config stores sliding_window = 128 = W + 1.
MODEL_HEADS: dict[str, dict[str, int]] = {
    # 36 layers alternating sliding / full; 8 KV heads of dim 64.
    "gpt-oss-120b": dict(
        num_full_layers=18,
        num_swa_layers=18,
        full_kv_heads=8,
        full_head_dim=64,
        full_v_head_dim=64,
        swa_kv_heads=8,
        swa_head_dim=64,
        swa_v_head_dim=64,
        sliding_window_size=127,
    ),
    # 48 layers: 9 full (4 KV heads), 39 SWA (8 KV heads); K dim 192, V dim 128; window 128.
    "mimo-v2-flash": dict(
        num_full_layers=9,
        num_swa_layers=39,
        full_kv_heads=4,
        full_head_dim=192,
        full_v_head_dim=128,
        swa_kv_heads=8,
        swa_head_dim=192,
        swa_v_head_dim=128,
        sliding_window_size=128,
    ),
    # Gemma 3 27B: 62 layers, 5 local : 1 global (10 global, 52 local); 16 KV heads of dim 128;
    # sliding_window 1024 = W + 1. SGLang serves it on one pool.
    "gemma-3-27b": dict(
        num_full_layers=10,
        num_swa_layers=52,
        full_kv_heads=16,
        full_head_dim=128,
        full_v_head_dim=128,
        swa_kv_heads=16,
        swa_head_dim=128,
        swa_v_head_dim=128,
        sliding_window_size=1023,
    ),
    # Llama 4 Scout / Maverick: 48 layers, 3 chunked : 1 global (36 : 12); 8 KV heads of dim
    # 128; attention_chunk_size 8192: a chunked query reads at most C - 1 keys before it.
    "llama-4-scout": one_kv_shape(12, 36, 8, 128, 8191),
    # Command A: 64 layers, 3 sliding : 1 global (48 : 16); 8 KV heads of dim 128; window 4096.
    "command-a": one_kv_shape(16, 48, 8, 128, 4095),
    # OLMo 3 32B: 64 layers, 3 sliding : 1 global; 8 KV heads of dim 128; window 4096.
    "olmo-3-32b": one_kv_shape(16, 48, 8, 128, 4095),
    # EXAONE 4.0 32B: 64 layers, LLLG (48 local : 16 global); 8 KV heads of dim 128; window 4096.
    "exaone-4-32b": one_kv_shape(16, 48, 8, 128, 4095),
}

SGLANG_TREATMENT: dict[str, tuple[str, int]] = {
    "gpt-oss-120b": ("two pools", 127),
    "mimo-v2-flash": ("two pools", 128),
    "gemma-3-27b": ("one pool", 0),  # its Gemma 2 / 3 models force a single pool
    "llama-4-scout": ("two pools", 8192),  # the chunk read as a sliding window of C
    "command-a": ("one pool", 0),  # its Cohere2 model has no hybrid path
    "olmo-3-32b": ("two pools", 4095),  # assumed: its hybrid path (not checked in its code)
    "exaone-4-32b": ("one pool", 0),  # forced whenever the window pattern is set
}
"""How SGLang serves each model's KV: one pool, or two pools at its default ratio 0.8 with the
window it reads (Llama 4: a window of C, keeping up to C + P tokens no query reads where
swaserve frees whole chunks at each boundary)."""


def model_shapes(tp_size: int = 1) -> dict[str, LayerShape]:
    """Each model's per-rank layer shape at `tp_size`: a rank holds its share of the KV heads
    (one replicated head when tp exceeds them), so a per-rank byte budget holds the group's
    tokens."""
    shapes = {}
    for name, heads in MODEL_HEADS.items():
        per_rank = dict(heads)
        for kind in ("full_kv_heads", "swa_kv_heads"):
            per_rank[kind] = num_kv_heads_per_rank(heads[kind], tp_size)
        shapes[name] = LayerShape.from_heads(**per_rank, dtype_bytes=BF16_BYTES)
    return shapes


MODEL_SHAPES: dict[str, LayerShape] = model_shapes(1)


@dataclass(frozen=True, slots=True)
class CapacityRow:
    model: str
    seq_len: int
    single_pool: int
    ratio_0_8: int
    auto: int
    auto_ratio: float
    bound: int
    sglang: int = 0  # SGLang's treatment (`SGLANG_TREATMENT`)

    def as_json(self) -> dict:
        return {
            "model": self.model,
            "seq_len": self.seq_len,
            "single_pool": self.single_pool,
            "ratio_0.8": self.ratio_0_8,
            "auto": self.auto,
            "auto_ratio": round(self.auto_ratio, 6),
            "bound": self.bound,
            "sglang": self.sglang,
        }


def capacity_row(
    model: str,
    shape: LayerShape,
    seq_len: int,
    kv_cache_bytes: int,
    *,
    page_size: int = 1,
    chunked_prefill_size: int | None = 8192,
    swa_eviction_interval: int = DEFAULT_SWA_EVICTION_INTERVAL,
) -> CapacityRow:
    common = dict(
        num_full_layers=shape.num_full_layers,
        num_swa_layers=shape.num_swa_layers,
        full_token_bytes=shape.full_token_bytes,
        swa_token_bytes=shape.swa_token_bytes,
        kv_cache_bytes=kv_cache_bytes,
        page_size=page_size,
    )
    w = shape.sliding_window_size
    fit = dict(sliding_window_size=w, swa_eviction_interval=swa_eviction_interval)
    single = plan_single_pool(**common)
    fixed = plan_pools(**common, sliding_window_size=w, swa_full_tokens_ratio=0.8)
    r = auto_swa_full_tokens_ratio(
        **common,
        sliding_window_size=w,
        expected_seq_len=seq_len,
        chunked_prefill_size=chunked_prefill_size,
        swa_eviction_interval=swa_eviction_interval,
    )
    auto = plan_pools(**common, sliding_window_size=w, swa_full_tokens_ratio=r)
    single_pool = requests_that_fit(single, seq_len, **fit)
    treatment, anchor_w = SGLANG_TREATMENT.get(model, ("one pool", 0))
    sglang = single_pool
    if treatment == "two pools":
        anchor = plan_pools(**common, sliding_window_size=anchor_w, swa_full_tokens_ratio=0.8)
        sglang = requests_that_fit(
            anchor,
            seq_len,
            sliding_window_size=anchor_w,
            swa_eviction_interval=swa_eviction_interval,
        )
    return CapacityRow(
        model=model,
        seq_len=seq_len,
        single_pool=single_pool,
        ratio_0_8=requests_that_fit(fixed, seq_len, **fit),
        auto=requests_that_fit(auto, seq_len, **fit),
        auto_ratio=r,
        bound=request_bound(
            shape,
            seq_len,
            kv_cache_bytes,
            page_size=page_size,
            swa_eviction_interval=swa_eviction_interval,
        ),
        sglang=sglang,
    )


def capacity_table(
    kv_cache_bytes: int,
    seq_lens: list[int],
    *,
    page_size: int = 1,
    chunked_prefill_size: int | None = 8192,
    tp_size: int = 1,
) -> list[CapacityRow]:
    """Rows for every model × sequence length; `kv_cache_bytes` is one rank's KV budget."""
    return [
        capacity_row(
            name,
            shape,
            t,
            kv_cache_bytes,
            page_size=page_size,
            chunked_prefill_size=chunked_prefill_size,
        )
        for name, shape in model_shapes(tp_size).items()
        for t in seq_lens
    ]


def format_table(rows: list[CapacityRow], kv_cache_bytes: int) -> str:
    lines = [
        f"KV budget {kv_cache_bytes / 1e9:.0f} GB, bf16; concurrent requests that fit "
        "(fraction of the bound in parentheses)",
        f"{'model':<15} {'seq_len':>8} {'single pool':>16} {'r=0.8':>16} {'sglang':>16} "
        f"{'auto (r)':>26} {'bound':>7}",
    ]
    for row in rows:

        def cell(n: int, row: CapacityRow = row) -> str:
            return f"{n} ({n / row.bound:.2f})"

        auto = f"{cell(row.auto)} r={row.auto_ratio:.4f}"
        lines.append(
            f"{row.model:<15} {row.seq_len:>8} {cell(row.single_pool):>16} {cell(row.ratio_0_8):>16} "
            f"{cell(row.sglang):>16} {auto:>26} {row.bound:>7}"
        )
    lines.append("")
    for row in rows:
        lines.append(
            f"{row.model} @ {row.seq_len}: auto / single pool = {row.auto / row.single_pool:.2f}x, "
            f"r=0.8 / single pool = {row.ratio_0_8 / row.single_pool:.2f}x, "
            f"auto / sglang = {row.auto / max(row.sglang, 1):.2f}x"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-gb", type=float, default=80.0, help="KV budget in GB (1e9 bytes)"
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--chunked-prefill-size", type=int, default=8192)
    parser.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks: the budget is per rank, each rank holds its share of the KV heads",
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def run(args: argparse.Namespace) -> int:
    budget = int(args.kv_cache_gb * 1e9)
    rows = capacity_table(
        budget,
        args.seq_lens,
        page_size=args.page_size,
        chunked_prefill_size=args.chunked_prefill_size,
        tp_size=args.tp_size,
    )
    if args.tp_size > 1:
        print(f"TP = {args.tp_size}: the budget is per rank; tokens are the whole group's")
    print(format_table(rows, budget))
    if args.json:
        print(json.dumps({"kv_cache_bytes": budget, "results": [r.as_json() for r in rows]}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
