"""Concurrent long requests on a fixed KV budget: the engine with hybrid pools (auto ratio)
against the same engine with `disable_hybrid_swa_memory`, both against the planner's bound.

A tiny MiMo-style model (many SWA layers, a few full ones, SWA layers with 2x the KV heads)
serves N identical-length long prompts; the peak number of requests running at once is the
capacity. The bound is what the KV budget holds if full layers keep every token and SWA layers
only `W + I + P` tokens per request (`request_bound`).

    python bench/capacity.py [--json] [--kv-mib 24] [--prompt-len 512] [--new-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.kv.pool_plan import request_bound
from swaserve.worker.models.tiny import make_tiny_model


def peak_running(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[int, int]:
    """Submit all prompts, run to completion; (peak running requests, steps)."""
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    peak = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, engine.headroom().num_running)
    return peak, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kv-mib", type=float, default=24.0, help="KV budget in MiB")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256, help="chunked prefill size")
    parser.add_argument("--interval", type=int, default=16, help="SWA eviction interval I")
    parser.add_argument("--requests", type=int, default=0, help="default: 1.1x the bound")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as tmp:
        # 1 full + 5 SWA layers per group of 6, as in MiMo-V2-Flash; SWA KV heads = 2x full.
        layer_types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(12)]
        model = make_tiny_model(
            tmp,
            arch="mimo-v2-flash",
            num_layers=12,
            sliding_window_size=args.window,
            hidden_size=32,
            num_heads=4,
            num_kv_heads=1,
            layer_types=layer_types,
            seed=0,
        )
        budget = int(args.kv_mib * 2**20)
        common = dict(
            model=str(model),
            kv_cache_bytes=budget,
            chunked_prefill_size=args.chunk,
            max_prefill_tokens=16384,
            max_running_requests=1024,
            swa_eviction_interval=args.interval,
            enable_prefix_cache=True,
        )
        seq_len = args.prompt_len + args.new_tokens
        hybrid = Engine(
            EngineConfig(**common, swa_full_tokens_ratio="auto", expected_seq_len=seq_len)  # type: ignore[arg-type]
        )
        shape = hybrid.model_config.kv_spec().layer_shape(torch.float32)
        bound = request_bound(shape, seq_len, budget, swa_eviction_interval=args.interval)
        n = args.requests or int(bound * 1.1) + 1
        prompts = [[(i * 7 + j) % 250 + 1 for j in range(args.prompt_len)] for i in range(n)]

        t0 = time.perf_counter()
        hybrid_peak, hybrid_steps = peak_running(hybrid, prompts, args.new_tokens)
        hybrid_s = time.perf_counter() - t0
        hybrid_plan = hybrid.plan
        hybrid.shutdown()

        single = Engine(EngineConfig(**common, disable_hybrid_swa_memory=True))  # type: ignore[arg-type]
        t0 = time.perf_counter()
        single_peak, single_steps = peak_running(single, prompts, args.new_tokens)
        single_s = time.perf_counter() - t0
        single_plan = single.plan
        single.shutdown()

    result = {
        "kv_cache_bytes": budget,
        "seq_len": seq_len,
        "requests": n,
        "bound": bound,
        "hybrid_peak_running": hybrid_peak,
        "single_pool_peak_running": single_peak,
        "hybrid_vs_single": round(hybrid_peak / max(single_peak, 1), 3),
        "hybrid_of_bound": round(hybrid_peak / bound, 3),
        "hybrid_full_tokens": hybrid_plan.full_tokens,
        "hybrid_swa_tokens": hybrid_plan.swa_tokens,
        "single_pool_tokens": single_plan.full_tokens,
        "hybrid_steps": hybrid_steps,
        "single_pool_steps": single_steps,
        "hybrid_s": round(hybrid_s, 2),
        "single_pool_s": round(single_s, 2),
    }
    print(
        f"KV budget {budget / 2**20:.1f} MiB, {n} requests of {seq_len} tokens (W={args.window}, I={args.interval})"
    )
    print(
        f"  hybrid pools (auto r): full {hybrid_plan.full_tokens} + SWA {hybrid_plan.swa_tokens} tokens"
    )
    print(f"  single pool:           {single_plan.full_tokens} tokens")
    print(f"  peak running: hybrid {hybrid_peak}, single pool {single_peak}, bound {bound}")
    print(
        f"  hybrid / single pool = {result['hybrid_vs_single']:.2f}x; hybrid / bound = {result['hybrid_of_bound']:.2f}"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
