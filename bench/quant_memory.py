"""Quantized checkpoints kept quantized in memory against dequantized at load, same process.

For an MXFP4 GPT-OSS and an FP8 MiMo-V2-Flash tiny checkpoint whose experts hold most of the
bytes (written by the tiny-model maker), both loaded each way (`EngineConfig.dequantize_weights`):

    resident   bytes the weights hold (parameters + buffers, nbytes), and their ratio to the
               checkpoint's file bytes
    rss        growth of the process's anonymous resident memory (RssAnon, /proc/self/status)
               while the weights load, each load in a fresh child process (the model dir's
               mmapped pages are file memory and leave with the file)
    decode     seconds per engine decode step (a batch of --batch requests; gathered experts),
               best of --repeats, runs alternating between the two engines
    prefill    seconds of the step that prefills them all (grouped experts)

Ratios are kept / dequantized (bytes: smaller is better; time: above 1 is the cost of
dequantizing the selected experts each step, which a fused kernel would remove).

    python bench/quant_memory.py [--json] [--quick] [--threads 1] [--dtype bfloat16] ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.models.causal_lm import UnboundBackend
from swaserve.worker.models.loader import load_model
from swaserve.worker.models.quantized_weights import resident_bytes
from swaserve.worker.models.tiny import make_tiny_model

MODELS = {
    "gpt-oss-mxfp4": dict(arch="gpt-oss", quantization="mxfp4"),
    "mimo-fp8": dict(arch="mimo-v2-flash", quantization="fp8", mtp_layers=0),  # drafts only
}
QUICK = dict(hidden=64, layers=2, experts=16, intermediate=128, batch=2, prompt_len=16)
QUICK |= dict(decode_steps=3, repeats=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--quick", action="store_true", help="a tiny run (smoke test)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32, help="MoE experts per layer")
    parser.add_argument("--experts-per-tok", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=512, help="units of one expert")
    parser.add_argument("--batch", type=int, default=4, help="requests decoding together")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--decode-steps", type=int, default=16, help="timed decode steps")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best counts")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--rss-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dequantize", action="store_true", help=argparse.SUPPRESS)


def write_model(root: Path, name: str, args: argparse.Namespace) -> Path:
    options: dict[str, Any] = dict(MODELS[name])
    units = "intermediate_size" if options["arch"] == "gpt-oss" else "moe_intermediate_size"
    options[units] = args.intermediate
    return make_tiny_model(
        root / name,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_experts=args.experts,
        num_experts_per_tok=args.experts_per_tok,
        sliding_window_size=16,
        **options,
    )


def rss_anon_bytes() -> int | None:
    """This process's anonymous resident memory (Linux), or None where /proc has none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_child(model_dir: Path, dequantize: bool, dtype: torch.dtype) -> dict[str, Any]:
    """In a fresh process: anonymous RSS growth while the weights load, and their bytes. A
    one-layer model of the same kind is loaded first, so that what the first load of any model
    allocates once (torch's and safetensors' own state) is not counted."""
    with tempfile.TemporaryDirectory() as tmp:
        config = json.loads((model_dir / "config.json").read_text())
        arch = "gpt-oss" if config["model_type"] == "gpt_oss" else "mimo-v2-flash"
        quantization = config["quantization_config"]["quant_method"]
        small = make_tiny_model(
            Path(tmp), arch=arch, num_layers=1, quantization=quantization, mtp_layers=0
        )
        load: dict[str, Any] = dict(dtype=dtype, dequantize_weights=dequantize, progress=False)
        load_model(small, UnboundBackend(), **load)
    before = rss_anon_bytes()
    model = load_model(model_dir, UnboundBackend(), **load)
    after = rss_anon_bytes()
    grown = None if before is None or after is None else after - before
    return {"rss_growth_bytes": grown, "resident_bytes": resident_bytes(model)}


def measure_rss(model_dir: Path, dequantize: bool, args: argparse.Namespace) -> int | None:
    argv = [sys.executable, __file__, "--rss-child", str(model_dir), "--dtype", args.dtype]
    done = subprocess.run(
        argv + (["--dequantize"] if dequantize else []),
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["rss_growth_bytes"]


def make_engine(model_dir: Path, dequantize: bool, args: argparse.Namespace) -> Engine:
    tokens = args.batch * (args.prompt_len + args.decode_steps + 8)
    return Engine(
        EngineConfig(
            model=str(model_dir),
            dtype=args.dtype,
            max_total_tokens=tokens,
            swa_full_tokens_ratio=1.0,
            enable_prefix_cache=False,
            dequantize_weights=dequantize,
            max_running_requests=args.batch,
            check_on_idle=False,
        )
    )


def time_steps(engine: Engine, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    """(seconds of the prefill step, best seconds per decode step) of one batch."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_new_tokens=args.decode_steps + 1, ignore_eos=True)
    for _ in range(args.batch):
        prompt = torch.randint(0, 256, (args.prompt_len,), generator=gen).tolist()
        engine.add_request(prompt, params)
    start = time.perf_counter()
    engine.step()  # prefills the whole batch (and samples its first tokens)
    prefill_s = time.perf_counter() - start
    decode_s: list[float] = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        decode_s.append(time.perf_counter() - start)
    return prefill_s, min(decode_s)


def measure(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    file_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    kept, dequantized = make_engine(model_dir, False, args), make_engine(model_dir, True, args)
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    time_steps(kept, args, seed=0)  # warm-up, untimed
    time_steps(dequantized, args, seed=0)
    for r in range(args.repeats):
        for dequantize, engine in ((False, kept), (True, dequantized)):
            times[dequantize].append(time_steps(engine, args, seed=r + 1))
    out: dict[str, Any] = {"checkpoint_bytes": file_bytes}
    for dequantize, label in ((False, "kept"), (True, "dequantized")):
        engine = dequantized if dequantize else kept
        out[f"{label}_resident_bytes"] = engine.weight_bytes
        out[f"{label}_rss_growth_bytes"] = measure_rss(model_dir, dequantize, args)
        out[f"{label}_prefill_s"] = min(t[0] for t in times[dequantize])
        out[f"{label}_decode_step_s"] = min(t[1] for t in times[dequantize])
    out["kept_over_checkpoint"] = out["kept_resident_bytes"] / file_bytes
    out["dequantized_over_checkpoint"] = out["dequantized_resident_bytes"] / file_bytes
    out["resident_ratio"] = out["kept_resident_bytes"] / out["dequantized_resident_bytes"]
    rss_kept, rss_deq = out["kept_rss_growth_bytes"], out["dequantized_rss_growth_bytes"]
    out["rss_kept_over_checkpoint"] = None if rss_kept is None else rss_kept / file_bytes
    out["rss_ratio"] = None if rss_kept is None or not rss_deq else rss_kept / rss_deq
    out["decode_step_ratio"] = out["kept_decode_step_s"] / out["dequantized_decode_step_s"]
    out["prefill_ratio"] = out["kept_prefill_s"] / out["dequantized_prefill_s"]
    return out


def run(args: argparse.Namespace) -> int:
    if args.rss_child is not None:
        dtype = getattr(torch, args.dtype)
        print(json.dumps(rss_child(args.rss_child, args.dequantize, dtype)))
        return 0
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            report[name] = measure(write_model(Path(tmp), name, args), args)
    setup = {
        key: getattr(args, key)
        for key in ("hidden", "layers", "experts", "experts_per_tok", "intermediate", "batch")
    } | {"prompt_len": args.prompt_len, "dtype": args.dtype, "threads": torch.get_num_threads()}
    print_table(setup, report)
    if args.json:
        print(json.dumps({"setup": setup} | report, sort_keys=True))
    return 0


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f}"


def print_table(setup: dict[str, Any], report: dict[str, Any]) -> None:
    print(
        f"hidden {setup['hidden']}, {setup['layers']} layers, {setup['experts']} experts of "
        f"{setup['intermediate']} (top-{setup['experts_per_tok']}), {setup['dtype']}, "
        f"batch {setup['batch']} x {setup['prompt_len']} tokens, {setup['threads']} threads"
    )
    print(
        f"{'':15} {'ckpt MiB':>9} {'kept MiB':>9} {'deq MiB':>9} {'kept/ckpt':>9} "
        f"{'RSS kept':>9} {'RSS deq':>9} {'decode ms kept/deq':>19} {'ratio':>6}"
    )
    for name, r in report.items():
        decode = f"{1e3 * r['kept_decode_step_s']:.2f} / {1e3 * r['dequantized_decode_step_s']:.2f}"
        print(
            f"{name:15} {_mib(r['checkpoint_bytes']):>9} {_mib(r['kept_resident_bytes']):>9} "
            f"{_mib(r['dequantized_resident_bytes']):>9} {r['kept_over_checkpoint']:>9.2f} "
            f"{_mib(r['kept_rss_growth_bytes']):>9} {_mib(r['dequantized_rss_growth_bytes']):>9} "
            f"{decode:>19} {r['decode_step_ratio']:>6.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
