"""Offline throughput: swaserve's engine against transformers `generate` on the same model and
the same mixed workload, in the same process.

Workload: N requests with prompts of 32..512 tokens and outputs of 16..256 tokens (seeded).
transformers runs them in batches of `--hf-batch` (left-padded; a batch runs until its longest
request is done, the extra tokens are not counted); swaserve takes them all at once.

    python bench/throughput.py [--json] [--requests 64] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.models.tiny import make_tiny_model


def workload(n: int, seed: int, max_prompt: int, max_output: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(1, 250) for _ in range(rng.randint(32, max_prompt))],
            rng.randint(16, max_output),
        )
        for _ in range(n)
    ]


def run_swaserve(
    model_dir: str, work: list[tuple[list[int], int]], args: argparse.Namespace
) -> tuple[float, int]:
    engine = Engine(
        EngineConfig(
            model=model_dir,
            kv_cache_bytes=args.kv_mib * 2**20,
            chunked_prefill_size=args.chunk,
            max_prefill_tokens=max(args.chunk, 4096),
            check_on_idle=False,
        )
    )
    prompts = [p for p, _ in work]
    params = [SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True) for _, m in work]
    engine.generate(prompts[:2], params[:2])  # warm up
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.token_ids) for o in outs)


def run_transformers(
    model_dir: str, work: list[tuple[list[int], int]], batch: int
) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    pad = 0
    produced = 0
    with torch.inference_mode():
        model.generate(torch.tensor([work[0][0][:8]]), max_new_tokens=2, do_sample=False)  # warm up
        start = time.perf_counter()
        for i in range(0, len(work), batch):
            chunk = work[i : i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])  # [b, width] int64
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk]
            )  # [b, width] int64
            new = max(m for _, m in chunk)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad,
            )
            produced += sum(m for _, m in chunk)
        elapsed = time.perf_counter() - start
    return elapsed, produced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--kv-mib", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    work = workload(args.requests, args.seed, args.max_prompt, args.max_output)
    prompt_tokens = sum(len(p) for p, _ in work)
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(
            tmp,
            arch="gpt-oss",
            num_layers=args.layers,
            sliding_window_size=args.window,
            hidden_size=args.hidden,
            num_heads=8,
            num_kv_heads=2,
            seed=0,
        )
        sw_s, sw_out = run_swaserve(tmp, work, args)
        hf_s, hf_out = run_transformers(tmp, work, args.hf_batch)
    result = {
        "requests": args.requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": sw_out,
        "swaserve_s": round(sw_s, 3),
        "transformers_s": round(hf_s, 3),
        "swaserve_output_tok_s": round(sw_out / sw_s, 1),
        "transformers_output_tok_s": round(hf_out / hf_s, 1),
        "swaserve_total_tok_s": round((sw_out + prompt_tokens) / sw_s, 1),
        "transformers_total_tok_s": round((hf_out + prompt_tokens) / hf_s, 1),
    }
    result["output_ratio"] = round(
        result["swaserve_output_tok_s"] / result["transformers_output_tok_s"], 3
    )
    result["total_ratio"] = round(
        result["swaserve_total_tok_s"] / result["transformers_total_tok_s"], 3
    )
    print(
        f"{args.requests} requests, {prompt_tokens} prompt tokens, {sw_out} output tokens (CPU, float32)"
    )
    print(f"{'':14}{'seconds':>10}{'out tok/s':>12}{'total tok/s':>13}")
    print(
        f"{'swaserve':14}{sw_s:>10.2f}{result['swaserve_output_tok_s']:>12}{result['swaserve_total_tok_s']:>13}"
    )
    print(
        f"{'transformers':14}{hf_s:>10.2f}{result['transformers_output_tok_s']:>12}{result['transformers_total_tok_s']:>13}"
    )
    print(
        f"ratio (swaserve / transformers): output {result['output_ratio']:.2f}x, total {result['total_ratio']:.2f}x"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
