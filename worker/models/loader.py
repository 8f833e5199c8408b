"""Load an HF model dir: config.json → model class (built on the meta device) → safetensors
weights, from `model.safetensors` or a sharded checkpoint with `model.safetensors.index.json`.
Local files only; nothing is ever downloaded.

Each parameter is looked up in every layout its architecture's `WeightMap` declares (packed
in-memory names first, then the original / published layout) and, when config.json has a
`quantization_config`, in its quantized form (MXFP4 blocks + scales, FP8 weight + block scales).
A model built with `dequantize_weights=False` (the engine's default) holds those parameters in
their stored form (`quantized_weights.keep_quantized`): the loader copies the checkpoint's bytes
(FP8 block scales expanded along one dimension). Otherwise the tensors are dequantized to the
parameter's dtype while loading, one tensor (one expert) at a time.

The whole checkpoint is checked before any data is read, and every mismatch is a typed error
that names the tensor: a parameter without a tensor (`MissingTensorError`), a tensor of another
shape (`TensorShapeError`), a quantized tensor that does not fit (`QuantizedTensorError`),
tensors nothing takes (`UnexpectedTensorError`; tensors a declared `SkipRule` covers are skipped
and logged once), a truncated file (`CheckpointFileError`).

Tensor parallelism: a model built with a `TPGroup` holds each rank's shard. Its layers declare
their parameters' `ParamShard`s; the loader plans and checks every parameter at its *full* shape
(so every layout above shards alike) and each rank then reads only its pieces of each tensor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from swaserve.worker.attention.base import AttentionBackend
from swaserve.worker.models.causal_lm import HybridCausalLM
from swaserve.worker.models.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint
from swaserve.worker.models.config import ModelConfig, load_model_config
from swaserve.worker.models.errors import (
    MissingTensorError,
    QuantizedTensorError,
    UnexpectedTensorError,
)
from swaserve.worker.models.fp8 import FP8_DTYPE
from swaserve.worker.models.param_shard import Index, ParamShard, Region, indexed_shape
from swaserve.worker.models.quantization import FP8, MXFP4, QuantizationConfig
from swaserve.worker.models.quantized_weights import Fp8Weight, keep_quantized
from swaserve.worker.models.registry import get_model_class
from swaserve.worker.models.weight_maps import Placement, SkipRule, weight_map
from swaserve.worker.models.weight_sources import (
    FP8_SCALE,
    MXFP4_BLOCKS,
    Fp8ScaleSource,
    Fp8Source,
    PlainSource,
    Source,
    resolve_source,
)
from swaserve.worker.runner.parallel import TPGroup

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "LoadReport",
    "build_meta_model",
    "build_model",
    "checkpoint_index",
    "load_model",
    "load_weights",
]

logger = logging.getLogger(__name__)
_MAX_NAMES_IN_MESSAGE = 8
# Parameters of these dtypes hold a checkpoint tensor's own bytes (kept quantized).
_STORED_DTYPES = {FP8_DTYPE: "F8_E4M3", torch.uint8: "U8"}


@dataclass(slots=True)
class LoadReport:
    """What `load_weights` read."""

    num_tensors: int = 0  # checkpoint tensors read (a quantized pair counts two)
    num_bytes: int = 0  # their bytes on disk
    num_files: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # names a SkipRule covered
    quantization: str = "none"  # the checkpoint's quant_method


@dataclass(frozen=True, slots=True)
class _Read:
    """One read of the plan: `target[index] = source[region]` (region None: the whole)."""

    target: torch.Tensor
    index: Index
    source: Source
    region: Region | None


def load_model(
    model_dir: str | Path,
    backend: AttentionBackend,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    tp: TPGroup | None = None,
    dequantize_weights: bool = True,
) -> HybridCausalLM:
    """Parse config.json, build the model on `device` in `dtype`, load its weights (eval mode).
    `progress`: show a progress bar (None: only on a terminal). `tp`: this rank's TP group; the
    model holds and loads only its shard (None or a single group: the whole model).
    `dequantize_weights`: a quantized checkpoint's tensors are dequantized to `dtype` at load
    (True), or kept in memory as stored (False, the engine's default; see `quantized_weights`)."""
    config = load_model_config(model_dir)
    model = build_model(
        config, backend, dtype=dtype, device=device, tp=tp, dequantize_weights=dequantize_weights
    )
    load_weights(model, model_dir, progress=progress)
    return model


def build_model(
    config: ModelConfig,
    backend: AttentionBackend,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp: TPGroup | None = None,
    dequantize_weights: bool = True,
) -> HybridCausalLM:
    """The registered class for `config.architecture`, built on meta for `tp`'s rank (raises
    `ShardingError` when the config does not split over it), with the checkpoint's quantized
    parameters in their stored form unless `dequantize_weights`, then given uninitialized
    storage on `device`: load weights before running it."""
    return (
        build_meta_model(config, backend, dtype=dtype, tp=tp, dequantize_weights=dequantize_weights)
        .materialize(device)
        .eval()
    )


def build_meta_model(
    config: ModelConfig,
    backend: AttentionBackend,
    *,
    dtype: torch.dtype = torch.float32,
    tp: TPGroup | None = None,
    dequantize_weights: bool = True,
) -> HybridCausalLM:
    """`build_model` without storage: every parameter on the meta device, with the shape and
    dtype it will have (`quantized_weights.resident_bytes` of it is what the weights will hold)."""
    cls = get_model_class(config.architecture)
    if tp is not None:
        config.check_tp_size(tp.world_size)
    with torch.device("meta"):
        model = cls(config, backend, dtype=dtype, tp=tp)
    if config.quantization is not None and not dequantize_weights:
        keep_quantized(model, config.quantization)
    return model


def checkpoint_index(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name → safetensors file that holds it."""
    return {name: info.path for name, info in Checkpoint(model_dir).tensors.items()}


def load_weights(
    model: HybridCausalLM, model_dir: str | Path, *, progress: bool | None = None
) -> LoadReport:
    """Fill every parameter and persistent buffer of `model` from the checkpoint in `model_dir`
    (cast to the parameter's dtype, on its device; a quantized tensor dequantized, unless the
    parameter keeps its stored form). Checks names, shapes and quantized layouts of the whole
    checkpoint before reading any data."""
    start = time.perf_counter()
    checkpoint = Checkpoint(model_dir)
    plan, padded, report = _plan(model, checkpoint)
    report.num_files = len(checkpoint.files)
    with (
        checkpoint,
        torch.no_grad(),
        tqdm(
            total=report.num_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"loading {Path(model_dir).name}",
            disable=None if progress is None else not progress,
        ) as bar,
    ):
        for target in padded:
            target.zero_()  # rows past the vocabulary on a vocab-parallel rank
        counted: set[int] = set()
        for read in plan:
            read.source.read_into(read.target[read.index], checkpoint, read.region)
            if id(read.source) not in counted:
                counted.add(id(read.source))
                bar.update(read.source.num_bytes)
    report.seconds = time.perf_counter() - start
    logger.info(
        "loaded %d tensors (%.1f MiB, quantization %s) from %d file(s) in %s in %.2f s",
        report.num_tensors,
        report.num_bytes / 2**20,
        report.quantization,
        report.num_files,
        model_dir,
        report.seconds,
    )
    return report


def _plan(
    model: HybridCausalLM, checkpoint: Checkpoint
) -> tuple[list[_Read], list[torch.Tensor], LoadReport]:
    """(the reads that fill every parameter — this rank's pieces of it —, the parameters to
    zero-fill first since part of them is padding, what will be read), checked; or raise."""
    config = model.config
    layouts = weight_map(config.architecture)
    quantization = config.quantization
    targets, aliases = _load_targets(model)
    shards = _param_shards(model)
    fp8_scales = _fp8_scales(model)
    canonical_alias = {canonical: alias for alias, canonical in aliases.items()}
    plan: list[_Read] = []
    checks: list[tuple[Source, tuple[int, ...]]] = []
    chosen_sources: list[Source] = []
    missing: list[str] = []
    tried: list[str] = []
    for name, target in targets.items():
        shard = shards.get(id(target))
        shape = shard.full_shape if shard is not None else tuple(target.shape)
        fp8_scale = fp8_scales.get(name)
        stored_as = fp8_scale[0] if fp8_scale is not None else name  # a scale: its weight's
        candidates = layouts.layouts(stored_as, shape)
        if name in canonical_alias:
            candidates += layouts.layouts(canonical_alias[name], shape)
        resolve = _resolver(name, target, fp8_scale, checkpoint, quantization)
        chosen, absent = _first_complete(candidates, resolve)
        if chosen is None:
            missing.append(name)
            tried += absent
            continue
        for placement, source in chosen:
            chosen_sources.append(source)
            checks.append((source, indexed_shape(shape, placement.index)))
            if shard is None:
                plan.append(_Read(target, placement.index, source, None))
            else:
                plan += [
                    _Read(target, index, source, region)
                    for index, region in shard.pieces(placement.index)
                ]
    if missing:
        also = f"; the original layout also lacks {_names(tried)}" if tried else ""
        raise MissingTensorError(
            f"checkpoint in {checkpoint.root} has no tensor for {_names(missing)} "
            f"({len(missing)} missing){also}{_quantized_hint(missing, checkpoint, quantization)}"
        )
    used = {n for source in chosen_sources for n in source.names}
    report = LoadReport(quantization=quantization.method if quantization else "none")
    skip_rules = _skip_rules(model)
    unexpected: list[str] = []
    for name in checkpoint.tensors:
        if name in used:
            continue
        rule = next((r for r in skip_rules if r.matches(name)), None)
        if rule is not None:
            report.skipped.append(name)
        elif name not in aliases:  # a tied LM head's own copy may be there; it is not needed
            unexpected.append(name)
    if unexpected:
        raise UnexpectedTensorError(
            f"checkpoint in {checkpoint.root} has tensors the {config.architecture} model does "
            f"not take: {_names(unexpected)} ({len(unexpected)} unexpected)"
        )
    for source, expected in checks:
        source.check(expected)
    if report.skipped:
        reasons = sorted({r.reason for r in skip_rules if any(map(r.matches, report.skipped))})
        logger.info(
            "skipping %d checkpoint tensors (%s): %s",
            len(report.skipped),
            "; ".join(reasons),
            _names(report.skipped),
        )
    report.num_tensors = sum(len(source.names) for source in chosen_sources)
    report.num_bytes = sum(source.num_bytes for source in chosen_sources)
    padded = [t for t in targets.values() if id(t) in shards and shards[id(t)].is_padded]
    return plan, padded, report


def _first_complete(
    candidates: list[list[Placement]], resolve: Callable[[str], Source | None]
) -> tuple[list[tuple[Placement, Source]] | None, list[str]]:
    """(the first layout whose every tensor the checkpoint holds, with their sources; or None
    and the tensors the other layouts lack)."""
    absent: list[str] = []
    for i, layout in enumerate(candidates):
        found = [(placement, resolve(placement.source)) for placement in layout]
        complete = [(p, source) for p, source in found if source is not None]
        if len(complete) == len(layout):
            return complete, []
        if i > 0:
            absent += [p.source for p, source in found if source is None]
    return None, absent


def _resolver(
    name: str,
    target: torch.Tensor,
    fp8_scale: tuple[str, Fp8Weight] | None,
    checkpoint: Checkpoint,
    quantization: QuantizationConfig | None,
) -> Callable[[str], Source | None]:
    """How target `name` reads one checkpoint tensor: dequantized into a float parameter (the
    source as found), as stored into a parameter kept quantized (the checkpoint's own bytes),
    or, for the scale of an FP8 weight kept quantized, its block scales expanded."""
    stored = _STORED_DTYPES.get(target.dtype)

    def resolve(source_name: str) -> Source | None:
        source = resolve_source(source_name, checkpoint, quantization)
        if source is None or (stored is None and fp8_scale is None):
            return source
        if isinstance(source, Fp8Source):
            if fp8_scale is not None:
                fp8 = fp8_scale[1]
                return Fp8ScaleSource(
                    source.weight, source.scale_inv, fp8.block_size, fp8.expand_dim
                )
            return PlainSource(source.weight, stored_dtype=stored)
        if isinstance(source, PlainSource) and fp8_scale is None:
            return PlainSource(source.info, stored_dtype=stored)
        raise QuantizedTensorError(
            f"{name} is kept quantized ({quantization.method if quantization else 'none'}), but "
            f"the checkpoint stores {source_name!r} unquantized; load with dequantize_weights=True"
        )

    return resolve


def _fp8_scales(model: HybridCausalLM) -> dict[str, tuple[str, Fp8Weight]]:
    """Resident scale name → (its weight's name, how it is held), for every FP8 weight the
    model keeps quantized."""
    found: dict[str, tuple[str, Fp8Weight]] = {}
    for prefix, module in model.named_modules():
        for held in getattr(module, "quantized", {}).values():
            if isinstance(held, Fp8Weight):
                weight = f"{prefix}.{held.name}" if prefix else held.name
                found[weight + FP8_SCALE] = (weight, held)
    return found


def _quantized_hint(
    missing: list[str], checkpoint: Checkpoint, quantization: QuantizationConfig | None
) -> str:
    """Why a parameter stored quantized was not found: config.json does not declare it."""
    for name in missing:
        for suffix, method in ((MXFP4_BLOCKS, MXFP4), (FP8_SCALE, FP8)):
            if name + suffix in checkpoint and (
                quantization is None or quantization.method != method
            ):
                return (
                    f"; the checkpoint holds {name + suffix!r} ({method}) but config.json has no "
                    f"quantization_config with quant_method {method!r}"
                )
    return ""


def _skip_rules(model: HybridCausalLM) -> list[SkipRule]:
    """The architecture's declared rules, plus any pattern the model class declares alone."""
    rules = list(weight_map(model.config.architecture).skip)
    declared = {r.pattern for r in rules}
    rules += [
        SkipRule(p, f"ignored by {type(model).__name__}")
        for p in model.ignored_checkpoint_tensors
        if p not in declared
    ]
    return rules


def _load_targets(model: HybridCausalLM) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name → tensor to fill, for each parameter and persistent buffer once;
    alias name → canonical name, for tied parameters)."""
    targets: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in first_name:
            aliases[name] = first_name[key]
            continue
        first_name[key] = name
        targets[name] = tensor
    return targets, aliases


def _param_shards(model: HybridCausalLM) -> dict[int, ParamShard]:
    """id(parameter) → the shard this rank holds of it, for every sharded parameter (layers
    declare theirs in `param_shards`; a shard that is the whole parameter is left out)."""
    shards: dict[int, ParamShard] = {}
    for module in model.modules():
        for key, shard in getattr(module, "param_shards", {}).items():
            param = getattr(module, key)
            if not shard.is_whole:
                if tuple(param.shape) != shard.local_shape:
                    raise ValueError(f"{type(module).__name__}.{key}: shape does not fit {shard}")
                shards[id(param)] = shard
    return shards


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_NAMES_IN_MESSAGE])
    return shown + (", ..." if len(names) > _MAX_NAMES_IN_MESSAGE else "")
