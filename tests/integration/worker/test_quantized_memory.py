"""Quantized checkpoints stay quantized in memory, end to end (CPU, float32), on an MXFP4 GPT-OSS
and an FP8 MiMo-V2-Flash tiny checkpoint whose experts hold most of the bytes:

(a) the engine's greedy tokens equal the dequantized-at-load engine's (and transformers' on the
    dequantized weights), logits within 1e-4, prefill (grouped experts) and decode (gathered);
(b) the weights hold at most 1.5x the checkpoint's bytes (dequantized: several times more);
(c) the KV budget is sized after the weights are loaded, from their real bytes (nbytes: an
    MXFP4 byte holds two values), not from element counts at the model dtype; a TP group, whose
    ranks get the plan before they load, counts rank 0's shard's exact bytes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from test_quantized_tp import CASES as TP_CASES
from test_quantized_tp import run_steps_kept_quantized
from test_tp_model import run_steps

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.models.checkpoint import Checkpoint
from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.quantized_weights import resident_bytes
from swaserve.worker.runner.model_runner import default_kv_cache_bytes, shard_weight_bytes
from swaserve.worker.runner.parallel import TPGroup

TOLERANCE = 1e-4
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 12, 64, 8, 30], [200, 1, 33, 8, 90, 144, 2]]
MAX_NEW = 12
# 32 experts of 256 units over hidden 64: the experts are ~80 % of the checkpoint's bytes.
EXPERT_HEAVY = dict(hidden_size=64, num_layers=3, num_experts=32, num_experts_per_tok=2)
MODELS = {
    "gpt-oss-mxfp4": dict(arch="gpt-oss", quantization="mxfp4", intermediate_size=256),
    # without MTP depths: they are loaded only to draft (speculative_method="mtp")
    "mimo-fp8": dict(
        arch="mimo-v2-flash", quantization="fp8", moe_intermediate_size=256, mtp_layers=0
    ),
}


@pytest.fixture(params=sorted(MODELS))
def model_dir(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(**MODELS[request.param], **EXPERT_HEAVY)


def engine(model_dir: Path, dequantize: bool, **options: object) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir),
            max_total_tokens=256,
            swa_full_tokens_ratio=0.5,
            dequantize_weights=dequantize,
            **options,  # type: ignore[arg-type]
        )
    )


def greedy(e: Engine) -> list[list[int]]:
    outs = e.generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)
    )
    return [o.token_ids for o in outs]


def checkpoint_file_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def test_greedy_tokens_and_logits_equal_the_dequantized_path(model_dir: Path) -> None:
    kept = engine(model_dir, dequantize=False)
    assert resident_bytes(kept.runner.model) < resident_bytes(engine(model_dir, True).runner.model)
    assert greedy(kept) == greedy(engine(model_dir, dequantize=True))
    want = run_steps(TPGroup.single(), str(model_dir))  # prefill grouped, decode gathered
    got = run_steps_kept_quantized(TPGroup.single(), str(model_dir))
    worst = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
    assert worst <= TOLERANCE


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ours = engine(model_dir, dequantize=True).runner.model.checkpoint_state_dict()
    config = transformers.AutoConfig.from_pretrained(model_dir)
    del config.quantization_config
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    result = hf.load_state_dict(ours, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    expected = []
    for prompt in PROMPTS:
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
        )
        expected.append(out[0, len(prompt) :].tolist())
    assert greedy(engine(model_dir, dequantize=False)) == expected


def test_resident_weights_hold_at_most_1_5x_the_checkpoint(model_dir: Path) -> None:
    file_bytes = checkpoint_file_bytes(model_dir)
    kept = engine(model_dir, dequantize=False).weight_bytes
    dequantized = engine(model_dir, dequantize=True).weight_bytes
    assert kept <= 1.5 * file_bytes
    assert dequantized >= 3 * file_bytes  # float32: 8 bytes per MXFP4 byte, 4 per FP8 byte


def test_kv_budget_is_sized_after_the_load_from_the_weights_bytes(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[dict[str, object]] = []

    def spy(config: EngineConfig, device: torch.device, **kw: object) -> int | None:
        asked.append(kw)
        return default_kv_cache_bytes(config, device, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr("swaserve.worker.runner.model_executor.default_kv_cache_bytes", spy)
    e = Engine(EngineConfig(model=str(model_dir)))  # no budget given: the default is asked
    assert asked == [{"weight_bytes": e.weight_bytes, "weights_loaded": True}]
    assert e.weight_bytes == resident_bytes(e.runner.model)


def test_cuda_budget_counts_real_bytes(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    free = 10 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    cuda = torch.device("cuda")
    config = EngineConfig(model=str(model_dir), mem_fraction_static=0.5)
    mc = load_model_config(model_dir)
    exact = shard_weight_bytes(config, mc, torch.float32, 1)
    checkpoint = Checkpoint(model_dir).tensors.values()
    stored = sum(info.num_bytes for info in checkpoint)
    if mc.quantization is not None and mc.quantization.method == "mxfp4":
        assert exact == stored  # float32 elsewhere: the weights hold the checkpoint's bytes
    else:  # FP8 scales expanded along one dimension: a few % more
        assert stored < exact <= 1.1 * stored
    numel_at_dtype = 4 * sum(int(np.prod(info.shape)) for info in checkpoint)
    assert numel_at_dtype > 1.5 * exact  # what counting elements at the model dtype predicted
    before = default_kv_cache_bytes(config, cuda, weight_bytes=exact, weights_loaded=False)
    after = default_kv_cache_bytes(config, cuda, weight_bytes=exact, weights_loaded=True)
    assert before == int((free - exact) * 0.5)
    assert after == int(free * 0.5)  # measured once the weights are resident
    with pytest.raises(ValueError, match="no GPU memory left"):
        default_kv_cache_bytes(config, cuda, weight_bytes=free + 1, weights_loaded=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-oss-mxfp4-k-straddles", "mimo-fp8"])
def test_tp2_engine_kept_quantized_greedy_equals_tp1_dequantized(
    name: str, tiny_model_factory: Callable[..., Path]
) -> None:
    """Ranks of a TP group get the KV plan before they load: it counts rank 0's shard's exact
    bytes (`shard_weight_bytes`), which its loaded shard then holds."""
    model_dir = str(tiny_model_factory(**TP_CASES[name]))
    prompts = [[5, 17, 99, 3, 250, 41, 7, 12, 64], [200, 1, 33, 8, 90, 144]]
    greedy = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    options = dict(model=model_dir, max_total_tokens=128, swa_full_tokens_ratio=0.5)
    want = Engine(EngineConfig(**options, dequantize_weights=True)).generate(prompts, greedy)
    tp = Engine(EngineConfig(**options, tp_size=2, tp_timeout_s=20.0))
    try:
        config = load_model_config(model_dir)
        planned = shard_weight_bytes(tp.config, config, torch.float32, 2)
        assert tp.weight_bytes == planned
        assert tp.weight_bytes < Engine(EngineConfig(**options)).weight_bytes  # half the experts
        got = tp.generate(prompts, greedy)
    finally:
        tp.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
