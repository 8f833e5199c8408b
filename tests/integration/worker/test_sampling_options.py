"""Penalties, logit bias, min_tokens and logprobs against a reference computed with transformers'
logits and the same formulas (OpenAI's presence / frequency penalty over the output, vLLM's
repetition penalty over prompt + output), greedy, token by token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams

PROMPTS = [[5, 9, 5, 9, 5, 200, 31], [1, 2, 3], [77] * 20]
MAX_NEW = 12


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> tuple[Path, Any]:
    transformers = pytest.importorskip("transformers")
    path = tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=4, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, hf


@pytest.fixture(scope="module")
def engine(model: tuple[Path, Any]) -> Any:
    e = Engine(EngineConfig(model=str(model[0]), max_total_tokens=2048))
    yield e
    e.shutdown()


def reference(
    hf: Any, prompt: list[int], params: SamplingParams, eos: set[int]
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the log-softmax each was taken from, by the documented formulas."""
    out: list[int] = []
    logps = []
    for _ in range(params.max_new_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        if len(out) < params.min_tokens:
            logits[sorted(eos)] = float("-inf")
        for token, bias in (params.logit_bias or {}).items():
            logits[token] += bias
        seen = set(prompt + out)
        for token in seen:
            p = params.repetition_penalty
            logits[token] = logits[token] / p if logits[token] > 0 else logits[token] * p
        for token in set(out):
            count = out.count(token)
            logits[token] -= count * params.frequency_penalty + params.presence_penalty
        logps.append(torch.log_softmax(logits, dim=-1))
        token = int(torch.argmax(logits))
        out.append(token)
        if token in eos and len(out) >= params.min_tokens:
            break
    return out, logps


CASES = [
    SamplingParams(max_new_tokens=MAX_NEW, temperature=0, presence_penalty=1.5),
    SamplingParams(max_new_tokens=MAX_NEW, temperature=0, frequency_penalty=0.8),
    SamplingParams(max_new_tokens=MAX_NEW, temperature=0, frequency_penalty=-1.0),
    SamplingParams(max_new_tokens=MAX_NEW, temperature=0, repetition_penalty=1.8),
    SamplingParams(max_new_tokens=MAX_NEW, temperature=0, logit_bias={40: 30.0, 41: -100.0}),
    SamplingParams(
        max_new_tokens=MAX_NEW,
        temperature=0,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={12: 3.0},
        logprobs=5,
    ),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_with_penalties_and_bias_equals_the_reference(
    model: tuple[Path, Any], engine: Engine, case: int
) -> None:
    params = CASES[case].model_copy(update={"logprobs": 5})
    eos = set(engine.scheduler.eos_token_ids)
    outs = engine.generate(PROMPTS, params)
    plain = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, temperature=0))
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]  # the option acts
    for prompt, out in zip(PROMPTS, outs, strict=True):
        expected, logps = reference(model[1], prompt, params, eos)
        assert out.token_ids == expected
        assert out.logprobs is not None and len(out.logprobs) == len(expected)
        for entry, token, logp in zip(out.logprobs, expected, logps, strict=True):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(logp[token]), abs=1e-4)
            assert entry.top[0][0] == token  # the greedy token is the most likely one
            ids = [t for t, _ in entry.top]
            assert len(ids) == 5
            torch.testing.assert_close(
                torch.tensor([v for _, v in entry.top]), logp[ids], atol=1e-4, rtol=0
            )
    engine.check()


def test_min_tokens_masks_eos_until_reached(model: tuple[Path, Any], engine: Engine) -> None:
    eos = min(engine.scheduler.eos_token_ids)
    # A bias makes EOS the greedy choice at every step: only min_tokens keeps it away.
    params = SamplingParams(max_new_tokens=20, temperature=0, logit_bias={eos: 100.0}, min_tokens=6)
    (out,) = engine.generate([PROMPTS[0]], params)
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos
    assert eos not in out.token_ids[:-1]
    assert out.finish_reason == "stop"
    expected, _ = reference(model[1], PROMPTS[0], params, set(engine.scheduler.eos_token_ids))
    assert out.token_ids == expected


def test_logprobs_at_temperature_are_of_the_tempered_distribution(
    model: tuple[Path, Any], engine: Engine
) -> None:
    params = SamplingParams(max_new_tokens=4, temperature=0.7, seed=3, logprobs=2)
    (out,) = engine.generate([PROMPTS[1]], params)
    assert out.logprobs is not None
    prefix = list(PROMPTS[1])
    for entry in out.logprobs:
        with torch.no_grad():
            logits = model[1](torch.tensor([prefix])).logits[0, -1].float()
        logp = torch.log_softmax(logits / 0.7, dim=-1)
        assert entry.logprob == pytest.approx(float(logp[entry.token_id]), abs=1e-4)
        assert [t for t, _ in entry.top] == torch.topk(logp, 2).indices.tolist()
        prefix.append(entry.token_id)


def test_the_same_tokens_with_or_without_logprobs(engine: Engine) -> None:
    """Asking for logprobs changes nothing of what is drawn (seeded sampling, mixed batch)."""
    base = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s) for s in range(4)]
    asked = [p.model_copy(update={"logprobs": 3 if i % 2 else 0}) for i, p in enumerate(base)]
    a = engine.generate([PROMPTS[1]] * 4, base)
    b = engine.generate([PROMPTS[1]] * 4, asked)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(o.logprobs is None for o in a)
    assert [len(o.logprobs[0].top) for o in b if o.logprobs] == [0, 3, 0, 3]
