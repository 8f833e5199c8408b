"""Forward throughput of swaserve's model against transformers' on the same tiny model, same process.

swaserve: our model on the paged two-pool KV (`build_kv_memory`) with the `TorchAttentionBackend`,
slots taken through `alloc_extend` / `alloc_decode` and out-of-window SWA freed every
`--swa-eviction-interval` tokens, as the engine does (its scheduling is not timed). transformers:
the HF class with its default attention / experts implementations and its `DynamicCache` (which
keeps only the window for sliding layers), called as `model(input_ids, cache=..., use_cache=True)`
(`past_key_values=` on transformers versions without `cache`). Both float32, greedy,
`torch.inference_mode()`, the same thread count.

    prefill   tokens/s of one prompt of --prompt-len tokens (logits of the last token only)
    decode b1 tokens/s of --decode-steps one-token steps after that prompt
    decode bN tokens/s of --decode-steps steps of a batch of --batch prompts of
              --batch-prompt-len tokens (keys `decode_b32_*`; N = 32 unless --batch says otherwise)

Each figure is the best of --repeats timed runs after a warm-up; runs alternate between swaserve
and transformers, so that a busy machine slows both alike. On a machine shared with other work,
`--threads 1` avoids OpenMP barrier stalls that make every parallel op wait for a preempted thread.
The model is written by the tiny-model maker (default: GPT-OSS, hidden 512, 8 layers, W = 128,
4 experts, top-2); shrink it with --layers / --hidden / --prompt-len / --batch-prompt-len, or run
--quick.

    python bench/forward.py [--json] [--quick] [--threads 1] [--batch-prompt-len 512] ...
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swaserve.worker.attention.base import ForwardBatch
from swaserve.worker.attention.torch_backend import TorchAttentionBackend
from swaserve.worker.kv import (
    NO_LAST_LOC,
    KVMemoryConfig,
    SWAFreeState,
    SWATokenAllocator,
    build_kv_memory,
    free_swa_out_of_window_slots,
)
from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.loader import load_model
from swaserve.worker.models.tiny import make_tiny_model

WARMUP_STEPS = 2  # untimed decode steps before the timed blocks
QUICK = dict(
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    window=16,
    experts=4,
    experts_per_tok=2,
    prompt_len=48,
    decode_steps=4,
    batch=4,
    batch_prompt_len=40,
    repeats=1,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--quick", action="store_true", help="a tiny run (smoke test)")
    parser.add_argument("--arch", choices=["gpt-oss", "mimo-v2-flash"], default="gpt-oss")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads (full layers)")
    parser.add_argument("--window", type=int, default=128, help="W of the SWA layers")
    parser.add_argument("--experts", type=int, default=4, help="MoE experts per layer")
    parser.add_argument("--experts-per-tok", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=1024, help="tokens per prompt")
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps per run")
    parser.add_argument("--batch", type=int, default=32, help="requests of the batched decode")
    parser.add_argument(
        "--batch-prompt-len",
        type=int,
        default=0,
        help="tokens per prompt of the batch (0: --prompt-len)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best counts")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--swa-eviction-interval", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--seed", type=int, default=0)


@dataclass(slots=True)
class Request:
    """One request on the paged KV: `slots[:cached]` are the full slots of its positions."""

    slots: torch.Tensor  # [max_len] int64, preallocated (the engine's req_to_token row)
    cached: int = 0
    swa: SWAFreeState | None = None


class SwaserveRunner:
    """Prefill and greedy decode of equal-length prompts through swaserve's model and KV."""

    def __init__(self, model_dir: Path, *, max_total_tokens: int, args: argparse.Namespace):
        config = load_model_config(model_dir)
        self.window = config.sliding_window_size or 0
        self.interval = args.swa_eviction_interval
        self.memory = build_kv_memory(
            config.kv_spec(),
            # The whole batch's prompts are prefilled in one step, before any SWA is freed.
            KVMemoryConfig(
                max_total_tokens=max_total_tokens,
                swa_full_tokens_ratio=1.0,
                page_size=args.page_size,
            ),
        )
        self.model = load_model(model_dir, TorchAttentionBackend(self.memory.kv_pool, self.window))
        self.requests: list[Request] = []

    def reset(self) -> None:
        self.memory.allocator.clear()
        self.requests = []

    def prefill(self, prompts: torch.Tensor, max_len: int) -> torch.Tensor:  # [B] next tokens
        """prompts: [B, L] int64; one step that prefills them all."""
        b, length = prompts.shape
        alloc = self.memory.allocator
        prefix = torch.zeros(b, dtype=torch.int64)  # [B] int64
        seq = torch.full((b,), length, dtype=torch.int64)  # [B] int64
        out = alloc.alloc_extend(prefix, seq, torch.full((b,), NO_LAST_LOC))
        assert out is not None, "KV pool too small"
        self.requests = []
        for i in range(b):
            slots = torch.zeros(max_len, dtype=torch.int64)  # [max_len] int64
            slots[:length] = out[i * length : (i + 1) * length]
            self.requests.append(Request(slots, length, SWAFreeState()))
        batch = ForwardBatch.from_slots(
            input_ids=prompts.reshape(-1),
            positions=torch.arange(length).repeat(b),  # [B·L] int64
            prefix_lens=prefix,
            seq_lens=seq,
            req_token_slots=[r.slots[:length] for r in self.requests],
            out_full_loc=out,
            allocator=self.memory.allocator if self.memory.two_pools else None,  # type: ignore[arg-type]
            logits_positions="last",
        )
        next_ids = self.model(batch).argmax(-1)  # [B] int64
        self._free_out_of_window(min_free_tokens=0)
        return next_ids

    def decode(self, next_ids: torch.Tensor) -> torch.Tensor:  # [B] next tokens
        """One greedy step of every request, feeding `next_ids` [B]."""
        reqs = self.requests
        cached = torch.tensor([r.cached for r in reqs])  # [B] int64
        last = torch.stack([r.slots[r.cached - 1] for r in reqs])  # [B] int64
        out = self.memory.allocator.alloc_decode(cached + 1, last)
        assert out is not None, "KV pool too small"
        for r, slot in zip(reqs, out, strict=True):
            r.slots[r.cached] = slot
        batch = ForwardBatch.from_slots(
            input_ids=next_ids,
            positions=cached,
            prefix_lens=cached,
            seq_lens=cached + 1,
            req_token_slots=[r.slots[: r.cached + 1] for r in reqs],
            out_full_loc=out,
            allocator=self.memory.allocator if self.memory.two_pools else None,  # type: ignore[arg-type]
        )
        next_ids = self.model(batch).argmax(-1)  # [B] int64
        for r in reqs:
            r.cached += 1
        self._free_out_of_window(min_free_tokens=self.interval)
        return next_ids

    def _free_out_of_window(self, *, min_free_tokens: int) -> None:
        alloc = self.memory.allocator
        if not isinstance(alloc, SWATokenAllocator):
            return
        for r in self.requests:
            assert r.swa is not None
            free_swa_out_of_window_slots(
                alloc,
                r.swa,
                r.slots,
                r.cached,
                sliding_window_size=self.window,
                radix_cache=False,
                min_free_tokens=min_free_tokens,
            )


class HFRunner:
    """The same prefill and greedy decode through transformers with its own cache."""

    def __init__(self, model_dir: Path) -> None:
        import transformers

        self.transformers = transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
        # transformers >= 5.2x names the argument `cache` (`past_key_values` still works, with a
        # deprecation warning); older 5.x only knows `past_key_values`.
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.cache: Any = None

    def reset(self) -> None:
        self.cache = None

    def prefill(self, prompts: torch.Tensor, max_len: int) -> torch.Tensor:  # [B]
        self.cache = self.transformers.DynamicCache(config=self.model.config)
        kwargs = {self.cache_arg: self.cache, "use_cache": True, "logits_to_keep": 1}
        out = self.model(prompts, **kwargs)
        return out.logits[:, -1].argmax(-1)

    def decode(self, next_ids: torch.Tensor) -> torch.Tensor:  # [B]
        out = self.model(next_ids[:, None], **{self.cache_arg: self.cache, "use_cache": True})
        return out.logits[:, -1].argmax(-1)


Runner = SwaserveRunner | HFRunner


def time_prefill(
    runners: dict[str, Runner], prompt: torch.Tensor, repeats: int
) -> dict[str, float]:
    """Best seconds of a fresh prefill of `prompt` [1, L] per runner, after one warm-up. Runs
    alternate between the runners, so that a noisy machine slows both alike."""
    best = dict.fromkeys(runners, float("inf"))
    for attempt in range(repeats + 1):
        for name, runner in runners.items():
            runner.reset()
            t0 = time.perf_counter()
            runner.prefill(prompt, prompt.shape[1] + 1)
            if attempt:
                best[name] = min(best[name], time.perf_counter() - t0)
            runner.reset()
    return best


def time_decode(
    runners: dict[str, Runner], prompts: torch.Tensor, steps: int, repeats: int
) -> tuple[dict[str, float], dict[str, list[list[int]]]]:
    """Prefill `prompts` [B, L] (not timed) and run WARMUP_STEPS decode steps on every runner,
    then `repeats` timed blocks of `steps` decode steps, alternating runners block by block.
    Returns each runner's best block in seconds and every request's greedy tokens."""
    max_len = prompts.shape[1] + 1 + WARMUP_STEPS + repeats * steps
    next_ids: dict[str, torch.Tensor] = {}
    tokens: dict[str, list[torch.Tensor]] = {}
    for name, runner in runners.items():
        runner.reset()
        next_ids[name] = runner.prefill(prompts, max_len)
        tokens[name] = [next_ids[name]]
        for _ in range(WARMUP_STEPS):
            next_ids[name] = runner.decode(next_ids[name])
            tokens[name].append(next_ids[name])
    best = dict.fromkeys(runners, float("inf"))
    for _ in range(repeats):
        for name, runner in runners.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                next_ids[name] = runner.decode(next_ids[name])
                tokens[name].append(next_ids[name])
            best[name] = min(best[name], time.perf_counter() - t0)
    for runner in runners.values():
        runner.reset()
    return best, {name: torch.stack(t, 1).tolist() for name, t in tokens.items()}


def measure(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(args.seed)
    one = torch.randint(0, 256, (1, args.prompt_len), generator=gen)  # [1, L] int64
    many = torch.randint(0, 256, (args.batch, args.batch_prompt_len), generator=gen)  # [N, Lb]
    steps, repeats = args.decode_steps, args.repeats
    max_len = max(args.prompt_len, args.batch_prompt_len) + 1 + WARMUP_STEPS + repeats * steps
    runners: dict[str, Runner] = {
        "swaserve": SwaserveRunner(
            model_dir, max_total_tokens=args.batch * (max_len + args.page_size), args=args
        ),
        "hf": HFRunner(model_dir),
    }
    with torch.inference_mode():
        prefill_s = time_prefill(runners, one, repeats)
        b1_s, b1_tokens = time_decode(runners, one, steps, repeats)
        bn_s, bn_tokens = time_decode(runners, many, steps, repeats)
    report: dict[str, Any] = {}
    for name in runners:
        report[f"{name}_prefill_tok_s"] = args.prompt_len / prefill_s[name]
        report[f"{name}_decode_b1_tok_s"] = steps / b1_s[name]
        report[f"{name}_decode_b32_tok_s"] = args.batch * steps / bn_s[name]
    for key in ("prefill", "decode_b1", "decode_b32"):
        report[f"{key}_ratio"] = report[f"swaserve_{key}_tok_s"] / report[f"hf_{key}_tok_s"]
    # Random weights leave near-ties (top-2 logit gaps ~1e-4) that float32 rounding can flip,
    # after which a request's tokens diverge: informational, not a correctness check.
    same = [
        a == b
        for tokens in (b1_tokens, bn_tokens)
        for a, b in zip(tokens["swaserve"], tokens["hf"], strict=True)
    ]  # per request
    report["greedy_tokens_match"] = all(same)
    report["greedy_requests_equal_frac"] = sum(same) / len(same)
    return report


def measure_tiny_model(args: argparse.Namespace) -> dict[str, Any]:
    """Write the tiny model the arguments describe to a temp dir and measure it."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(
            tmp,
            arch=args.arch,
            num_layers=args.layers,
            sliding_window_size=args.window,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            hidden_size=args.hidden,
            num_experts=args.experts,
            num_experts_per_tok=args.experts_per_tok,
            seed=args.seed,
            max_position_embeddings=max(
                4096,
                max(args.prompt_len, args.batch_prompt_len)
                + 1
                + WARMUP_STEPS
                + args.repeats * args.decode_steps,
            ),
        )
        return measure(args, model_dir)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.batch_prompt_len = args.batch_prompt_len or args.prompt_len
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        report, used_threads = measure_tiny_model(args), torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)  # in-process callers keep their setting
    setup = {
        "arch": args.arch,
        "hidden_size": args.hidden,
        "num_layers": args.layers,
        "sliding_window_size": args.window,
        "num_heads": args.heads,
        "num_kv_heads": args.kv_heads,
        "num_experts": args.experts,
        "num_experts_per_tok": args.experts_per_tok,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "batch_size": args.batch,
        "batch_prompt_len": args.batch_prompt_len,
        "page_size": args.page_size,
        "repeats": args.repeats,
        "threads": used_threads,
        "dtype": "float32",
    }
    print_table(setup, report)
    if args.json:
        print(json.dumps(setup | report, sort_keys=True))
    return 0


def print_table(setup: dict[str, Any], report: dict[str, Any]) -> None:
    print(
        f"{setup['arch']}: hidden {setup['hidden_size']}, {setup['num_layers']} layers, "
        f"W={setup['sliding_window_size']}, {setup['num_experts']} experts "
        f"(top-{setup['num_experts_per_tok']}), prompt {setup['prompt_len']}, "
        f"{setup['decode_steps']} decode steps, {setup['threads']} threads, float32"
    )
    rows = [
        ("prefill (batch 1)", "prefill"),
        ("decode (batch 1)", "decode_b1"),
        (f"decode (batch {setup['batch_size']}, prompt {setup['batch_prompt_len']})", "decode_b32"),
    ]
    print(f"{'':32} {'swaserve tok/s':>15} {'transformers tok/s':>19} {'ratio':>7}")
    for label, key in rows:
        print(
            f"{label:32} {report[f'swaserve_{key}_tok_s']:15.1f} "
            f"{report[f'hf_{key}_tok_s']:19.1f} {report[f'{key}_ratio']:7.2f}"
        )
    print(
        f"greedy tokens equal: {report['greedy_tokens_match']} "
        f"({report['greedy_requests_equal_frac']:.0%} of requests)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
