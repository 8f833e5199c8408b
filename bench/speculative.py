"""Speculative decoding (n-gram and MTP drafts) against plain decoding, side by side in one
process, `Engine.step()` timed.

What drafts buy is set by how often they are accepted, and that is set by the model and the
workload: a model rewriting a file it was given (a code edit, an agent re-emitting its context)
copies long runs that n-gram drafts propose exactly. Random weights copy nothing, so the bench
runs two tiny GPT-OSS models (vocab 1024, hidden 256, 6 layers, W = 32, 4 experts top-2,
float32: the `bench/decode.py` shapes) that bound it:

    repeating  attention outputs zeroed: greedy decoding is a fixed next-token map, so the model
               continues any text it wrote before exactly as it did (the best case: every
               draft taken from that text is right)
    random     as made: it never repeats its earlier text (the worst case: drafts are proposed
               where its own n-grams recur and almost never accepted; what they cost shows)
    mtp        a tiny MiMo-V2-Flash of the same shapes (6 layers, hidden 256) with its three
               MTP depths, drafting with them (`speculative_method="mtp"`): random weights
               accept almost nothing, so what shows is what the drafts cost per step

Workload, a rewrite: per request a seed of 8 random tokens, the file = the model's own greedy
continuation of it (96 tokens, made before timing), and the prompt = seed + file + seed (the
rewrite begins). Per batch size B, B such prompts generate --new-tokens greedy tokens each on
both engines (plain, and `speculative_method="ngram"` with k = --k), alternating, --repeats
times each, the same fresh prompts for both in a repeat; the best run of each counts:

    decode tok/s      tokens emitted by the steps after every request has its first token,
                      over those steps' time
    speedup           drafting decode tok/s / plain decode tok/s
    acceptance_len    tokens a verify emits per request: 1 + accepted drafts / verifies
    draft_accept      accepted / proposed drafts
    verify_step_ratio median step with drafts / median plain decode step (what verifying up to
                      k drafts per request, and with MTP making the next step's, costs against
                      decoding one token)
    position_cost     verify_step_ratio / the positions a step verifies per request (1 + the
                      drafts it verifies): the cost of one verified position against a plain
                      decode step
    draft_share       MTP: the time of the draft forwards / the target forwards' (`draft` and
                      `model` phases of `EngineStats.step_time_s`)
    same_tokens       greedy tokens of the two engines equal in every repeat

Both engines run eagerly (the CPU default) unless --compile: then both run the compiled decode
step, which takes the steps that verify drafts too when no prefill shares them (each draft is a
decode row of its own), and MTP's depth forwards run the compiled draft step.

    python bench/speculative.py [--json] [--quick] [--compile] [--batches 1,8,32] [--k 3] [--models repeating,random,mtp]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from decode import make_model as make_decode_bench_model
from safetensors.torch import load_file, save_file

from swaserve.worker import Engine, EngineConfig, SamplingParams

METHODS = {"repeating": "ngram", "random": "ngram", "mtp": "mtp"}


def make_model(root: Path, kind: str) -> Path:
    """The decode bench's tiny GPT-OSS (`repeating`: its attention output projections zeroed),
    or its tiny MiMo-V2-Flash with MTP depths (`mtp`)."""
    if kind == "mtp":
        return make_decode_bench_model(root / kind, "mimo-v2-flash")
    path = make_decode_bench_model(root / kind, "gpt-oss")
    if kind == "repeating":
        weights = load_file(path / "model.safetensors")
        for name, tensor in weights.items():
            if ".self_attn.o_proj." in name:
                tensor.zero_()
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def engine(model: Path, k: int | None, compile_: bool, method: str = "ngram") -> Engine:
    return Engine(
        EngineConfig(
            model=str(model),
            device="cpu",
            max_total_tokens=65536,
            max_running_requests=160,
            check_on_idle=False,
            compile=compile_,
            speculative_method=None if k is None else method,
            num_speculative_tokens=k or 3,
        )
    )


def rewrite_prompts(eng: Engine, batch: int, seed: int) -> list[list[int]]:
    """`batch` rewrite prompts (module docstring), the files written by `eng` (plain)."""
    rng = random.Random(seed)
    seeds = [[rng.randrange(1, 1000) for _ in range(8)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_new_tokens=96, ignore_eos=True)
    files = [out.token_ids for out in eng.generate(seeds, params)]
    return [s + f + s for s, f in zip(seeds, files, strict=True)]


def run_batch(
    eng: Engine, prompts: list[list[int]], new_tokens: int
) -> tuple[dict[str, float], list[list[int]], list[float]]:
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    ids = [eng.add_request(prompt, params) for prompt in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    decode_s, decoded, steps = 0.0, 0, []
    stats = eng.stats
    before = (stats.spec_verifies, stats.spec_draft_tokens, stats.spec_accepted_tokens)
    phases = dict(stats.step_time_s)
    while eng.has_unfinished_requests():
        started = all(tokens.values())
        start = time.perf_counter()
        outs = eng.step()
        took = time.perf_counter() - start
        if started:
            decode_s += took
            decoded += sum(len(o.new_token_ids) for o in outs)
            steps.append(took)
        for out in outs:
            tokens[out.request_id].extend(out.new_token_ids)
    verifies, drafts, accepted = (
        after - b
        for after, b in zip(
            (stats.spec_verifies, stats.spec_draft_tokens, stats.spec_accepted_tokens),
            before,
            strict=True,
        )
    )
    spent = {p: stats.step_time_s[p] - phases[p] for p in ("model", "draft")}
    figures = {
        "decode_tok_s": decoded / decode_s,
        "acceptance_len": 1 + accepted / verifies if verifies else 1.0,
        "draft_accept": accepted / drafts if drafts else 0.0,
        "verified_positions": 1 + drafts / verifies if verifies else 1.0,
        "draft_share": spent["draft"] / spent["model"],
    }
    return figures, [tokens[i] for i in ids], steps


def bench_batch(plain: Engine, spec: Engine, batch: int, args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "spec": []}
    steps: dict[str, list[float]] = {"plain": [], "spec": []}
    tokens: dict[str, list[list[int]]] = {"plain": [], "spec": []}
    for repeat in range(args.repeats):
        prompts = rewrite_prompts(plain, batch, batch * 1000 + repeat)
        for side, eng in (("plain", plain), ("spec", spec)):
            figures, toks, took = run_batch(eng, prompts, args.new_tokens)
            runs[side].append(figures)
            tokens[side].extend(toks)
            steps[side].extend(took)
    best = {side: max(r, key=lambda f: f["decode_tok_s"]) for side, r in runs.items()}
    differing = sum(a != b for a, b in zip(tokens["plain"], tokens["spec"], strict=True))
    ratio = statistics.median(steps["spec"]) / statistics.median(steps["plain"])
    return {
        "plain_decode_tok_s": best["plain"]["decode_tok_s"],
        "spec_decode_tok_s": best["spec"]["decode_tok_s"],
        "speedup": best["spec"]["decode_tok_s"] / best["plain"]["decode_tok_s"],
        "acceptance_len": statistics.mean(r["acceptance_len"] for r in runs["spec"]),
        "draft_accept": statistics.mean(r["draft_accept"] for r in runs["spec"]),
        "verify_step_ratio": ratio,
        "position_cost": ratio / statistics.mean(r["verified_positions"] for r in runs["spec"]),
        "draft_share": statistics.mean(r["draft_share"] for r in runs["spec"]),
        "same_tokens": differing == 0,
        "differing_requests": differing,
        "requests": len(tokens["plain"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, one repeat")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--models", default="repeating,random,mtp")
    parser.add_argument(
        "--compile", action="store_true", help="both engines with the compiled decode step"
    )
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        batches, args.repeats, args.new_tokens = [1, 8], 1, 48
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {
        "k": args.k,
        "threads": args.threads,
        "compile": args.compile,
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            model = make_model(Path(tmp), kind)
            plain = engine(model, None, args.compile)
            spec = engine(model, args.k, args.compile, METHODS[kind])
            rows: dict[str, Any] = results["models"].setdefault(kind, {})
            try:
                for batch in batches:
                    row = rows[str(batch)] = bench_batch(plain, spec, batch, args)
                    print(
                        f"{kind:9s} batch {batch:3d}: plain {row['plain_decode_tok_s']:7.1f} "
                        f"tok/s, {METHODS[kind]} {row['spec_decode_tok_s']:7.1f} tok/s, speedup "
                        f"{row['speedup']:.2f}x, acceptance length {row['acceptance_len']:.2f}, "
                        f"drafts accepted {row['draft_accept']:.2f}, verify step / plain step "
                        f"{row['verify_step_ratio']:.2f} ({row['position_cost']:.2f} per "
                        f"verified position), drafting / target forwards "
                        f"{row['draft_share']:.2f}, same tokens {row['same_tokens']}",
                        flush=True,
                    )
            finally:
                plain.shutdown()
                spec.shutdown()
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
