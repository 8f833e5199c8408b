"""Host overhead of one engine step: a near-null model (hidden 16, 2 layers) with 1 / 64 / 256
running decodes, milliseconds per step split into schedule, input build, model, sample and
postprocess (the engine's own phase timers), and the host share — everything but the model.

The baseline is the model's own time in the same steps: `host / model` says how much of a step
the engine adds around the forward; the goal is host <= 1 ms per step at 256 running on a 2-core
CPU. Runs alternate between batch sizes and the best (lowest host) of `--repeats` is reported.

    python bench/step_overhead.py [--json] [--steps 200] [--repeats 3] [--batches 1,64,256]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.models.tiny import make_tiny_model
from swaserve.worker.stats import STEP_PHASES

WINDOW = 16
PROMPT_TOKENS = 8


def measure(model_dir: str, batch: int, steps: int) -> dict[str, float]:
    """Per-step milliseconds of each phase over `steps` pure-decode steps of `batch` requests."""
    engine = Engine(
        EngineConfig(
            model=model_dir,
            max_total_tokens=batch * (PROMPT_TOKENS + steps + 64) + 1024,
            swa_full_tokens_ratio=1.0,  # every running window fits: no retraction
            max_running_requests=max(batch, 1),
            chunked_prefill_size=8192,
            max_prefill_tokens=8192,
            check_on_idle=False,
        )
    )
    params = SamplingParams(temperature=0, max_new_tokens=steps + 32, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(i * 13 + j) % 250 + 1 for j in range(PROMPT_TOKENS)], params)
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
    ms = {p: (engine.stats.step_time_s[p] - before[p]) * 1e3 / steps for p in STEP_PHASES}
    ms["host"] = sum(v for p, v in ms.items() if p != "model")
    ms["total"] = ms["host"] + ms["model"]
    engine.shutdown()
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(
            make_tiny_model(
                tmp, arch="gpt-oss", num_layers=2, hidden_size=16, sliding_window_size=WINDOW
            )
        )
        best: dict[int, dict[str, float]] = {}
        for _ in range(args.repeats):
            for b in batches:
                ms = measure(model_dir, b, args.steps)
                if b not in best or ms["host"] < best[b]["host"]:
                    best[b] = ms
    load = os.getloadavg()[0]
    print(
        f"ms per step, best of {args.repeats} (load average {load:.2f}, {args.threads} thread(s))"
    )
    header = ["running", *STEP_PHASES, "host", "host/model"]
    print("  ".join(f"{h:>11}" for h in header))
    for b in batches:
        ms = best[b]
        cells = [f"{b:>11}", *(f"{ms[p]:>11.3f}" for p in (*STEP_PHASES, "host"))]
        cells.append(f"{ms['host'] / ms['model']:>11.2f}")
        print("  ".join(cells))
    top = best[batches[-1]]
    print(f"host at {batches[-1]} running: {top['host']:.3f} ms (goal <= 1 ms)")
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


if __name__ == "__main__":
    main()
