from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from swaserve.worker.sampling import Sampler, SamplingParams, filtered_probs, make_generator

CPU = torch.device("cpu")


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    out = Sampler(CPU).sample(logits, [SamplingParams(temperature=0)] * 2, [None, None])
    assert out.tolist() == [1, 0]


def test_top_k_one_is_greedy_even_with_temperature() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    assert Sampler(CPU).sample(logits, [SamplingParams(top_k=1)], [None]).tolist() == [1]


def test_filters() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, [SamplingParams(top_k=2)])
    assert probs[0].tolist() == pytest.approx([0.625, 0.375, 0, 0])
    probs = filtered_probs(logits, [SamplingParams(top_p=0.8)])  # 0.5 + 0.3 reaches 0.8
    assert probs[0].tolist() == pytest.approx([0.625, 0.375, 0, 0])
    probs = filtered_probs(logits, [SamplingParams(top_p=0.81)])
    assert probs[0].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    probs = filtered_probs(logits, [SamplingParams(min_p=0.5)])  # keep p >= 0.25
    assert probs[0].tolist() == pytest.approx([0.625, 0.375, 0, 0])
    probs = filtered_probs(logits, [SamplingParams(temperature=2.0)])
    expected = torch.softmax(logits[0] / 2, -1)
    assert probs[0].tolist() == pytest.approx(expected.tolist())


def test_seed_is_reproducible_whatever_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, seed=1234)
    sampler = Sampler(CPU, seed=7)
    alone = [sampler.sample(logits[1:2], [params], [make_generator(params, CPU)]).item()]
    gen = make_generator(params, CPU)
    other = SamplingParams(temperature=1.0)
    batched = sampler.sample(logits, [other, params, other], [None, gen, None])
    assert batched[1].item() == alone[0]


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    out = Sampler(CPU, seed=3).sample(logits, params, [None] * 4000)
    freq = torch.bincount(out, minlength=3).float() / 4000
    assert freq.tolist() == pytest.approx([0.7, 0.2, 0.1], abs=0.03)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_new_tokens": 0},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 1.5},
        {"seed": -1},
        {"stop_token_ids": (-3,)},
        {"unknown": 1},
    ],
)
def test_bad_params_are_refused(bad: dict) -> None:
    with pytest.raises(ValidationError):
        SamplingParams(**bad)
