"""Prefix reuse of the hybrid two-pool cache against one pool, on the same model and prompts.

Each workload runs its requests one after another through one `Engine` per mode:

- `one-pool`: `disable_hybrid_swa_memory` (every layer keeps every token: the reuse ceiling);
- `hybrid`: the default (window checkpoints + exact window repair);
- `hybrid-no-repair`: checkpoints only (`enable_window_repair=False`);
- `cold`: no prefix cache (the prefill a cache saves).

Workloads (a tiny model, GPT-OSS by default or any family with `--arch`, W = 32, float32):

- `chat`: multi-turn chat whose history is re-rendered — the answer in the next prompt is the
  generated one without its first tokens, as GPT-OSS's and MiMo's templates drop the reasoning;
- `shared-system`: one shared system prompt, one short question per user;
- `same-prompt`: the same prompt twice;
- `long-prefix`: a document of at least 16 × L_swa · W tokens, then questions about it that
  diverge right after it (the first request's decode has tombstoned the document's window).

Per mode and workload: prefill tokens computed (counted at the model's input), the cached share
of prompt tokens (the engine's `cached_tokens`), and whether every greedy answer equals the cold
run's. Ratios: hybrid cached share ÷ one pool's, and cold prefill ÷ hybrid prefill.

    python bench/reuse.py [--json] [--arch gpt-oss|gemma3|gemma4|cohere2|olmo3|exaone4|llama4|
                          mimo-v2-flash]

For llama4 the 32 is the chunk C of its chunked layers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from swaserve.proto.kv_rules import window_repair_tokens
from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.tiny import ARCHITECTURES, make_tiny_model
from swaserve.worker.runner.model_input import ModelInput

MODES = {
    "one-pool": {"disable_hybrid_swa_memory": True},
    "hybrid": {},
    "hybrid-no-repair": {"enable_window_repair": False},
    "cold": {"enable_prefix_cache": False},
}
ASSISTANT = 3  # the token that opens a rendered answer
REASONING_TOKENS = 16  # dropped from an answer when the next prompt renders it


@dataclass
class Counts:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0  # tokens the model computed for prompts (repairs included)
    cached_per_request: list[int] | None = None
    prefill_per_request: list[int] | None = None

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)


class CountingEngine:
    """An engine whose forward counts prompt tokens computed: every input token that is not a
    decode (a request's one-token step after it has sampled)."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = Engine(config)
        self.counts = Counts(cached_per_request=[], prefill_per_request=[])
        forward = self.engine.runner.forward
        self._decoding: set[int] = set()  # rows whose one-token steps are decodes

        def counting(inp: ModelInput) -> torch.Tensor:
            extend = (inp.seq_lens - inp.prefix_lens).tolist()
            rows = inp.req_rows.tolist()
            for row, n in zip(rows, extend, strict=True):
                if not (n == 1 and row in self._decoding):
                    self.counts.prefill_tokens += n
            return forward(inp)

        self.engine.runner.forward = counting  # type: ignore[method-assign]

    def run(self, prompt: list[int], params: SamplingParams) -> list[int]:
        engine = self.engine
        rid = engine.add_request(prompt, params)
        req = engine._requests[rid]
        tokens: list[int] = []
        cached = 0
        prefill_before = self.counts.prefill_tokens
        while True:
            outs = engine.step()
            out = next((o for o in outs if o.request_id == rid), None)
            if out is None:
                continue
            if not tokens:
                self._decoding.add(req.row)  # from its first token on, one-token steps decode
            tokens += out.new_token_ids
            cached = out.cached_tokens
            if out.finished:
                break
        self._decoding.clear()
        self.counts.prompt_tokens += len(prompt)
        self.counts.cached_tokens += cached
        assert self.counts.cached_per_request is not None
        assert self.counts.prefill_per_request is not None
        self.counts.cached_per_request.append(cached)
        self.counts.prefill_per_request.append(self.counts.prefill_tokens - prefill_before)
        engine.check()
        return tokens


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 250) for _ in range(n)]


def run_chat(engine: CountingEngine, args: argparse.Namespace, rng: random.Random) -> list:
    system, history, answers = tokens(rng, args.system_tokens), [], []
    for _ in range(args.turns):
        prompt = system + history + tokens(rng, args.user_tokens)
        out = engine.run(prompt, SamplingParams(temperature=0, max_new_tokens=args.new_tokens))
        answers.append(out)
        history = [*prompt[len(system) :], ASSISTANT, *out[REASONING_TOKENS:]]
    return answers


def run_shared_system(engine: CountingEngine, args: argparse.Namespace, rng: random.Random) -> list:
    system = tokens(rng, args.system_tokens + 100)
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    return [engine.run(system + tokens(rng, args.user_tokens), params) for _ in range(args.users)]


def run_same_prompt(engine: CountingEngine, args: argparse.Namespace, rng: random.Random) -> list:
    prompt = tokens(rng, args.system_tokens + 120)
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    return [engine.run(prompt, params) for _ in range(2)]


def run_long_prefix(engine: CountingEngine, args: argparse.Namespace, rng: random.Random) -> list:
    document = tokens(rng, args.long_prefix_tokens)
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    return [engine.run(document + tokens(rng, args.user_tokens), params) for _ in range(3)]


WORKLOADS = {
    "chat": run_chat,
    "shared-system": run_shared_system,
    "same-prompt": run_same_prompt,
    "long-prefix": run_long_prefix,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arch", choices=sorted(ARCHITECTURES), default="gpt-oss", help="tiny model family"
    )
    parser.add_argument("--window", type=int, default=32, help="W of the sliding layers")
    parser.add_argument("--layers", type=int, default=4, help="layers (the family's pattern)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=2048, help="chunked prefill size")
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--user-tokens", type=int, default=20)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=40, help="greedy tokens per answer")
    parser.add_argument(
        "--long-prefix-tokens", type=int, default=0, help="default: 16 x L_swa x W + W"
    )
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    parser.add_argument(
        "--swa-full-tokens-ratio", type=float, default=None, help="default: the engine's"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    if args.new_tokens <= args.window or args.new_tokens <= REASONING_TOKENS:
        parser.error("--new-tokens must exceed --window (decodes leave the window) and 16")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(
            Path(tmp),
            arch=args.arch,
            num_layers=args.layers,
            sliding_window_size=args.window,
            hidden_size=args.hidden,
            seed=args.seed,
            vocab_size=320,
        )
        num_swa = len(load_model_config(model).swa_layer_ids)
        args.swa_layers = num_swa
        repair = window_repair_tokens(num_swa, args.window, args.page_size)
        if args.long_prefix_tokens == 0:
            args.long_prefix_tokens = 16 * num_swa * args.window + args.window
        results: dict[str, dict[str, Counts]] = {}
        answers: dict[str, dict[str, list]] = {}
        ratio = {}
        if args.swa_full_tokens_ratio is not None:
            ratio["swa_full_tokens_ratio"] = args.swa_full_tokens_ratio
        for workload, run in WORKLOADS.items():
            results[workload], answers[workload] = {}, {}
            for mode, options in MODES.items():
                config = EngineConfig(
                    model=str(model),
                    dtype="float32",
                    page_size=args.page_size,
                    max_total_tokens=args.max_total_tokens,
                    chunked_prefill_size=args.chunk,
                    **ratio,
                    **options,
                )
                engine = CountingEngine(config)
                try:
                    answers[workload][mode] = run(engine, args, random.Random(args.seed))
                finally:
                    engine.engine.shutdown()
                results[workload][mode] = engine.counts
    report = summarize(results, answers, repair, args)
    print_table(report, repair, args)
    if args.json:
        print(json.dumps(report))
    return 0


def summarize(
    results: dict[str, dict[str, Counts]],
    answers: dict[str, dict[str, list]],
    repair: int,
    args: argparse.Namespace,
) -> dict:
    report: dict = {
        "window": args.window,
        "arch": args.arch,
        "swa_layers": args.swa_layers,
        "page_size": args.page_size,
        "repair_tokens": repair,
        "workloads": {},
    }
    for workload, modes in results.items():
        cold = modes["cold"]
        entry: dict = {}
        for mode, counts in modes.items():
            entry[mode] = {
                "prefill_tokens": counts.prefill_tokens,
                "cached_share": round(counts.cached_share, 4),
                "cached_per_request": counts.cached_per_request,
                "prefill_per_request": counts.prefill_per_request,
                "tokens_equal_cold": answers[workload][mode] == answers[workload]["cold"],
            }
        hybrid, one = modes["hybrid"], modes["one-pool"]
        entry["hybrid_vs_one_pool_cached_share"] = round(
            hybrid.cached_share / max(one.cached_share, 1e-9), 4
        )
        entry["cold_vs_hybrid_prefill"] = round(
            cold.prefill_tokens / max(1, hybrid.prefill_tokens), 3
        )
        hits = sum(1 for c in hybrid.cached_per_request or [] if c > 0)
        entry["hybrid_extra_prefill_per_hit"] = round(
            (hybrid.prefill_tokens - one.prefill_tokens) / max(1, hits), 2
        )
        # The requests after the first, whose prompts the cache can serve: their cold prefill
        # against the hybrid's (repairs included).
        later = [sum((m.prefill_per_request or [])[1:]) for m in (cold, hybrid)]
        entry["cold_vs_hybrid_prefill_of_hits"] = round(later[0] / max(1, later[1]), 3)
        report["workloads"][workload] = entry
    return report


def print_table(report: dict, repair: int, args: argparse.Namespace) -> None:
    print(
        f"W={args.window}, L_swa={args.swa_layers}, P={args.page_size}, chunk={args.chunk}, "
        f"R = L_swa * W = {repair}"
    )
    header = (
        f"{'workload':<14} {'mode':<17} {'prefill':>8} {'cached':>7}  equal  cached per request"
    )
    print(header)
    for workload, entry in report["workloads"].items():
        for mode in MODES:
            row = entry[mode]
            print(
                f"{workload:<14} {mode:<17} {row['prefill_tokens']:>8} "
                f"{row['cached_share']:>7.3f}  {str(row['tokens_equal_cold']).lower():<5}  "
                f"{row['cached_per_request']}"
            )
        print(
            f"{'':<14} hybrid / one pool cached share {entry['hybrid_vs_one_pool_cached_share']:.3f}"
            f", cold / hybrid prefill {entry['cold_vs_hybrid_prefill']:.2f}x (after the first "
            f"request {entry['cold_vs_hybrid_prefill_of_hits']:.2f}x), hybrid extra prefill per "
            f"hit {entry['hybrid_extra_prefill_per_hit']}"
        )


if __name__ == "__main__":
    sys.exit(main())
