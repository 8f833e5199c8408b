"""Decode at small batches: the compiled decode step (`EngineConfig(compile=True)`) against the
eager one, on the same model, in the same process, `Engine.step()` timed.

Models (tiny, random, written by the tiny-model maker): GPT-OSS and MiMo-V2-Flash shapes of
vocab 1024, hidden 256, 6 layers (W = 32), 4 experts top-2, float32. Per batch size B, B prompts
of --prompt-len tokens generate --new-tokens greedy tokens each:

    prefill tok/s   prompt tokens / time of the steps until every request has its first token
    decode step ms  median of the steps after that (all B requests decoding)
    decode tok/s    B / decode step

Eager and compiled runs alternate, --repeats times each, on the same fresh prompts (no prefix
hit); the best run of each counts (a busy machine slows both alike). The greedy tokens of the
two should be equal in every repeat (`same_tokens`; `differing_requests` of `requests` counts
those that are not); the two steps add in different orders, so a token whose
MoE router scores two experts within float rounding of each other may pick either expert and
the request's tokens part from there (seen once: GPT-OSS, batch 24, 1 of 24 requests from its
32nd token, where transformers' router logits put layer 1's 2nd and 3rd experts 2.3e-6 apart;
it is the prompts of seed 24001, the second repeat).

Start-up: the compile is paid when the engine starts (it compiles its decode graphs before the
first request). `compile_cold_s` is that extra start-up time in a new process with an empty
inductor cache; `compile_cached_s` the same in a second new process over the cache the first one
left (what a second `swaserve serve` pays).

    python bench/decode.py [--json] [--quick] [--batches 1,8,24,64] [--archs gpt-oss,mimo-v2-flash]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.models.tiny import make_tiny_model

GOALS = {1: 2.9, 8: 2.6, 24: 2.0}  # decode speed-up goals of this bench on a 2-core CPU


def make_model(root: Path, arch: str) -> Path:
    return make_tiny_model(
        root / arch,
        arch,
        num_layers=6,
        sliding_window_size=32,
        num_heads=4,
        num_kv_heads=2,
        hidden_size=256,
        vocab_size=1024,
        num_experts=4,
        num_experts_per_tok=2,
    )


def engine(model: Path, compile_: bool) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model),
            device="cpu",
            max_total_tokens=65536,
            max_running_requests=64,
            check_on_idle=False,
            compile=compile_,
        )
    )


def timed_start(model: Path, compile_: bool) -> tuple[Engine, float]:
    start = time.perf_counter()
    eng = engine(model, compile_)
    return eng, time.perf_counter() - start


def run_batch(
    eng: Engine, batch: int, prompt_len: int, new_tokens: int, seed: int
) -> tuple[dict[str, float], list[list[int]]]:
    """`batch` new prompts (fresh per `seed`: a repeat must not hit the prefix cache, which
    would turn its prefill into one-token steps)."""
    rng = random.Random(seed)
    ids = []
    for _ in range(batch):
        prompt = [rng.randrange(1, 1000) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
        ids.append(eng.add_request(prompt, params))
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    prefill_s, decode_steps = 0.0, []
    while eng.has_unfinished_requests():
        started = sum(1 for t in tokens.values() if t)
        running = sum(1 for t in tokens.values() if 0 < len(t) < new_tokens)
        start = time.perf_counter()
        outs = eng.step()
        took = time.perf_counter() - start
        if started < batch:
            prefill_s += took
        elif running == batch:
            decode_steps.append(took)
        for out in outs:
            tokens[out.request_id].extend(out.new_token_ids)
    decode_steps.sort()
    step = decode_steps[len(decode_steps) // 2]
    figures = {
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "decode_step_ms": step * 1e3,
        "decode_tok_s": batch / step,
    }
    return figures, [tokens[i] for i in ids]


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    fastest = min(runs, key=lambda r: r["decode_step_ms"])
    return {
        "decode_step_ms": fastest["decode_step_ms"],
        "decode_tok_s": fastest["decode_tok_s"],
        "prefill_tok_s": max(r["prefill_tok_s"] for r in runs),
    }


def startup_probe(model: Path) -> None:
    """Child process: the start-up of an eager and a compiled engine, on the inherited cache."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    _, eager_s = timed_start(model, False)
    _, compiled_s = timed_start(model, True)
    print(json.dumps({"eager_s": eager_s, "compiled_s": compiled_s}))


def probe_startup(model: Path, cache: Path, threads: int) -> float:
    """Seconds the compile adds to an engine's start, in a new process over `cache`."""
    probe = subprocess.run(
        [sys.executable, __file__, "--startup-probe", str(model)],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, BENCH_THREADS=str(threads), TORCHINDUCTOR_CACHE_DIR=str(cache)),
    )
    times = json.loads(probe.stdout.strip().splitlines()[-1])
    return float(times["compiled_s"] - times["eager_s"])


def bench_arch(arch: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    model = make_model(root, arch)
    cache = root / f"inductor-{arch}"  # the arch's own: cold is cold, one model per process
    out: dict[str, Any] = {
        "compile_cold_s": probe_startup(model, cache, args.threads),
        "compile_cached_s": probe_startup(model, cache, args.threads),
        "batches": {},
    }
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    eager, compiled = engine(model, False), engine(model, True)
    for batch in args.batches:
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        tokens: dict[bool, list[list[int]]] = {False: [], True: []}  # every repeat's requests
        for repeat in range(args.repeats):
            for compile_, eng in ((False, eager), (True, compiled)):
                seed = batch * 1000 + repeat
                figures, toks = run_batch(eng, batch, args.prompt_len, args.new_tokens, seed)
                runs[compile_].append(figures)
                tokens[compile_].extend(toks)
        e, c = best(runs[False]), best(runs[True])
        differing = sum(a != b for a, b in zip(tokens[False], tokens[True], strict=True))
        out["batches"][batch] = {
            "eager": e,
            "compiled": c,
            "decode_speedup": e["decode_step_ms"] / c["decode_step_ms"],
            "prefill_ratio": c["prefill_tok_s"] / e["prefill_tok_s"],
            "same_tokens": differing == 0,
            "differing_requests": differing,
            "requests": len(tokens[False]),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--quick", action="store_true", help="one arch, batches 1 and 8")
    parser.add_argument("--batches", default="1,8,24,64")
    parser.add_argument("--archs", default="gpt-oss,mimo-v2-flash")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--startup-probe", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.startup_probe is not None:
        startup_probe(args.startup_probe)
        return
    args.batches = [int(b) for b in args.batches.split(",")]
    archs = args.archs.split(",")
    if args.quick:
        args.batches, archs, args.repeats, args.new_tokens = [1, 8], archs[:1], 1, 12
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results = {arch: bench_arch(arch, root, args) for arch in archs}
    load = os.getloadavg()[0]
    for arch, res in results.items():
        print(
            f"{arch}: compile at start {res['compile_cold_s']:.1f} s cold, "
            f"{res['compile_cached_s']:.1f} s cached"
        )
        print("  batch  eager ms  compiled ms  speed-up  goal  prefill ratio  same tokens")
        for batch, r in res["batches"].items():
            goal = GOALS.get(batch)
            print(
                f"  {batch:5d}  {r['eager']['decode_step_ms']:8.2f}  "
                f"{r['compiled']['decode_step_ms']:11.2f}  {r['decode_speedup']:7.2f}×  "
                f"{'' if goal is None else f'{goal:.1f}×':>4}  {r['prefill_ratio']:12.2f}×  "
                f"{r['same_tokens']} ({r['differing_requests']} of {r['requests']} differ)"
            )
    print(f"load average at the end: {load:.2f}")
    if args.json:
        print(json.dumps({"results": results, "load_avg": load, "threads": args.threads}))


if __name__ == "__main__":
    main()
