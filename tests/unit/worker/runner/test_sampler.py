from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from swaserve.worker.runner.sampler import (
    Sampler,
    SamplingParams,
    filtered_probs,
    make_generator,
    sorted_probs,
    top_k_probs,
)

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


def frequencies(
    logits: torch.Tensor, params: SamplingParams, draws: int, seed: int
) -> torch.Tensor:  # [V] float32
    """How often each token is drawn by `draws` rows of the same logits in one batch."""
    batch = logits.repeat(draws, 1)  # [draws, V]
    out = Sampler(CPU, seed=seed).sample(batch, [params] * draws, [None] * draws)
    return torch.bincount(out, minlength=logits.shape[1]).float() / draws


def within_bound(freq: torch.Tensor, target: torch.Tensor, draws: int) -> bool:
    """Each frequency within 5 standard errors of its target, and exactly 0 where it is 0."""
    bound = 5 * torch.sqrt(target * (1 - target) / draws)  # [V] float32
    return bool(((freq - target).abs() <= bound).all())


PROBS = torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]])  # [1, 6] float32
FILTERS = {
    # kept tokens → target probabilities (renormalized over the kept ones)
    "top_k": (SamplingParams(top_k=3), [0.4, 0.25, 0.15, 0, 0, 0]),
    "top_p": (SamplingParams(top_p=0.75), [0.4, 0.25, 0.15, 0, 0, 0]),  # 0.65 < 0.75 ≤ 0.8
    "min_p": (SamplingParams(min_p=0.2), [0.4, 0.25, 0.15, 0.1, 0, 0]),  # keep p ≥ 0.08
    "top_k_and_min_p": (SamplingParams(top_k=2, min_p=0.7), [0.4, 0, 0, 0, 0, 0]),
    "temperature": (SamplingParams(temperature=1.0), [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]),
}


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_draws_follow_the_filtered_distribution(name: str) -> None:
    params, kept = FILTERS[name]
    target = torch.tensor(kept) / sum(kept)  # [V] float32
    draws = 20000
    freq = frequencies(torch.log(PROBS), params, draws, seed=11)
    assert freq[target == 0].tolist() == [0.0] * int((target == 0).sum())  # never a filtered one
    assert within_bound(freq, target, draws), (name, freq.tolist())


def test_temperature_only_rows_draw_from_the_softmax_of_logits_over_t() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])  # [1, 4]
    params = SamplingParams(temperature=0.5)
    target = torch.softmax(logits[0] / 0.5, dim=-1)  # [4]: 0.865, 0.117, 0.016, 0.002
    assert filtered_probs(logits, [params])[0].tolist() == pytest.approx(target.tolist())
    draws = 20000
    assert within_bound(frequencies(logits, params, draws, seed=5), target, draws)


def test_temperature_and_top_k_rows_sort_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sort(*args, **kwargs):
        raise AssertionError("full-vocabulary sort")

    monkeypatch.setattr(torch, "sort", no_sort)
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))  # [3, 100]
    params = [SamplingParams(), SamplingParams(top_k=5), SamplingParams(min_p=0.1)]
    out = Sampler(CPU).sample(logits, params, [None] * 3)
    assert out.shape == (3,)
    assert int(out[1]) in torch.topk(logits[1], 5).indices.tolist()


def test_top_k_path_equals_the_sorted_path() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))  # [4, 50]
    params = [
        SamplingParams(top_k=1),
        SamplingParams(top_k=7),
        SamplingParams(top_k=20, min_p=0.3),
        SamplingParams(top_k=49),
    ]
    fast, sorted_ = top_k_probs(logits, params), sorted_probs(logits, params)  # [4, 50] each
    assert (fast - sorted_).abs().max().item() < 1e-6
    assert (fast > 0).sum(dim=1).tolist() == [1, 7, 7, 49]  # min-p keeps 7 of the third's 20


def test_mixed_batch_gives_each_row_its_own_filter() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))  # [5, 40]
    params = [
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=4),
        SamplingParams(min_p=0.2, temperature=1.5),
        SamplingParams(top_k=10, top_p=0.9),
    ]
    together = filtered_probs(logits, params)  # [5, 40]
    for i, p in enumerate(params):
        alone = filtered_probs(logits[i : i + 1], [p])[0]  # [40]
        assert (together[i] - alone).abs().max().item() < 1e-7, p


def test_greedy_rows_in_a_sampled_batch_are_argmax() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(3))  # [6, 30]
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(top_p=0.9)
    params = [greedy, sampled, SamplingParams(top_k=1, temperature=2.0), sampled, greedy, sampled]
    out = Sampler(CPU).sample(logits, params, [None] * 6)
    argmax = torch.argmax(logits, dim=-1)  # [6] int64
    assert out[[0, 2, 4]].tolist() == argmax[[0, 2, 4]].tolist()


def test_seeded_row_draws_the_same_tokens_alone_and_in_any_batch() -> None:
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))  # [5, 64]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=99)
    alone_gen = make_generator(seeded, CPU)
    alone = [
        Sampler(CPU, seed=1).sample(logits[2:3], [seeded], [alone_gen]).item() for _ in range(8)
    ]
    other_seed = SamplingParams(temperature=1.0, seed=5)
    mates = [SamplingParams(), SamplingParams(temperature=0), seeded, other_seed, SamplingParams()]
    sampler, gen = Sampler(CPU, seed=2), make_generator(seeded, CPU)
    in_batch = []
    for _ in range(8):
        gens = [None, None, gen, make_generator(other_seed, CPU), None]
        in_batch.append(sampler.sample(logits, mates, gens)[2].item())
    assert in_batch == alone
    assert len(set(alone)) > 1  # the row really samples


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
