"""What the multi-turn load benches (`cluster_load.py`, `serve_load.py`) share: their options,
percentiles, the per-variant medians, the tiny model they serve and a local Ray of their own."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import ray

from swaserve.proto.environment import cpu_auto_compile
from swaserve.worker.models.tiny import make_tiny_model


def workload_parser(
    doc: str | None, *, tokens_flag: str, tokens_help: str
) -> argparse.ArgumentParser:
    """The options of a multi-turn run; `tokens_flag` names the answer length per turn."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=5, help="clients, sessions in flight")
    parser.add_argument(tokens_flag, type=int, default=16, help=tokens_help)
    parser.add_argument(
        "--fixed-answers",
        action="store_true",
        help="every answer that long, instead of 1/2 to 3/2 of it drawn per turn (the "
        "sessions sharing a worker then end their turns in the same step, and stay in step)",
    )
    parser.add_argument("--system-tokens", type=int, default=384, help="shared system prompt")
    parser.add_argument("--user-tokens", type=int, default=128, help="mean tokens per user turn")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every variant")
    parser.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="worker replicas (TP 1 each); with N of them round robin keeps about 1/N of a "
        "session's turns on the worker of its turn before by chance",
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--window", type=int, default=32, help="W of the sliding layers")
    parser.add_argument("--max-total-tokens", type=int, default=32768, help="KV per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    return parser


def parse_workload_args(
    parser: argparse.ArgumentParser, argv: list[str] | None, *, tokens_dest: str, min_system: int
) -> argparse.Namespace:
    """Parse, refusing counts below 1 and a system prompt shorter than `min_system`."""
    args = parser.parse_args(argv)
    counts = ("sessions", "turns", "concurrency", tokens_dest, "repeats", "user_tokens", "replicas")
    for name in counts:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.system_tokens < min_system:
        parser.error(f"--system-tokens must be at least {min_system}")
    return args


def parse_variants(text: str, known: Iterable[str], what: str, plural: str) -> list[str]:
    """A comma-separated list of two or more different names out of `known` (what a bench
    compares: `what` / `plural` name them in the errors)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {unknown[0]!r}; choose from {sorted(known)}"
        )
    if len(names) < 2 or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"name at least two different {plural}")
    return names


def answer_lengths(seed: int, sessions: int, turns: int, mean: int, fixed: bool) -> list[list[int]]:
    """[session][turn] -> the answer's length: 1/2 to 3/2 of `mean`, drawn per turn from
    `seed` apart from the text (so that `fixed`, every answer `mean` long, keeps the text)."""
    if fixed:
        return [[mean] * turns for _ in range(sessions)]
    rng = random.Random(f"answers-{seed}")
    low, high = max(1, mean // 2), mean + mean // 2
    return [[rng.randint(low, high) for _ in range(turns)] for _ in range(sessions)]


def answers_text(mean: int, fixed: bool) -> str:
    """How a run's header names its answer lengths: "16", or "~16" when drawn per turn."""
    return f"{'' if fixed else '~'}{mean}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def medians(
    runs: list[dict], by: str, variants: Sequence[str], keys: tuple[str, ...]
) -> dict[str, dict]:
    """Per variant (the runs' `by` field), the median over its rounds of each figure."""
    return {
        variant: {k: statistics.median(r[k] for r in runs if r[by] == variant) for k in keys}
        for variant in variants
    }


def ratios_to(base: dict, cand: dict) -> dict[str, float]:
    """The candidate's figures over the baseline's (one run's, or medians)."""
    return {
        "tok_s": cand["tok_s"] / base["tok_s"],
        "ttft_p50": cand["ttft_p50_ms"] / base["ttft_p50_ms"],
        "ttft_p99": cand["ttft_p99_ms"] / base["ttft_p99_ms"],
        "wall": cand["wall_s"] / base["wall_s"],
        "cached_share": cand["cached_share"] / max(base["cached_share"], 1e-9),
    }


def round_ratios(runs: list[dict], by: str, base: str, cand: str) -> dict[str, list[float]]:
    """Per figure of `ratios_to`, the lowest and highest over the rounds of the candidate's
    run over the baseline's run of the same round: how far the ratio moves from round to
    round, beside the ratio of the medians."""
    per_round = []
    for round_ in sorted({r["round"] for r in runs}):
        pair = {r[by]: r for r in runs if r["round"] == round_}
        if base in pair and cand in pair:
            per_round.append(ratios_to(pair[base], pair[cand]))
    if not per_round:
        raise ValueError(f"no round ran both {base} and {cand}")
    return {k: [min(r[k] for r in per_round), max(r[k] for r in per_round)] for k in per_round[0]}


def round_ratios_text(spread: dict[str, list[float]]) -> str:
    def span(key: str) -> str:
        low, high = spread[key]
        return f"{low:.2f}-{high:.2f}x"

    return (
        f"per round: throughput {span('tok_s')}, TTFT p50 {span('ttft_p50')}, "
        f"p99 {span('ttft_p99')}"
    )


def make_model(path: str | Path, args: argparse.Namespace) -> Path:
    """The benches' tiny GPT-OSS model at `path`, sized by --layers, --window, --hidden."""
    return make_tiny_model(
        path,
        arch="gpt-oss",
        num_layers=args.layers,
        sliding_window_size=args.window,
        hidden_size=args.hidden,
        num_heads=8,
        num_kv_heads=2,
        seed=0,
    )


def workers_compile() -> bool:
    """`EngineConfig.compile` for the benches' workers: True, so that each compiles (or loads
    from the inductor cache) its decode step before it serves, and a run measures the steady
    state the default `compile="auto"` reaches once its background compile is done. Otherwise
    that compile (30-45 s cold, 4-9 s cached) would run beside most of a run, on the same
    cores. False (eager) where `$SWASERVE_CPU_AUTO_COMPILE=0` keeps `auto` eager: the test
    suite's runs."""
    return cpu_auto_compile()


@contextlib.contextmanager
def local_ray(num_cpus: int = 8) -> Iterator[None]:
    """A local Ray started here and shut down after, unless one is up already. `num_cpus`:
    logical CPUs, one per worker replica plus room for the router and an ingress."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(
            address="local",  # a new Ray of our own, never one that RAY_ADDRESS names
            num_cpus=num_cpus,  # logical: 8 fits 2 workers + router (+ ingress) on 2 cores
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=False,
        )
    try:
        yield
    finally:
        if own_ray:
            ray.shutdown()
