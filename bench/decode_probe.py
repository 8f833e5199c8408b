"""One engine's decode step, timed: the part of `bench/decode.py` that also runs on another
revision's code (`--against`), so it uses only the engine API every revision has (`Engine`,
`EngineConfig`, `SamplingParams`).

    python bench/decode_probe.py MODEL BATCH ROUNDS compiled|eager

prints one JSON line: the best of ROUNDS batches' median decode step (after a warm batch), a
digest of their greedy tokens and the file the engine was imported from.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams


def engine(model: Path, compile_: bool | str) -> Engine:
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


def step_probe(model: Path, batch: int, rounds: int, compile_: bool) -> None:
    """Child process (`--against`): the median decode step of `batch` requests, best of
    `rounds` fresh batches after a warm one, and a digest of the greedy tokens; only the
    engine API every revision has."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    eng = engine(model, compile_)
    steps, tokens = [], []
    for repeat in range(rounds + 1):
        figures, toks = run_batch(eng, batch, 128, 40, seed=batch * 1000 + repeat)
        if repeat:
            steps.append(figures["decode_step_ms"])
            tokens.append(toks)
    eng.shutdown()
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    code = sys.modules[Engine.__module__].__file__  # whose code ran
    print(json.dumps({"step_ms": min(steps), "tokens": digest, "engine_file": code}))


if __name__ == "__main__":
    model, batch, rounds, mode = sys.argv[1:]
    step_probe(Path(model), int(batch), int(rounds), mode == "compiled")
