"""One prepared GPU check: one command, a minute or two on one GPU, one line per check.

    python bench/gpu_check.py [--json] [--device cuda|cpu]

- attn: the flash backend against the torch backend on the same q/k/v, one full and one SWA
  layer with sinks, GPT-OSS head dims (64) and MiMo's (K 192 > V 128: the strided V view), P = 1
  (gathered) and P = 16 (paged), prefill / decode / mixed steps, bf16: within ATTN_RTOL.
- logits: the same, through both models (tiny GPT-OSS at head dim 64, tiny MiMo-V2-Flash at
  192 / 128, an SWA and a full layer), P = 1 and 16. Teacher-forced: runners on the torch and the
  flash backend in bf16 replay the `ModelInput`s of an engine on the torch backend in float32
  (prefill chunks, decodes, mixed steps, windows sliding); flash must stay as close to the
  float32 logits as torch in bf16 does (LOGITS_SLACK). Every token takes all experts, so no
  routing tie can flip between runs.
- sync: one decode step (input copy, metadata, forward, sampling) under
  `torch.cuda.set_sync_debug_mode("error")`, both models, torch (P = 1) and flash (P = 1, 16).
- mxfp4: bytes resident on the device (`sum(nbytes)` of the loaded model's parameters and
  buffers) of a GPT-OSS MXFP4 checkpoint, against the checkpoint's tensor bytes.
- decode: decode tokens/s at batch 1 / 8 / 64 on a small GPT-OSS config, flash (P = 16) and
  torch (P = 1), each eager and with the decode step as CUDA graphs (`compile`); the ratios
  flash / torch and graphs / eager are the figures against the baselines.
- fp8: block-scaled FP8 linears (`fp8_linear` with 1×128 / 128×128 scales, one matmul) close
  to dequantization at 2, 3, 4 and 5 blocks of 128 columns, and their speed against
  dequantizing the weight per call.
- graphs: CUDA graphs against eager, both models, torch (P = 1) float32: equal greedy tokens
  over a batch whose bucket changes as requests end; torch bf16 and flash (P = 16) bf16: where
  the tokens part, reported (the tiny random models' logits are near-ties in bf16).
- grammar: structured output and penalties on the device: a decode step's logits processing
  (grammar bitmask copied pinned and non-blocking, penalties from device-resident counters,
  bias) and its draw run without a host sync; JSON-schema output at temperature 1 validates on
  16 seeds with CUDA graphs on.

Lines read `check  case  STATUS  detail`, STATUS one of PASS, FAIL, INFO, SKIPPED. Without a
CUDA device every check is SKIPPED and the script exits 0 (harmless in CI); without
vllm-flash-attn the flash cases are SKIPPED. Exit status 1 when a check FAILs. `--device cpu`
runs what needs no GPU (mxfp4, decode on the torch backend), to try the script on a laptop.
`--json` ends with one JSON object: every result and the ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.attention import (
    FlashAttentionBackend,
    TorchAttentionBackend,
    flash_attn_available,
)
from swaserve.worker.attention.base import AttentionLayer, ForwardBatch
from swaserve.worker.kv import KVLayout, SWAKVPool
from swaserve.worker.kv.slot_table import DeviceSlotTable
from swaserve.worker.models.tiny import make_tiny_model
from swaserve.worker.runner.host_tensors import int_tensor, to_device
from swaserve.worker.runner.model_input import ModelInput

ARCHS = ("gpt-oss", "mimo-v2-flash")
FAMILY_MODELS: dict[str, dict[str, Any]] = {
    # chunked local layers (C = WINDOW = 32, two 16-token blocks): the kernel reads from the
    # query's chunk start, a block boundary
    "llama4": dict(num_layers=4),
    # a global layer with heads of 512 (as published): the torch path beside the kernel's
    "gemma4": dict(
        num_layers=3, per_layer_config={"2": {"head_dim": 512, "num_key_value_heads": 1}}
    ),
}
"""More families for the logits check: what their layers need of the kernel."""
WINDOW = 32
DECODE_BATCHES = (1, 8, 64)
DECODE_STEPS = 48


@dataclass
class Result:
    check: str
    case: str
    status: str  # "pass", "fail", "info", "skipped"
    detail: str
    values: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.check:<7} {self.case:<30} {self.status.upper():<7} {self.detail}"


def tiny_model(root: Path, arch: str, **options: Any) -> Path:
    """Head dim 64 (GPT-OSS) or 192 / 128 (MiMo): what flash-attn runs for the real models."""
    name = f"{arch}-" + "-".join(f"{k}{v}" for k, v in sorted(options.items()))
    options = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, **options}
    return make_tiny_model(root / name, arch=arch, sliding_window_size=WINDOW, **options)


def make_engine(model_dir: Path, device: str, backend: str, page_size: int, **extra: Any) -> Engine:
    options: dict[str, Any] = dict(
        model=str(model_dir),
        device=device,
        dtype="bfloat16" if device != "cpu" else "float32",
        max_total_tokens=16384,
        page_size=page_size,
        attention_backend=backend,
        chunked_prefill_size=64,
        check_on_idle=False,
    )
    options.update(extra)
    return Engine(EngineConfig(**options))


# ---- attention -------------------------------------------------------------------------------
ATTN_RTOL = 2e-2
"""One attention call in bf16 (fp32 accumulation in both backends): a few bf16 roundings apart."""
ATTN_SHAPES = {  # heads, full KV heads, SWA KV heads, K dim, V dim
    "gpt-oss dims": (8, 2, 2, 64, 64),
    "mimo dims": (8, 1, 2, 192, 128),
}
ATTN_STEPS = [{0: 100, 1: 37}, {0: 1, 1: 1, 2: 70}, {0: 1, 1: 1, 2: 1}, {2: 33, 0: 1, 1: 1}]


def attention_case(shape: tuple[int, ...], page_size: int, device: str) -> dict[str, float]:
    """The flash and the torch backend, each over its own pools, fed the same q/k/v: a full and
    an SWA layer with sinks, steps of prefills, decodes and mixed batches. Request r owns the
    contiguous slots [1024·(r + 1), 1024·(r + 2)) of both pools (its SWA ids equal its full
    ids). Returns the worst max |flash - torch| / max |torch| per kind of step."""
    heads, full_kv, swa_kv, dk, dv = shape
    layers = [
        AttentionLayer(0, heads, full_kv, dk, dv, dk**-0.5, None),
        AttentionLayer(1, heads, swa_kv, dk, dv, dk**-0.5, WINDOW),
    ]

    def pool() -> SWAKVPool:
        return SWAKVPool(
            full_size=4 * 1024,
            swa_size=4 * 1024,
            full_layer_ids=[0],
            swa_layer_ids=[1],
            full_layout=KVLayout(full_kv, dk, dv),
            swa_layout=KVLayout(swa_kv, dk, dv),
            dtype=torch.bfloat16,
            page_size=page_size,
            device=device,
        )

    flash = FlashAttentionBackend(pool(), WINDOW)
    ref = TorchAttentionBackend(pool(), WINDOW)
    if flash.paged != (page_size % 16 == 0):
        raise RuntimeError(f"P={page_size}: the flash backend chose the wrong path")
    table = DeviceSlotTable(3, 1024, with_swa=True, device=device)
    slots = torch.arange(1024, 4 * 1024, device=device).view(3, 1024)  # [3, 1024] int64
    table.full.copy_(slots)
    assert table.swa is not None
    table.swa.copy_(slots)
    gen = torch.Generator(device=device).manual_seed(0)
    sinks = {x.layer_id: torch.randn(heads, generator=gen, device=device) for x in layers}
    cached = [0, 0, 0]
    worst: dict[str, float] = {}
    for step, extends in enumerate(ATTN_STEPS):
        rids = list(extends)
        prefix = [cached[r] for r in rids]
        seq = [p + extends[r] for p, r in zip(prefix, rids, strict=True)]
        positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq, strict=True)])
        rows = int_tensor(rids)
        owner = (rows + 1).repeat_interleave(int_tensor(list(extends.values())))  # [T] int64
        new = to_device(owner * 1024 + positions, device)  # [T] slots of the new tokens
        outs = []
        for backend in (flash, ref):
            batch = ForwardBatch(
                input_ids=torch.zeros_like(new),
                positions=to_device(positions, device),
                prefix_lens=int_tensor(prefix),
                seq_lens=int_tensor(seq),
                req_rows=rows,
                slot_table=table,
                out_full_loc=new,
                out_swa_loc=new,
            )
            backend.init_forward_metadata(batch)
            step_gen = torch.Generator(device=device).manual_seed(step + 1)
            per_layer = []
            for x in layers:
                t = new.numel()
                q = torch.randn(t, heads, dk, generator=step_gen, device=device)
                k = torch.randn(t, x.num_kv_heads, dk, generator=step_gen, device=device)
                v = torch.randn(t, x.num_kv_heads, dv, generator=step_gen, device=device)
                args = (q.bfloat16(), k.bfloat16(), v.bfloat16(), x, batch)
                per_layer.append(backend.forward(*args, sinks=sinks[x.layer_id]).float())
            outs.append(torch.cat(per_layer))
        ext = list(extends.values())
        kind = "decode" if max(ext) == 1 else "prefill" if min(ext) > 1 else "mixed"
        err = float((outs[0] - outs[1]).abs().max() / outs[1].abs().max())
        worst[kind] = max(worst.get(kind, 0.0), err)
        for r, s in zip(rids, seq, strict=True):
            cached[r] = s
    return worst


def check_attention(root: Path, device: str) -> list[Result]:
    results = []
    for name, shape in ATTN_SHAPES.items():
        for page_size in (1, 16):
            worst = attention_case(shape, page_size, device)
            ok = max(worst.values()) <= ATTN_RTOL
            detail = ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items()))
            path = "paged" if page_size % 16 == 0 else "gathered"
            results.append(
                Result(
                    "attn",
                    f"{name} P={page_size} ({path})",
                    "pass" if ok else "fail",
                    f"max |flash - torch| / max |torch|: {detail} (limit {ATTN_RTOL:.0e})",
                    {"rel_err": worst},
                )
            )
    return results


# ---- logits ----------------------------------------------------------------------------------
LOGITS_SLACK = 1.5
"""Tiny random models amplify bf16 rounding from layer to layer (two layers: 4-8% of the largest
logit, six: up to 40%), so the tolerance is the model's own: flash in bf16 must stay within
1.5 × (torch in bf16's distance to torch in float32) + 1% of the float32 logits."""


def record_steps(engine: Engine) -> list[tuple[ModelInput, torch.Tensor]]:
    """Three greedy requests, one arriving late (mixed steps), decoding past the window."""
    seen: list[tuple[ModelInput, torch.Tensor]] = []
    forward = engine.runner.forward

    def recording(inp: ModelInput) -> torch.Tensor:
        logits = forward(inp)
        seen.append((inp, logits.float().clone()))
        return logits

    engine.runner.forward = recording
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    engine.add_request([(7 * i + 3) % 250 + 1 for i in range(150)], params)
    engine.add_request([(3 * i + 1) % 250 + 1 for i in range(37)], params)
    for _ in range(3):
        engine.step()
    engine.add_request([(11 * i + 5) % 250 + 1 for i in range(90)], params)
    while engine.has_unfinished_requests():
        engine.step()
    return seen


def replay_errors(engine: Engine, steps: list[tuple[ModelInput, torch.Tensor]]) -> dict[str, float]:
    """Teacher-forced: `engine`'s runner runs the recorded inputs; the worst max |got - want| /
    max |want| per kind of step."""
    worst: dict[str, float] = {}
    for inp, want in steps:
        extend = (inp.seq_lens - inp.prefix_lens).tolist()
        kind = "decode" if max(extend) == 1 else "prefill" if min(extend) > 1 else "mixed"
        got = engine.runner.forward(inp).float()  # every step: it writes the KV
        if want.numel():  # a prefill chunk that does not end its prompt samples nothing
            err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
            worst[kind] = max(worst.get(kind, 0.0), err)
    return worst


def check_logits(root: Path, device: str) -> list[Result]:
    results = []
    models = {arch: dict(num_layers=2, num_experts=4, num_experts_per_tok=4) for arch in ARCHS}
    for arch, options in {**models, **FAMILY_MODELS}.items():
        model_dir = tiny_model(root, arch, **options)
        for page_size in (1, 16):
            reference = make_engine(model_dir, device, "torch", page_size, dtype="float32")
            steps = record_steps(reference)
            reference.shutdown()
            errors = {}
            for backend in ("torch", "flash"):
                engine = make_engine(model_dir, device, backend, page_size, dtype="bfloat16")
                errors[backend] = replay_errors(engine, steps)
                paged = bool(getattr(engine.runner.backend, "paged", False))
                engine.shutdown()
            limit = LOGITS_SLACK * max(errors["torch"].values()) + 1e-2
            ok = max(errors["flash"].values()) <= limit and paged == (page_size == 16)
            detail = ", ".join(f"{k} {v:.2e}" for k, v in sorted(errors["flash"].items()))
            results.append(
                Result(
                    "logits",
                    f"{arch} P={page_size} ({'paged' if paged else 'gathered'})",
                    "pass" if ok else "fail",
                    f"bf16 flash vs float32: {detail}; bf16 torch: "
                    f"{max(errors['torch'].values()):.2e} (limit {limit:.2e}); {len(steps)} steps",
                    {"rel_err": errors, "limit": limit, "steps": len(steps)},
                )
            )
    return results


# ---- sync ------------------------------------------------------------------------------------
def where(exc: BaseException) -> str:
    """The innermost frame of the worker's code in `exc`'s traceback, as file:line (code)."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "/worker/" in f.filename or "/swaserve/" in f.filename
    ]
    if not frames:
        return "?"
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].line})"


def check_sync(root: Path, device: str) -> list[Result]:
    results = []
    cases = [("torch", 1), ("flash", 1), ("flash", 16)]
    for arch in ARCHS:
        model_dir = tiny_model(root, arch, num_layers=4)
        for backend, page_size in cases:
            case = f"{arch} {backend} P={page_size}"
            if backend == "flash" and not flash_attn_available():
                results.append(Result("sync", case, "skipped", "vllm-flash-attn not importable"))
                continue
            engine = make_engine(model_dir, device, backend, page_size)
            params = SamplingParams(
                temperature=0.7, top_k=20, max_new_tokens=64, seed=1, ignore_eos=True
            )
            for i in range(4):
                engine.add_request([(i * 31 + j) % 250 + 1 for j in range(40)], params)
            for _ in range(3):
                engine.step()
            batch = engine.scheduler.schedule()
            assert batch is not None and all(n == 1 for n in batch.extend_lens)
            model_input = engine._model_input(batch)  # host work on rank 0
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                logits = engine.runner.forward(model_input)
                tokens = engine.sampler.sample(
                    logits, [r.params for r in batch.reqs], [r.generator for r in batch.reqs]
                )
                error = None
            except RuntimeError as exc:
                error = f"{str(exc).splitlines()[0]} at {where(exc)}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if error is None:
                engine.scheduler.process_results(batch, tokens.tolist())
                while engine.has_unfinished_requests():
                    engine.step()
                engine.check()
            engine.shutdown()
            detail = "a decode step ran without a host sync" if error is None else error
            results.append(Result("sync", case, "pass" if error is None else "fail", detail))
    return results


# ---- mxfp4 -----------------------------------------------------------------------------------
def checkpoint_bytes(model_dir: Path) -> int:
    """Tensor bytes of the safetensors files (their headers' data offsets)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(
            meta["data_offsets"][1] - meta["data_offsets"][0]
            for name, meta in header.items()
            if name != "__metadata__"
        )
    return total


def check_mxfp4(root: Path, device: str) -> list[Result]:
    model_dir = tiny_model(
        root, "gpt-oss", num_layers=2, num_experts=8, quantization="mxfp4", hidden_size=512
    )
    engine = make_engine(model_dir, device, "torch", 1, max_total_tokens=1024)
    model = engine.runner.model
    tensors = [*model.parameters(), *model.buffers()]
    resident = sum(t.numel() * t.element_size() for t in tensors)
    stored = checkpoint_bytes(model_dir)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
    engine.shutdown()
    return [
        Result(
            "mxfp4",
            "gpt-oss MXFP4 experts",
            "info",
            f"resident {resident:,} B vs checkpoint {stored:,} B: {resident / stored:.2f}x "
            f"(dtypes {', '.join(dtypes)})",
            {"resident_bytes": resident, "checkpoint_bytes": stored, "ratio": resident / stored},
        )
    ]


# ---- decode ----------------------------------------------------------------------------------
def decode_tokens_per_s(
    model_dir: Path, device: str, backend: str, batch: int, compile_: bool = False
) -> float:
    page_size = 16 if backend == "flash" else 1
    engine = make_engine(
        model_dir,
        device,
        backend,
        page_size,
        max_running_requests=batch,
        chunked_prefill_size=4096,
        compile=compile_,
    )
    params = SamplingParams(temperature=0, max_new_tokens=DECODE_STEPS + 16, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(i * 13 + j) % 250 + 1 for j in range(64)], params)
    while engine.scheduler.waiting or not all(r.is_decoding for r in engine.scheduler.running):
        engine.step()
    for _ in range(4):  # warm up the decode path
        engine.step()
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()  # each step reads its tokens back: the timing includes the device work
    elapsed = time.perf_counter() - start
    engine.shutdown()
    return batch * DECODE_STEPS / elapsed


def check_decode(root: Path, device: str) -> list[Result]:
    model_dir = tiny_model(root, "gpt-oss", num_layers=4)
    backends = ["torch"] + (["flash"] if device != "cpu" and flash_attn_available() else [])
    results = []
    for batch in DECODE_BATCHES:
        rates = {
            (b, c): decode_tokens_per_s(model_dir, device, b, batch, c)
            for b in backends
            for c in (False, True)
        }
        names = {(b, c): b + (" graphs" if c else "") for b, c in rates}
        detail = ", ".join(f"{names[k]} {r:,.0f} tok/s" for k, r in rates.items())
        values: dict[str, Any] = {
            f"{names[k].replace(' ', '_')}_tokens_per_s": r for k, r in rates.items()
        }
        for b in backends:
            values[f"{b}_graphs_over_eager"] = rates[b, True] / rates[b, False]
        if "flash" in backends:
            values["flash_over_torch"] = rates["flash", False] / rates["torch", False]
        detail += " (" + ", ".join(f"{k} {v:.2f}" for k, v in values.items() if "over" in k) + ")"
        results.append(Result("decode", f"gpt-oss batch {batch}", "info", detail, values))
    return results


def check_graphs(root: Path, device: str) -> list[Result]:
    """CUDA graphs (`compile=True`): greedy tokens equal to the eager engine's, both models,
    decoding past the window with a batch that changes bucket as requests end; every decode
    step replayed a captured graph. The torch backend in float32 must give equal tokens (P = 1);
    in bfloat16 (torch P = 1, flash P = 16) a graph of another batch size rounds otherwise, and
    the tiny random models' logits are near-ties (their top two a bf16 step apart), so where
    tokens part is reported (info), as the eager engine's own batch-vs-solo runs part too."""
    results = []
    cases = [("torch", 1, "float32"), ("torch", 1, "bfloat16")]
    cases += [("flash", 16, "bfloat16")] if flash_attn_available() else []
    prompts = [[(i * 17 + j) % 250 + 1 for j in range(20 + 9 * i)] for i in range(6)]
    params = [
        SamplingParams(temperature=0, max_new_tokens=40 + 12 * i, ignore_eos=True) for i in range(6)
    ]
    for arch in ARCHS:
        model_dir = tiny_model(root, arch, num_layers=4)
        for backend, page_size, dtype in cases:
            case = f"{arch} {backend} P={page_size} {dtype}"
            tokens = {}
            for compile_ in (False, True):
                engine = make_engine(
                    model_dir, device, backend, page_size, compile=compile_, dtype=dtype
                )
                tokens[compile_] = [o.token_ids for o in engine.generate(prompts, params)]
                step = engine.runner.decode_step
                engine.check()
                engine.shutdown()
            assert step is not None
            parted = first_differences(tokens[False], tokens[True])
            same = not parted
            detail = (
                f"tokens {'equal' if same else f'DIFFER in {len(parted)} of 6, from {parted}'}; "
                f"{step.stats.captures} graphs captured, {step.stats.steps} steps, buckets "
                f"{sorted(step.stats.buckets)}, capture {step.stats.compile_s:.1f} s"
            )
            status = "pass" if same else "fail" if dtype == "float32" else "info"
            results.append(Result("graphs", case, status, detail))
    return results


def first_differences(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Where each pair of differing token lists first parts."""
    return [
        next(j for j, (s, t) in enumerate(zip(x, y, strict=True)) if s != t)
        for x, y in zip(a, b, strict=True)
        if x != y
    ]


# ---- fp8 -------------------------------------------------------------------------------------
FP8_SHAPES = ((7, 512), (16, 256), (33, 640), (16, 384))
"""(tokens, columns): 4, 2, 5 and 3 blocks of 128 columns (cuBLAS reads scales in fours)."""


def check_fp8(root: Path, device: str) -> list[Result]:
    """Block-scaled FP8 linears (MiMo-V2-Flash's checkpoints): `fp8_linear` takes the one-matmul
    path on a device with FP8 tensor cores, close to dequantization at every K-block count,
    and its speed against dequantizing the weight per call (4096 × 4096, 1 and 64 tokens)."""
    from swaserve.worker.models import fp8

    dev = torch.device(device)
    if torch.cuda.get_device_capability(dev) < fp8.SCALED_MM_MIN_CAPABILITY:
        return [Result("fp8", "block-scaled matmul", "skipped", "no FP8 tensor cores")]
    if not fp8.scaled_mm_block_supported(dev):
        return [Result("fp8", "block-scaled matmul", "fail", "the probe turned it off (log)")]
    gen = torch.Generator(device=dev).manual_seed(0)
    errors = []
    for tokens, cols in FP8_SHAPES:
        weight, scale_inv = fp8.quantize_fp8(
            torch.randn(384, cols, device=dev, generator=gen), fp8.SCALED_MM_BLOCK
        )
        expanded = scale_inv.repeat_interleave(128, dim=0)  # [R, C / 128]
        x = torch.randn(tokens, cols, device=dev, generator=gen).to(torch.bfloat16)
        block_scale = fp8.scaled_mm_block_scale(weight, expanded, fp8.SCALED_MM_BLOCK, -2)
        got = fp8.fp8_linear(x, weight, expanded, fp8.SCALED_MM_BLOCK, -2, None, block_scale)
        want = x.float() @ fp8.dequantize_fp8(weight, scale_inv, (128, 128), torch.float32).t()
        errors.append(float((got.float() - want).abs().max() / want.abs().max()))
    worst = max(errors)
    results = [
        Result(
            "fp8",
            "block-scaled matmul",
            "pass" if worst < fp8.SCALED_MM_PROBE_TOLERANCE else "fail",
            f"largest error {worst:.3f} of the largest value over {len(FP8_SHAPES)} shapes "
            f"(bound {fp8.SCALED_MM_PROBE_TOLERANCE})",
            {"errors": errors},
        )
    ]
    weight, scale_inv = fp8.quantize_fp8(
        torch.randn(4096, 4096, device=dev, generator=gen), fp8.SCALED_MM_BLOCK
    )
    expanded = scale_inv.repeat_interleave(128, dim=0)
    block_scale = fp8.scaled_mm_block_scale(weight, expanded, fp8.SCALED_MM_BLOCK, -2)
    for tokens in (1, 64):
        x = torch.randn(tokens, 4096, device=dev, generator=gen).to(torch.bfloat16)
        seconds = {}
        for name, scales in (("dequantize", None), ("block", block_scale)):
            seconds[name] = cuda_seconds(
                functools.partial(
                    fp8.fp8_linear, x, weight, expanded, fp8.SCALED_MM_BLOCK, -2, None, scales
                )
            )
        ratio = seconds["dequantize"] / seconds["block"]
        results.append(
            Result(
                "fp8",
                f"4096x4096 linear, {tokens} tokens",
                "info",
                f"block-scaled {seconds['block'] * 1e6:.0f} us, dequantized per call "
                f"{seconds['dequantize'] * 1e6:.0f} us ({ratio:.1f}x)",
                {"block_s": seconds["block"], "dequantize_s": seconds["dequantize"]},
            )
        )
    return results


def cuda_seconds(fn: Callable[[], Any], repeats: int = 50) -> float:
    """Median seconds of one call, by CUDA events, after warm-up calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


GRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


def check_grammar(root: Path, device: str) -> list[Result]:
    from swaserve.proto import StructuredOutputs

    model_dir = tiny_model(root, "gpt-oss", num_layers=4)
    engine = make_engine(model_dir, device, "torch", 1, compile=True)
    spec = StructuredOutputs(json_schema=GRAMMAR_SCHEMA)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_new_tokens=96,
            presence_penalty=0.5,
            repetition_penalty=1.1,
            logit_bias={5: 1.0},
            structured_outputs=spec if s % 2 else None,
        )
        for s in range(16)
    ]
    for i, p in enumerate(params[:4]):
        engine.add_request([(i * 31 + j) % 250 + 1 for j in range(40)], p)
    for _ in range(3):
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch is not None and all(n == 1 for n in batch.extend_lens)
    sampled = engine._sampled_reqs(batch)
    masks = engine._start_masks(sampled)
    model_input = engine._model_input(batch)
    logits = engine.runner.forward(model_input)
    if masks is not None:
        masks.result()  # filled on the host thread: only the device work is watched
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        processed = engine._process(logits, sampled, masks)
        tokens = engine.sampler.sample(
            processed, [r.params for r in sampled], [r.generator for r in sampled]
        )
        error = None
    except RuntimeError as exc:
        error = f"{str(exc).splitlines()[0]} at {where(exc)}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    results = [
        Result(
            "grammar",
            "processing without a sync",
            "pass" if error is None else "fail",
            "masks, penalties, bias and the draw ran without a host sync"
            if error is None
            else error,
        )
    ]
    if error is None:
        next_tokens: list[int | None] = list(tokens.tolist())
        stopped = engine._accept(batch, next_tokens)
        engine.scheduler.process_results(batch, next_tokens, stopped)
    while engine.has_unfinished_requests():
        engine.step()
    outs = engine.generate(["JSON: "] * 16, params)
    bad = []
    for out, p in zip(outs, params, strict=True):
        if p.structured_outputs is None:
            continue
        try:
            value = json.loads(out.text)
            ok = out.finish_reason == "stop" and set(value) >= {"name", "n"}
        except ValueError:
            ok = False
        if not ok:
            bad.append(out.text[:60])
    engine.check()
    engine.shutdown()
    detail = "8 of 8 constrained outputs valid JSON of the schema" if not bad else f"invalid: {bad}"
    results.append(
        Result("grammar", "json schema, 16 seeds", "pass" if not bad else "fail", detail)
    )
    return results


def check_speculative(root: Path, device: str) -> list[Result]:
    """N-gram drafts (windowed and chunked models) and MTP drafts (MiMo-V2-Flash: the depths'
    forwards after each step as captured draft graphs, the step's hidden states kept by the
    captured decode graph) on the
    device: greedy tokens equal plain decoding's with CUDA graphs on (a step that decodes and
    verifies replays a graph of as many rows as tokens); and the decode speed with and without
    drafts on prompts that repeat themselves. The torch backend runs float32 (equal tokens or it fails); flash runs bf16
    (P = 16), where graphs of other batch sizes may round a near-tie apart: differing tokens
    there are reported (info) with where they part, for a person to read."""
    results = []
    cases = [("torch", 1)] + ([("flash", 16)] if flash_attn_available() else [])
    prompts = [([(i * 7 + j) % 40 + 1 for j in range(6 + i)] * 8)[:60] for i in range(8)]
    params = SamplingParams(temperature=0, max_new_tokens=96, ignore_eos=True)
    for arch, drafter in (("gpt-oss", "ngram"), ("llama4", "ngram"), ("mimo-v2-flash", "mtp")):
        model_dir = tiny_model(root, arch, **FAMILY_MODELS.get(arch, {"num_layers": 4}))
        for backend, page_size in cases:
            outs, seconds, accepted = {}, {}, 0
            dtype = "float32" if backend == "torch" else "bfloat16"
            for method in (None, drafter):
                engine = make_engine(
                    model_dir,
                    device,
                    backend,
                    page_size,
                    compile=True,
                    speculative_method=method,
                    dtype=dtype,
                )
                engine.generate(prompts[:1], params)  # warm
                start = time.perf_counter()
                outs[method] = [o.token_ids for o in engine.generate(prompts, params)]
                seconds[method] = time.perf_counter() - start
                accepted = engine.stats.spec_accepted_tokens or accepted
                engine.check()
                engine.shutdown()
            same = outs[None] == outs[drafter]
            parted = first_differences(outs[None], outs[drafter])
            detail = (
                f"tokens {'equal' if same else f'DIFFER in {len(parted)} of 8, from {parted}'}; "
                f"{accepted} {drafter} drafts accepted; batch 8 end to end "
                f"{seconds[None] / seconds[drafter]:.2f}x plain"
            )
            status = "pass" if same else "fail" if backend == "torch" else "info"
            results.append(
                Result("spec", f"{arch} {drafter} {backend} P={page_size} {dtype}", status, detail)
            )
    return results


CHECKS: dict[str, Callable[[Path, str], list[Result]]] = {
    "attn": check_attention,
    "logits": check_logits,
    "sync": check_sync,
    "mxfp4": check_mxfp4,
    "fp8": check_fp8,
    "decode": check_decode,
    "graphs": check_graphs,
    "grammar": check_grammar,
    "spec": check_speculative,
}
NEEDS = {
    "attn": "flash",
    "logits": "flash",
    "sync": "cuda",
    "mxfp4": "any",
    "fp8": "cuda",
    "decode": "any",
    "graphs": "cuda",
    "grammar": "cuda",
    "spec": "cuda",
}


def skip_reason(check: str, device: str) -> str | None:
    need = NEEDS[check]
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if need in ("cuda", "flash") and device == "cpu":
        return "needs a CUDA device"
    if need == "flash" and not flash_attn_available():
        return "vllm-flash-attn not importable (pip install 'swaserve[gpu]')"
    return None


def run(device: str, emit: Callable[[Result], None]) -> list[Result]:
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, check in CHECKS.items():
            reason = skip_reason(name, device)
            if reason is not None:
                found = [Result(name, "all", "skipped", reason)]
            else:
                start = time.perf_counter()
                try:
                    found = check(Path(tmp), device)
                except Exception as exc:  # report it and go on with the other checks
                    traceback.print_exc(file=sys.stderr)
                    found = [Result(name, "all", "fail", f"{type(exc).__name__}: {exc}")]
                for r in found:
                    r.values.setdefault("check_s", round(time.perf_counter() - start, 2))
            for r in found:
                emit(r)
            results += found
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"gpu_check: torch {torch.__version__}, CUDA device: {device_name}", flush=True)
    start = time.perf_counter()
    results = run(args.device, lambda r: print(r.line(), flush=True))
    failed = [r for r in results if r.status == "fail"]
    total_s = time.perf_counter() - start
    print(f"gpu_check: {len(failed)} failed, {total_s:.1f} s", flush=True)
    if args.json:
        ratios = {
            r.case: r.values["flash_over_torch"] for r in results if "flash_over_torch" in r.values
        }
        summary = {
            "device": device_name,
            "torch": torch.__version__,
            "failed": len(failed),
            "total_s": round(total_s, 2),
            "results": [asdict(r) for r in results],
            "ratios": ratios,
        }
        print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
