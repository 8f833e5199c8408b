"""Checkpoints as users have them, end to end against transformers: a model built and saved with
transformers' own `save_pretrained` (MiMo-V2-Flash then holds per-expert gate/up/down_proj and
`attention_sink_bias`), and an MXFP4 GPT-OSS checkpoint, served by swaserve's Engine through
pools small enough that SWA freeing and tombstoning happen (P = 1 and 4): the greedy tokens equal
transformers' `generate`."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.models.loader import SINGLE_FILE
from swaserve.worker.models.tiny import make_tiny_model, write_byte_tokenizer

transformers = pytest.importorskip("transformers")

W = 8
MAX_NEW = 24
Reference = tuple[Path, list[list[int]], list[list[int]]]


def workload(seed: int) -> list[list[int]]:
    """6 prompts of 1..120 tokens; half share a 48-token system prefix."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(48)]
    prompts = []
    for i in range(6):
        n = rng.randint(50, 120) if i % 4 else rng.randint(1, 5)
        body = [rng.randrange(1, 250) for _ in range(n)]
        prompts.append((system + body)[:n] if i % 2 else body)
    return prompts


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
        )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def engine_greedy(path: Path, prompts: list[list[int]], page_size: int) -> list[list[int]]:
    engine = Engine(
        EngineConfig(
            model=str(path),
            max_total_tokens=320,
            swa_full_tokens_ratio=0.3,
            schedule_conservativeness=0.2,
            chunked_prefill_size=32,
            page_size=page_size,
            swa_eviction_interval=8,
            max_running_requests=4,
        )
    )
    outs = engine.generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)
    )
    assert engine.stats.tombstoned_pages > 0
    assert engine.stats.swa_freed_tokens > 0
    engine.shutdown()
    return [out.token_ids for out in outs]


def tensor_names(path: Path) -> set[str]:
    with safe_open(str(path / SINGLE_FILE), framework="pt") as f:
        return set(f.keys())


@pytest.fixture(
    scope="module",
    params=[
        "gpt-oss",
        "mimo-v2-flash",
        "gemma3",
        "gemma4",
        "cohere2",
        "olmo3",
        "exaone4",
        "llama4",
    ],
)
def saved_by_transformers(
    request: pytest.FixtureRequest,
    tiny_model_factory: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Reference:
    """A transformers model built from a tiny config, given the tiny model's random weights by
    their in-memory names, saved with `save_pretrained`; and its greedy tokens."""
    arch = request.param
    layers = 6 if arch == "gemma4" else 4  # Gemma 4's last two share KV
    source = tiny_model_factory(arch, num_layers=layers, sliding_window_size=W, seed=7)
    config = transformers.AutoConfig.from_pretrained(source)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    result = hf.load_state_dict(load_file(source / SINGLE_FILE), strict=False)
    tied = ["lm_head.weight"] if config.tie_word_embeddings else []
    # MiMo-V2-Flash's MTP layers (the tiny maker writes them, as published) are not HF's
    assert result.missing_keys == tied
    assert not [k for k in result.unexpected_keys if not k.startswith("model.mtp.")]
    hf.tie_weights()
    saved = tmp_path_factory.mktemp(f"saved-{arch}")
    hf.save_pretrained(saved)
    prompts = workload(1)
    return saved, prompts, hf_greedy(hf, prompts)


@pytest.mark.slow
def test_save_pretrained_writes_the_original_layout(saved_by_transformers: Reference) -> None:
    path, _, _ = saved_by_transformers
    names = tensor_names(path)
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    if arch == "MiMoV2FlashForCausalLM":
        assert "model.layers.1.self_attn.attention_sink_bias" in names
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in names
        assert "model.layers.1.mlp.experts.gate_up_proj" not in names
        tiny = make_tiny_model(
            path.parent / "tiny-original",
            arch="mimo-v2-flash",
            num_layers=4,
            sliding_window_size=W,
            checkpoint_format="original",
        )
        # the tiny writer's original layout is transformers', plus the MTP depths it drops
        mtp = {n for n in tensor_names(tiny) if n.startswith("model.mtp.layers.")}
        assert len(mtp) == 3 * 14 and tensor_names(tiny) - mtp == names
    elif arch in ("Olmo3ForCausalLM", "Exaone4ForCausalLM"):  # module names as they are
        assert "model.layers.1.self_attn.q_norm.weight" in names
        assert "model.layers.1.post_feedforward_layernorm.weight" in names
    elif arch == "Gemma4ForCausalLM":  # module names as they are; shared layers own no K/V
        assert "model.layers.1.self_attn.k_norm.weight" in names
        assert "model.embed_tokens_per_layer.weight" in names
        assert "model.layers.4.self_attn.k_proj.weight" not in names  # a KV-shared layer
    elif arch == "Llama4ForCausalLM":  # module names as they are, experts packed
        assert "model.layers.1.feed_forward.experts.gate_up_proj" in names
        assert "model.layers.1.feed_forward.shared_expert.up_proj.weight" in names
        assert "model.layers.0.feed_forward.gate_proj.weight" in names  # a dense layer
    elif arch == "Cohere2ForCausalLM":  # module names as they are; the LM head is the embedding
        assert "model.layers.1.input_layernorm.weight" in names
        assert "lm_head.weight" not in names
    elif arch == "Gemma3ForCausalLM":  # module names as they are; the LM head is the embedding
        assert "model.layers.1.self_attn.q_norm.weight" in names
        assert "model.layers.1.pre_feedforward_layernorm.weight" in names
        assert "lm_head.weight" not in names
    else:
        assert "model.layers.1.mlp.experts.gate_up_proj" in names  # GPT-OSS is saved packed


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 4])
def test_save_pretrained_model_greedy_equals_transformers(
    saved_by_transformers: Reference, page_size: int
) -> None:
    path, prompts, expected = saved_by_transformers
    assert engine_greedy(path, prompts, page_size) == expected


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """A GPT-OSS checkpoint with random MXFP4 experts, and the greedy tokens of a transformers
    model that holds transformers' own dequantization of them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = make_tiny_model(
        tmp_path_factory.mktemp("mxfp4"),
        arch="gpt-oss",
        num_layers=4,
        sliding_window_size=W,
        seed=3,
        quantization="mxfp4",
    )
    write_byte_tokenizer(path)
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(path / SINGLE_FILE), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            if name.endswith("_scales"):
                continue
            if name.endswith("_blocks"):
                stem = name.removesuffix("_blocks")
                blocks, scales = f.get_tensor(name), f.get_tensor(stem + "_scales")
                state[stem] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            else:
                state[name] = f.get_tensor(name)
    config = transformers.AutoConfig.from_pretrained(path)
    del config.quantization_config
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    result = hf.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    prompts = workload(2)
    return path, prompts, hf_greedy(hf, prompts)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 4])
def test_mxfp4_checkpoint_greedy_equals_transformers(
    mxfp4_gpt_oss: Reference, page_size: int
) -> None:
    path, prompts, expected = mxfp4_gpt_oss
    assert engine_greedy(path, prompts, page_size) == expected
