"""Structured output's cost to decode: the same engine decodes a batch of B requests free, then
the same batch with half of its rows constrained by a JSON schema, alternating, in one process.

Model: the decode bench's tiny random GPT-OSS (`decode.make_model`) (vocab 1024, hidden 256, 6 layers, W = 32) with
the byte-level tokenizer of the tiny-model maker. Every request samples (temperature 1, its
own seed) --new-tokens tokens with ignore_eos; the constrained ones follow a schema whose
string must be long (`minLength`), so they decode for as long as the free ones and the batch
stays whole. Per run:

    decode step ms   median of the steps while all B requests decode
    decode tok/s     B / decode step

The ratio is constrained tok/s over free tok/s (goal: ≥ 0.9 at B = 8 and 32), best run of each
of --repeats. The grammar's masks are filled on a thread while the forward runs and applied on
the logits' device to the constrained rows only; `compile_ms` is the one compile of the schema
(cached for every later request), `mask_us` the mean time to fill one row's mask.

    python bench/structured_output.py [--json] [--quick] [--batches 8,32]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from decode import make_model

from swaserve.proto import SamplingParams, StructuredOutputs
from swaserve.worker import Engine, EngineConfig

GOAL = 0.9

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 2000},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "score": {"type": "integer"},
    },
    "required": ["title", "tags", "score"],
    "additionalProperties": False,
}


def run(
    eng: Engine, batch: int, constrained: bool, prompt_len: int, new_tokens: int, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    ids = []
    for i in range(batch):
        prompt = [rng.randrange(1, 250) for _ in range(prompt_len)]
        spec = StructuredOutputs(json_schema=SCHEMA) if constrained and i % 2 else None
        params = SamplingParams(
            temperature=1.0,
            seed=seed * 1000 + i,
            max_new_tokens=new_tokens,
            ignore_eos=True,
            structured_outputs=spec,
        )
        ids.append(eng.add_request(prompt, params))
    counts = dict.fromkeys(ids, 0)
    steps = []
    while eng.has_unfinished_requests():
        decoding = sum(1 for n in counts.values() if 0 < n < new_tokens)
        start = time.perf_counter()
        outs = eng.step()
        took = time.perf_counter() - start
        if decoding == batch:
            steps.append(took)
        for out in outs:
            counts[out.request_id] += len(out.new_token_ids)
    assert all(n == new_tokens for n in counts.values()), counts
    steps.sort()
    step = steps[len(steps) // 2]
    return {"decode_step_ms": step * 1e3, "decode_tok_s": batch / step}


def mask_fill_us(eng: Engine, rows: int = 200) -> float:
    """Mean µs to fill one row's mask at the schema's start (where it allows the most)."""
    from swaserve.worker.engine.grammar import GrammarMatcher

    compiled = eng.grammar.submit(StructuredOutputs(json_schema=SCHEMA)).result()
    matchers = [GrammarMatcher(compiled) for _ in range(rows)]
    start = time.perf_counter()
    eng._fill_masks(list(enumerate(matchers)))
    return (time.perf_counter() - start) / rows * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="batch 8, 1 repeat, 16 tokens")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.repeats, args.new_tokens = "8", 1, 16
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, Any] = {"goal": GOAL, "batches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp), "gpt-oss")
        eng = Engine(
            EngineConfig(
                model=str(model),
                max_total_tokens=65536,
                max_running_requests=64,
                check_on_idle=False,
            )
        )
        try:
            start = time.perf_counter()
            eng.grammar.submit(StructuredOutputs(json_schema=SCHEMA)).result()
            results["compile_ms"] = (time.perf_counter() - start) * 1e3
            results["mask_us"] = mask_fill_us(eng)
            seed = 0
            for batch in batches:
                free, constrained = [], []
                run(eng, batch, False, args.prompt_len, 4, seed)  # warm this batch's shapes
                for _ in range(args.repeats):
                    for runs, flag in ((free, False), (constrained, True)):
                        seed += 1
                        runs.append(run(eng, batch, flag, args.prompt_len, args.new_tokens, seed))
                a = min(free, key=lambda r: r["decode_step_ms"])
                b = min(constrained, key=lambda r: r["decode_step_ms"])
                results["batches"][batch] = {
                    "free": a,
                    "half_constrained": b,
                    "ratio": b["decode_tok_s"] / a["decode_tok_s"],
                }
            eng.check()
        finally:
            eng.shutdown()
    if args.json:
        print(json.dumps(results))
        return
    print(
        f"schema compile {results['compile_ms']:.1f} ms, mask fill {results['mask_us']:.0f} µs/row"
    )
    for batch, r in results["batches"].items():
        print(
            f"batch {batch:3d}: free {r['free']['decode_tok_s']:8.1f} tok/s, half constrained "
            f"{r['half_constrained']['decode_tok_s']:8.1f} tok/s, ratio {r['ratio']:.3f} "
            f"(goal ≥ {GOAL})"
        )


if __name__ == "__main__":
    main()
