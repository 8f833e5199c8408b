"""Host overhead of one engine step: a near-null model (hidden 16, 2 layers) with 1 / 64 / 256
running decodes, milliseconds per step split into schedule, input build, model, sample and
postprocess (the engine's own phase timers), and the host share — everything but the model.

The baseline is the model's own time in the same steps: `host / model` says how much of a step
the engine adds around the forward; the goal is host <= 1 ms per step at 256 running on a 2-core
CPU. Runs alternate between batch sizes and the best (lowest host) of `--repeats` is reported.

`--churn` measures serving instead of a still batch: each request asks for a random 0.5-1.5 ×
`--steps` tokens and is replaced by a new one when it finishes, so most steps also admit,
prefill and finish requests (the prefix cache inserts each finished one).

    python bench/step_overhead.py [--json] [--churn] [--steps 200] [--repeats 3] [--batches 1,64,256]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.engine.stats import STEP_PHASES
from swaserve.worker.models.tiny import make_tiny_model

WINDOW = 16
PROMPT_TOKENS = 8


def make_engine(model_dir: str, batch: int, max_new_tokens: int) -> Engine:
    return Engine(
        EngineConfig(
            model=model_dir,
            max_total_tokens=batch * (PROMPT_TOKENS + max_new_tokens + 64) + 1024,
            swa_full_tokens_ratio=1.0,  # every running window fits: no retraction
            max_running_requests=max(batch, 1),
            chunked_prefill_size=8192,
            max_prefill_tokens=8192,
            check_on_idle=False,
        )
    )


def prompt(i: int) -> list[int]:
    return [(i * 13 + j) % 250 + 1 for j in range(PROMPT_TOKENS)]


def phase_ms(engine: Engine, before: dict[str, float], steps: int) -> dict[str, float]:
    ms = {p: (engine.stats.step_time_s[p] - before[p]) * 1e3 / steps for p in STEP_PHASES}
    ms["host"] = sum(v for p, v in ms.items() if p != "model")
    ms["total"] = ms["host"] + ms["model"]
    return ms


def measure(model_dir: str, batch: int, steps: int) -> dict[str, float]:
    """Per-step milliseconds of each phase over `steps` pure-decode steps of `batch` requests."""
    engine = make_engine(model_dir, batch, steps)
    params = SamplingParams(temperature=0, max_new_tokens=steps + 32, ignore_eos=True)
    for i in range(batch):
        engine.add_request(prompt(i), params)
    while not all(r.is_decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(8):  # warm up the decode path
        engine.step()
    before = dict(engine.stats.step_time_s)
    retractions = engine.stats.retractions
    for _ in range(steps):
        engine.step()
    if engine.stats.retractions != retractions or len(engine.scheduler.running) != batch:
        raise RuntimeError("the measured steps were not pure decodes of the whole batch")
    ms = phase_ms(engine, before, steps)
    engine.shutdown()
    return ms


def measure_churn(model_dir: str, batch: int, steps: int) -> dict[str, float]:
    """Per-step milliseconds of each phase over `steps` serving steps: `batch` requests of
    random lengths, each replaced when it finishes (`finished` per step is in the result)."""
    engine = make_engine(model_dir, batch, steps * 3 // 2)
    rng = random.Random(0)
    added = 0

    def add() -> None:
        nonlocal added
        n = rng.randint(max(1, steps // 2), max(1, steps * 3 // 2))
        engine.add_request(
            prompt(added), SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
        )
        added += 1

    def step() -> None:
        for out in engine.step():
            if out.finished:
                add()

    for _ in range(batch):
        add()
    for _ in range(steps):  # past the first wave: lengths and arrivals spread out
        step()
    before = dict(engine.stats.step_time_s)
    finished = engine.stats.finished_requests
    for _ in range(steps):
        step()
    ms = phase_ms(engine, before, steps)
    ms["finished"] = (engine.stats.finished_requests - finished) / steps
    engine.shutdown()
    return ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--churn", action="store_true", help="steps that admit and finish too")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return report(args)
    finally:
        torch.set_num_threads(threads)  # in-process callers keep their setting


def report(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(
            make_tiny_model(
                tmp, arch="gpt-oss", num_layers=2, hidden_size=16, sliding_window_size=WINDOW
            )
        )
        best: dict[int, dict[str, float]] = {}
        run = measure_churn if args.churn else measure
        for _ in range(args.repeats):
            for b in batches:
                ms = run(model_dir, b, args.steps)
                if b not in best or ms["host"] < best[b]["host"]:
                    best[b] = ms
    load = os.getloadavg()[0]
    kind = "serving steps (requests finish and are replaced)" if args.churn else "pure decodes"
    print(
        f"ms per step of {kind}, best of {args.repeats} "
        f"(load average {load:.2f}, {args.threads} thread(s))"
    )
    header = ["running", *STEP_PHASES, "host", "host/model"]
    print("  ".join(f"{h:>11}" for h in header))
    for b in batches:
        ms = best[b]
        cells = [f"{b:>11}", *(f"{ms[p]:>11.3f}" for p in (*STEP_PHASES, "host"))]
        cells.append(f"{ms['host'] / ms['model']:>11.2f}")
        if args.churn:
            cells.append(f"finished/step {ms['finished']:.2f}")
        print("  ".join(cells))
    top = best[batches[-1]]
    goal = "" if args.churn else " (goal <= 1 ms)"
    print(f"host at {batches[-1]} running: {top['host']:.3f} ms{goal}")
    if args.json:
        print(
            json.dumps(
                {
                    "load_average": load,
                    "ms_per_step": {str(b): best[b] for b in batches},
                    "host_over_model": {
                        str(b): best[b]["host"] / best[b]["model"] for b in batches
                    },
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
