"""The tiny-model maker: config.json that transformers accepts, seeded weights, a byte-level
tokenizer with a chat template, and the `swaserve make-tiny-model` subcommand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from swaserve.cluster.cli import main
from swaserve.proto.text.chat_template import ChatTemplate
from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.loader import SINGLE_FILE
from swaserve.worker.models.tiny import (
    BOS_ID,
    EOS_ID,
    HARMONY_TOKENS,
    SPECIAL_TOKENS,
    make_tiny_model,
)


@pytest.mark.parametrize(
    ("arch", "hf_class"),
    [
        ("gpt-oss", "GptOssForCausalLM"),
        ("mimo-v2-flash", "MiMoV2FlashForCausalLM"),
        ("gemma3", "Gemma3ForCausalLM"),
        ("cohere2", "Cohere2ForCausalLM"),
        ("olmo3", "Olmo3ForCausalLM"),
        ("exaone4", "Exaone4ForCausalLM"),
    ],
)
def test_transformers_reads_the_config(arch: str, hf_class: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    make_tiny_model(
        tmp_path, arch=arch, num_layers=3, sliding_window_size=5, num_heads=4, num_kv_heads=1
    )
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf.architectures == [hf_class]
    assert (hf.num_hidden_layers, hf.sliding_window, hf.num_key_value_heads) == (3, 6, 1)
    assert hf.vocab_size == 288
    ours = load_model_config(tmp_path)
    assert list(ours.layer_types) == list(hf.layer_types)
    assert ours.sliding_window_size == 5


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", arch="mimo-v2-flash", num_layers=2, seed=11)
    b = make_tiny_model(tmp_path / "b", arch="mimo-v2-flash", num_layers=2, seed=11)
    c = make_tiny_model(tmp_path / "c", arch="mimo-v2-flash", num_layers=2, seed=12)
    assert (a / SINGLE_FILE).read_bytes() == (b / SINGLE_FILE).read_bytes()
    assert (a / SINGLE_FILE).read_bytes() != (c / SINGLE_FILE).read_bytes()
    weights = load_file(a / SINGLE_FILE)
    sinks = weights["model.layers.1.self_attn.sinks"]  # layer 1 is SWA: it has sinks
    assert "model.layers.0.self_attn.sinks" not in weights  # layer 0 is full: none
    assert sinks.shape == (4,) and sinks.abs().min() > 0
    assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0


def test_byte_tokenizer_round_trips_and_has_specials(tmp_path: Path) -> None:
    make_tiny_model(tmp_path, arch="gpt-oss", num_layers=2)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "héllo, wörld 🙂\n\tend"
    ids = tokenizer.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [256, 257, 258, 259, 260, 261]
    assert tokenizer.encode("<|user|>hi<|eos|>").ids == [260, ord("h"), ord("i"), EOS_ID]
    assert tokenizer.get_vocab_size() == 262
    # With harmony=True, GPT-OSS's also has harmony's special tokens, after the others.
    make_tiny_model(tmp_path / "harmony", arch="gpt-oss", num_layers=2, harmony=True)
    harmony = Tokenizer.from_file(str(tmp_path / "harmony" / "tokenizer.json"))
    assert [harmony.token_to_id(t) for t in HARMONY_TOKENS] == list(range(262, 269))
    assert harmony.get_vocab_size() == 269


def test_chat_template_renders_through_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    make_tiny_model(tmp_path, arch="mimo-v2-flash", num_layers=2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|user|>hi<|eos|><|assistant|>"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == [
        BOS_ID,
        260,
        104,
        105,
        EOS_ID,
        261,
    ]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)


@pytest.mark.parametrize(
    ("arch", "begins", "prompt_end", "end_token"),
    [
        (
            "gemma3",
            "<|bos|><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n",
            "<start_of_turn>model\n",
            "<end_of_turn>",
        ),
        (
            "llama4",
            "<|bos|><|header_start|>system<|header_end|>\n\nBe brief.<|eot|>",
            "<|header_start|>assistant<|header_end|>\n\n",
            "<|eot|>",
        ),
    ],
)
def test_a_native_chat_renders_as_transformers_and_ends_at_its_turn_end(
    tmp_path: Path, arch: str, begins: str, prompt_end: str, end_token: str
) -> None:
    transformers = pytest.importorskip("transformers")
    make_tiny_model(tmp_path, arch=arch, num_layers=2, native_chat=True)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    ours = ChatTemplate.from_model_dir(tmp_path).render(messages, add_generation_prompt=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.startswith(begins) and ours.endswith(prompt_end)
    assert tokenizer.convert_tokens_to_ids(end_token) in load_model_config(tmp_path).eos_token_ids


def test_native_chat_is_refused_for_a_family_without_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no native chat format for cohere2"):
        make_tiny_model(tmp_path, arch="cohere2", num_layers=2, native_chat=True)


def test_make_tiny_model_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["make-tiny-model", str(tmp_path / "m"), "--arch", "mimo-v2-flash", "--layers", "3"]
    argv += ["--window", "2", "--heads", "8", "--kv-heads", "2", "--hidden", "64", "--seed", "4"]
    assert main(argv) == 0
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert hf["architectures"] == ["MiMoV2FlashForCausalLM"]
    assert (hf["num_hidden_layers"], hf["sliding_window"], hf["num_attention_heads"]) == (3, 3, 8)
    assert (hf["num_key_value_heads"], hf["hidden_size"]) == (2, 64)
    assert capsys.readouterr().out == (
        f"wrote mimo-v2-flash to {tmp_path / 'm'}: 3 layers (full [0], SWA [1, 2]), W=2, "
        "hidden 64, vocab 288, hf layout, quantization none\n"
    )


def test_make_tiny_model_subcommand_writes_original_fp8(tmp_path: Path) -> None:
    argv = ["make-tiny-model", str(tmp_path / "m"), "--arch", "mimo-v2-flash", "--layers", "2"]
    assert main([*argv, "--format", "original", "--quantization", "fp8"]) == 0
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert hf["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.layers.0.self_attn", "lm_head", "model.embed_tokens"],
    }
    weights = load_file(tmp_path / "m" / SINGLE_FILE)
    gate = weights["model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert (gate.dtype, tuple(gate.shape)) == (torch.float8_e4m3fn, (32, 32))
    assert tuple(weights["model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv"].shape) == (1, 1)
    assert weights["model.layers.1.self_attn.attention_sink_bias"].dtype == torch.float32
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32  # not converted
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" not in weights
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in weights  # the router stays float


def test_bfloat16_weights_as_the_published_checkpoints(tmp_path: Path) -> None:
    """`--weights-dtype bfloat16` stores the float weights (not the FP8 scales) in bfloat16, the
    values the float32 model rounded to; the engine's loader and transformers read them alike."""
    argv = ["make-tiny-model", str(tmp_path / "m"), "--arch", "mimo-v2-flash", "--layers", "2"]
    assert (
        main(
            [*argv, "--format", "original", "--quantization", "fp8", "--weights-dtype", "bfloat16"]
        )
        == 0
    )
    assert json.loads((tmp_path / "m" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    weights = load_file(tmp_path / "m" / SINGLE_FILE)
    assert weights["model.layers.1.self_attn.attention_sink_bias"].dtype == torch.bfloat16
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    gate = "model.layers.1.mlp.experts.3.gate_proj.weight"
    assert weights[gate].dtype == torch.float8_e4m3fn
    assert weights[gate + "_scale_inv"].dtype == torch.float32
    plain = load_file(make_tiny_model(tmp_path / "f", arch="gpt-oss", num_layers=2) / SINGLE_FILE)
    narrow = make_tiny_model(tmp_path / "b", arch="gpt-oss", num_layers=2, weights_dtype="bfloat16")
    for name, tensor in load_file(narrow / SINGLE_FILE).items():
        assert torch.equal(tensor, plain[name].to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="weights_dtype must be one of"):
        make_tiny_model(tmp_path / "x", weights_dtype="float16")


def test_bad_arguments_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch 'llama'"):
        make_tiny_model(tmp_path, arch="llama")
    with pytest.raises(ValueError, match="mxfp4 is GPT-OSS's checkpoint format"):
        make_tiny_model(tmp_path, arch="mimo-v2-flash", quantization="mxfp4")
    with pytest.raises(ValueError, match="checkpoint_format must be one of"):
        make_tiny_model(tmp_path, checkpoint_format="gguf")
    with pytest.raises(ValueError, match="vocab_size must hold the 262 tokenizer tokens"):
        make_tiny_model(tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size must hold the 269 tokenizer tokens"):
        make_tiny_model(tmp_path, vocab_size=264, harmony=True)
    with pytest.raises(ValueError, match="harmony is GPT-OSS's format"):
        make_tiny_model(tmp_path, arch="mimo-v2-flash", harmony=True)
