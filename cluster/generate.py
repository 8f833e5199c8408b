"""`swaserve generate`: run the engine offline on a few prompts and print the completions.

Without `--model` it serves a tiny random GPT-OSS model made on the spot (no download; its text
is gibberish, but every code path is the real one).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from swaserve.cluster.knobs import ENGINE_FLAGS, add_config_flags, config_overrides
from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.models.tiny import make_tiny_model

# `--seed` is the requests' sampling seed here, so the engine's own seed keeps its default.
GENERATE_ENGINE_FLAGS = tuple(name for name in ENGINE_FLAGS if name != "seed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF-format model dir (default: a tiny random GPT-OSS)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_config_flags(parser, EngineConfig, GENERATE_ENGINE_FLAGS)


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    """The flags given, over `EngineConfig`'s defaults but one: `compile` is off unless asked
    (`--compile auto|true`). A one-off run never wins a compile back, and the default's
    background compile (CPU) would hold the exit until the bucket it compiles is done."""
    overrides = config_overrides(args, GENERATE_ENGINE_FLAGS)
    overrides.setdefault("compile", False)
    return EngineConfig(model=model, **overrides)


def run(args: argparse.Namespace) -> int:
    prompts = args.prompt or ["Hello, swaserve!", "Sliding windows keep KV small."]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(
            make_tiny_model(Path(tmp), arch="gpt-oss", num_layers=4, sliding_window_size=16)
        )
        engine = Engine(engine_config(args, model))
        try:
            params = SamplingParams(
                max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed
            )
            start = time.perf_counter()
            outputs = engine.generate(prompts, params)
            elapsed = time.perf_counter() - start
            for prompt, out in zip(prompts, outputs, strict=True):
                if args.json:
                    print(
                        json.dumps(
                            {
                                "prompt": prompt,
                                "text": out.text,
                                "token_ids": out.token_ids,
                                "finish_reason": out.finish_reason,
                            }
                        )
                    )
                else:
                    print(
                        f"{prompt!r} -> {out.text!r} ({len(out.token_ids)} tokens, {out.finish_reason})"
                    )
            head = engine.headroom()
            if not args.json:
                print(
                    f"{sum(len(o.token_ids) for o in outputs)} tokens in {elapsed:.2f} s; KV pools: full "
                    f"{head.full_total_tokens} tokens, SWA {head.swa_total_tokens} tokens (hybrid={head.hybrid})"
                )
        finally:
            engine.shutdown()  # also stops the TP ranks
    return 0
