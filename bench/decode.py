"""Decode at small batches: the compiled decode step (`EngineConfig(compile=True)`) against the
eager one, and the default configuration (`compile="auto"`: eager from the start, compiled in
the background) once its compile is done, on the same model, in the same process,
`Engine.step()` timed.

Models (tiny, random, written by the tiny-model maker): GPT-OSS and MiMo-V2-Flash shapes of
vocab 1024, hidden 256, 6 layers (W = 32), 4 experts top-2, computed in float32, the weights
stored in bfloat16 as the published checkpoints (`--weights-dtype float32`: random float32
values, which the compiled step's panels then hold in float32, twice the bytes). Per batch size
B, B prompts of --prompt-len tokens generate --new-tokens greedy tokens each:

    prefill tok/s   prompt tokens / time of the steps until every request has its first token
    decode step ms  median of the steps after that (all B requests decoding)
    decode tok/s    B / decode step

Eager, compiled and default runs alternate, --repeats times each, on the same fresh prompts (no
prefix hit); the best run of each counts (a busy machine slows all alike). `default_ratio` is
the default's decode speed over the compiled one's (goal: >= 0.95). The greedy tokens of the
two should be equal in every repeat (`same_tokens`; `differing_requests` of `requests` counts
those that are not); the two steps add in different orders, so a token whose
MoE router scores two experts within float rounding of each other may pick either expert and
the request's tokens part from there (seen once: GPT-OSS, batch 24, 1 of 24 requests from its
32nd token, where transformers' router logits put layer 1's 2nd and 3rd experts 2.3e-6 apart;
it is the prompts of seed 24001, the second repeat).

Start-up: `compile=True` pays the compile when the engine starts (it compiles its decode graphs
before the first request). `compile_cold_s` is that extra start-up time in a new process with an
empty inductor cache; `compile_cached_s` the same in a second new process over the cache the
first one left (what a second `swaserve serve` pays). The default configuration starts as fast
as the eager one (`default_start_s`: its extra start-up in the cached process) and compiles in
the background: `background_s` is how long after its start every bucket was compiled (cold,
in the bench's own process; --quick: over the probes' cache, `background_cold` false).

`--against REV`: the compiled step at batch 8 of GPT-OSS on the code of git revision REV
against this tree's, each in child processes of its own (an inductor cache per side, REV's C++
kernels built apart), alternating, --against-rounds times each; prints both medians, their ratio and whether the
greedy tokens are the same (REV's code must have `Engine`, `EngineConfig` and `SamplingParams`
as today's; REV 1675141^ is where the speculative decoding issue measured its 3.6 ms step).

    python bench/decode.py [--json] [--quick] [--batches 1,8,24,64] [--archs gpt-oss,mimo-v2-flash]
        [--weights-dtype bfloat16|float32] [--against REV [--against-rounds 5]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from decode_probe import engine, run_batch

from swaserve.proto.environment import CPU_AUTO_COMPILE_ENV
from swaserve.worker import Engine
from swaserve.worker.models.tiny import make_tiny_model

GOALS = {1: 2.9, 8: 2.6, 24: 2.0}  # decode speed-up goals of this bench on a 2-core CPU
AGAINST_GOAL = 8, 1.8  # batch, the compiled step's speed-up goal over the revision's
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("worker", "router", "cluster", "proto")  # swaserve.<name> is <name>/ (pyproject)


def make_model(root: Path, arch: str, weights_dtype: str = "bfloat16") -> Path:
    return make_tiny_model(
        root / f"{arch}-{weights_dtype}",
        arch,
        num_layers=6,
        sliding_window_size=32,
        num_heads=4,
        num_kv_heads=2,
        hidden_size=256,
        vocab_size=1024,
        num_experts=4,
        num_experts_per_tok=2,
        weights_dtype=weights_dtype,
    )


def timed_start(model: Path, compile_: bool | str) -> tuple[Engine, float]:
    start = time.perf_counter()
    eng = engine(model, compile_)
    return eng, time.perf_counter() - start


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    fastest = min(runs, key=lambda r: r["decode_step_ms"])
    return {
        "decode_step_ms": fastest["decode_step_ms"],
        "decode_tok_s": fastest["decode_tok_s"],
        "prefill_tok_s": max(r["prefill_tok_s"] for r in runs),
    }


def startup_probe(model: Path) -> None:
    """Child process: the start-up of an eager, a compiled and a default engine, on the
    inherited cache."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    _, eager_s = timed_start(model, False)
    _, compiled_s = timed_start(model, True)
    default, default_s = timed_start(model, "auto")
    default.shutdown()  # after the bucket its thread compiles now
    print(json.dumps({"eager_s": eager_s, "compiled_s": compiled_s, "default_s": default_s}))


def probe_startup(model: Path, cache: Path, threads: int) -> dict[str, float]:
    """Seconds the compile (and the default configuration) adds to an engine's start, in a
    new process over `cache`."""
    probe = subprocess.run(
        [sys.executable, __file__, "--startup-probe", str(model)],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, BENCH_THREADS=str(threads), TORCHINDUCTOR_CACHE_DIR=str(cache)),
    )
    times = json.loads(probe.stdout.strip().splitlines()[-1])
    return {
        "compiled": float(times["compiled_s"] - times["eager_s"]),
        "default": float(times["default_s"] - times["eager_s"]),
    }


def is_commit(rev: str) -> bool:
    """Whether `rev` names a commit of this repository."""
    found = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
    )
    return found.returncode == 0


@contextmanager
def checkout(rev: str, root: Path) -> Iterator[Path]:
    """A `git worktree` of `rev` under `root`, and a folder whose `swaserve/` holds its
    packages (to put first on PYTHONPATH); the worktree is removed after."""
    tree = root / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
        check=True,
        capture_output=True,
    )
    try:
        package = root / "path" / "swaserve"
        package.mkdir(parents=True)
        for name in PACKAGES:
            (package / name).symlink_to(tree / name)
        yield package.parent
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
            check=True,
            capture_output=True,
        )


def probe_step(
    model: Path,
    cache: Path,
    path: Path | None,
    *,
    threads: int,
    batch: int,
    rounds: int,
    compile_: bool = True,
) -> dict[str, Any]:
    """`decode_probe.py` in a new process with its inductor cache under `cache`, on the code
    under `path` (this tree's if None; a revision's code builds its C++ kernels under `cache`
    too, this tree's use the usual cache)."""
    env = dict(
        os.environ, BENCH_THREADS=str(threads), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor")
    )
    if path is not None:
        env["SWASERVE_CACHE_DIR"] = str(cache / "swaserve")
        env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
    argv = [sys.executable, str(Path(__file__).with_name("decode_probe.py")), str(model)]
    argv += [str(batch), str(rounds), "compiled" if compile_ else "eager"]
    probe = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cache)
    if probe.returncode != 0:
        raise SystemExit(f"the step probe failed ({' '.join(argv)}):\n{probe.stderr[-3000:]}")
    return json.loads(probe.stdout.strip().splitlines()[-1])


def bench_against(rev: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """REV's compiled step against this tree's (`--against`), alternating processes."""
    model = make_model(root, "gpt-oss", args.weights_dtype)
    runs: dict[str, list[dict[str, Any]]] = {"rev": [], "tree": []}
    caches = {side: root / f"against-cache-{side}" for side in runs}
    for cache in caches.values():
        cache.mkdir()
    with checkout(rev, root / "against") as path:
        for _ in range(args.against_rounds):
            for side, code in (("rev", path), ("tree", None)):
                probe = probe_step(
                    model, caches[side], code, threads=args.threads, batch=AGAINST_GOAL[0], rounds=3
                )
                runs[side].append(probe)
    medians = {side: statistics.median(r["step_ms"] for r in rs) for side, rs in runs.items()}
    return {
        "rev": rev,
        "batch": AGAINST_GOAL[0],
        "weights_dtype": args.weights_dtype,
        "rev_step_ms": [r["step_ms"] for r in runs["rev"]],
        "tree_step_ms": [r["step_ms"] for r in runs["tree"]],
        "ratio": medians["rev"] / medians["tree"],
        "same_tokens": len({r["tokens"] for rs in runs.values() for r in rs}) == 1,
    }


def bench_arch(arch: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    model = make_model(root, arch, args.weights_dtype)
    cache = root / f"inductor-{arch}"  # the arch's own: cold is cold, one model per process
    cold = probe_startup(model, cache, args.threads)
    cached = probe_startup(model, cache, args.threads)
    out: dict[str, Any] = {
        "compile_cold_s": cold["compiled"],
        "compile_cached_s": cached["compiled"],
        "default_start_s": cached["default"],
        "batches": {},
    }
    # cold, but for --quick (the test suite's run), which reuses the probes' cache
    default_cache = cache if args.quick else root / f"inductor-{arch}-default"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(default_cache)
    start = time.perf_counter()
    default = engine(model, "auto")
    step = default.runner.decode_step
    if step is None or not step.background:
        raise SystemExit("compile='auto' does not compile in the background here")
    step.compiled.wait()
    if step.compile_error is not None:
        raise SystemExit(f"the background compile failed: {step.compile_error!r}")
    out["background_s"] = time.perf_counter() - start
    out["background_cold"] = not args.quick
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    engines = {"eager": engine(model, False), "compiled": engine(model, True), "default": default}
    for batch in args.batches:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {name: [] for name in engines}  # every repeat's
        for repeat in range(args.repeats):
            for name, eng in engines.items():
                seed = batch * 1000 + repeat
                figures, toks = run_batch(eng, batch, args.prompt_len, args.new_tokens, seed)
                runs[name].append(figures)
                tokens[name].extend(toks)
        e, c, d = (best(runs[name]) for name in engines)
        differing = sum(
            a != b or a != x
            for a, b, x in zip(tokens["eager"], tokens["compiled"], tokens["default"], strict=True)
        )
        out["batches"][batch] = {
            "eager": e,
            "compiled": c,
            "default": d,
            "decode_speedup": e["decode_step_ms"] / c["decode_step_ms"],
            "default_ratio": c["decode_step_ms"] / d["decode_step_ms"],
            "prefill_ratio": c["prefill_tok_s"] / e["prefill_tok_s"],
            "same_tokens": differing == 0,
            "differing_requests": differing,
            "requests": len(tokens["eager"]),
        }
    for eng in engines.values():
        eng.shutdown()
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
    parser.add_argument(
        "--weights-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="dtype the models' weights are stored in (computed in float32 either way)",
    )
    parser.add_argument(
        "--against", metavar="REV", help="also time the compiled batch-8 step of git REV's code"
    )
    parser.add_argument("--against-rounds", type=int, default=5)
    parser.add_argument("--startup-probe", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.startup_probe is not None:
        startup_probe(args.startup_probe)
        return
    if args.against_rounds < 1:
        parser.error("--against-rounds must be at least 1")
    if args.against is not None and not is_commit(args.against):
        parser.error(f"--against: {args.against!r} names no commit of this repository")
    args.batches = [int(b) for b in args.batches.split(",")]
    archs = args.archs.split(",")
    if args.quick:
        args.batches, archs, args.repeats, args.new_tokens = [1, 8], archs[:1], 1, 12
    torch.set_num_threads(args.threads)
    os.environ.pop(CPU_AUTO_COMPILE_ENV, None)  # the default configuration as a user gets it
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results = {arch: bench_arch(arch, root, args) for arch in archs}
        against = None if args.against is None else bench_against(args.against, root, args)
    load = os.getloadavg()[0]
    for arch, res in results.items():
        print(
            f"{arch}: compile=True adds {res['compile_cold_s']:.1f} s to a start cold, "
            f"{res['compile_cached_s']:.1f} s cached; the default adds "
            f"{res['default_start_s']:.1f} s and compiles in the background "
            f"({res['background_s']:.1f} s {'cold' if res['background_cold'] else 'cached'})"
        )
        print(
            "  batch  eager ms  compiled ms  speed-up  goal  default ms  default ÷ compiled"
            "  prefill ratio  same tokens"
        )
        for batch, r in res["batches"].items():
            goal = GOALS.get(batch)
            print(
                f"  {batch:5d}  {r['eager']['decode_step_ms']:8.2f}  "
                f"{r['compiled']['decode_step_ms']:11.2f}  {r['decode_speedup']:7.2f}×  "
                f"{'' if goal is None else f'{goal:.1f}×':>4}  "
                f"{r['default']['decode_step_ms']:10.2f}  {r['default_ratio']:17.2f}×  "
                f"{r['prefill_ratio']:12.2f}×  "
                f"{r['same_tokens']} ({r['differing_requests']} of {r['requests']} differ)"
            )
    if against is not None:
        batch, goal = AGAINST_GOAL
        print(
            f"gpt-oss compiled batch-{batch} step, {against['weights_dtype']} weights, "
            f"{args.against_rounds} alternating processes each: {against['rev']} "
            + " ".join(f"{ms:.2f}" for ms in against["rev_step_ms"])
            + " ms, this tree "
            + " ".join(f"{ms:.2f}" for ms in against["tree_step_ms"])
            + f" ms; median ratio {against['ratio']:.2f}× (goal {goal}×), "
            f"same tokens {against['same_tokens']}"
        )
    print(f"load average at the end: {load:.2f}")
    if args.json:
        print(
            json.dumps(
                {
                    "results": results,
                    "against": against,
                    "weights_dtype": args.weights_dtype,
                    "load_avg": load,
                    "threads": args.threads,
                }
            )
        )


if __name__ == "__main__":
    main()
