"""Decode throughput at TP = 1 and TP = 2 on the same model and batch, and where TP's time goes.

TP = 2 runs rank 1 in a spawned process (gloo on CPU, NCCL on CUDA). For each run: decode
tokens/s over `--steps` pure-decode steps of `--batch` requests, the share of the step spent in
the model's collectives (all-reduce / all-gather, measured on rank 0, which includes waiting for
the other rank) and in the broadcast of each step's `ModelInput`. Runs alternate TP = 1 / TP = 2,
best of `--repeats` each. On a 2-core CPU the two ranks share the cores, so TP = 2 is slower
here: the figure to watch is the share of communication and broadcast, not the speed-up.

    python bench/tp.py [--json] [--batch 16] [--steps 40] [--hidden 128] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.models.tiny import make_tiny_model


def measure(model_dir: str, tp_size: int, args: argparse.Namespace) -> dict[str, float]:
    engine = Engine(
        EngineConfig(
            model=model_dir,
            max_total_tokens=args.batch * (args.prompt_len + args.steps + 64) + 512,
            swa_full_tokens_ratio=0.5,
            max_running_requests=args.batch,
            tp_size=tp_size,
            check_on_idle=False,
        )
    )
    try:
        params = SamplingParams(temperature=0, max_new_tokens=args.steps + 40, ignore_eos=True)
        for i in range(args.batch):
            engine.add_request([(i * 7 + j) % 250 + 1 for j in range(args.prompt_len)], params)
        while engine.scheduler.waiting or not all(r.is_decoding for r in engine.scheduler.running):
            engine.step()
        for _ in range(4):
            engine.step()
        tp = engine.runner.tp
        comm0, control0 = tp.comm_time_s, tp.control_time_s
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        elapsed = time.perf_counter() - start
        return {
            "decode_tok_s": args.batch * args.steps / elapsed,
            "ms_per_step": elapsed * 1e3 / args.steps,
            "comm_share": (tp.comm_time_s - comm0) / elapsed,
            "broadcast_share": (tp.control_time_s - control0) / elapsed,
        }
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(
            make_tiny_model(
                tmp,
                arch="gpt-oss",
                num_layers=args.layers,
                hidden_size=args.hidden,
                num_heads=8,
                num_kv_heads=2,
                sliding_window_size=32,
            )
        )
        best: dict[int, dict[str, float]] = {}
        for _ in range(args.repeats):
            for tp_size in (1, 2):
                run = measure(model_dir, tp_size, args)
                if tp_size not in best or run["decode_tok_s"] > best[tp_size]["decode_tok_s"]:
                    best[tp_size] = run
    load = os.getloadavg()[0]
    print(f"decode, batch {args.batch}, best of {args.repeats} (load average {load:.2f})")
    print(f"{'tp':>4} {'tok/s':>10} {'ms/step':>9} {'collectives':>12} {'broadcast':>10}")
    for tp_size, run in best.items():
        print(
            f"{tp_size:>4} {run['decode_tok_s']:>10.1f} {run['ms_per_step']:>9.2f} "
            f"{run['comm_share']:>11.1%} {run['broadcast_share']:>10.1%}"
        )
    ratio = best[2]["decode_tok_s"] / best[1]["decode_tok_s"]
    print(f"ratio (TP = 2 / TP = 1): {ratio:.2f}x decode tokens/s")
    if args.json:
        print(
            json.dumps(
                {"load_average": load, "tp": {str(k): v for k, v in best.items()}, "ratio": ratio}
            )
        )


if __name__ == "__main__":
    main()
