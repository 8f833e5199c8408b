"""The n-gram drafter against a brute-force scan, and the verification rules: greedy emits what
plain greedy decoding emits; rejection sampling keeps the target distribution (a statistical
test on a small vocabulary, deterministic and model drafts alike)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.proto.sampling_params import SamplingParams
from swaserve.worker.engine.ngram import CAUGHT_UP, NgramDrafter, NgramIndex
from swaserve.worker.engine.request import Request
from swaserve.worker.runner.spec_verify import greedy_accept, rejection_sample


def propose_brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest suffix of length in
    [min_n, max_n], by scanning the history."""
    n = len(tokens)
    for m in range(min(max_n, n), min_n - 1, -1):
        suffix = tokens[n - m :]
        for end in range(n - 1, m - 1, -1):
            if tokens[end - m : end] == suffix:
                return tokens[end : end + k]
    return []


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(0, 5),
    sizes=st.tuples(st.integers(1, 3), st.integers(0, 3)),
)
def test_the_index_proposes_what_a_scan_finds(tokens: list[int], k: int, sizes: tuple) -> None:
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    index = NgramIndex(min_n=min_n, max_n=max_n)
    for i, token in enumerate(tokens):  # token by token, as outputs arrive
        index.extend([token])
        assert index.propose(k) == propose_brute_force(tokens[: i + 1], k, min_n, max_n)


def test_a_repeated_context_is_proposed() -> None:
    index = NgramIndex(max_n=3)
    index.extend([1, 2, 3, 4, 9, 1, 2, 3])
    assert index.propose(2) == [4, 9]
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(min_n=3, max_n=2)


def test_a_long_context_is_indexed_over_several_steps() -> None:
    """A 20,000-token prompt with a 8,192-token budget per step: the first two steps index
    8,192 tokens each and propose nothing, the third catches up and proposes; a request a
    few tokens behind is brought up to date even when the budget is spent."""
    phrase = [5, 6, 7, 8]
    long = Request("long", [1, 2, 3] * 6666 + phrase + [9] + phrase[:2], SamplingParams(), 0)
    short = Request("short", [1, 2, 3, 4, 1, 2], SamplingParams(), 1)
    drafter = NgramDrafter(min_n=2, max_n=4, index_budget=8192)
    seen = []
    for _ in range(3):
        drafter.new_step()
        seen.append((drafter.propose(long, 3), drafter.propose(short, 3)))
        assert long.draft_index is not None
        seen.append(len(long.draft_index.tokens))
    assert seen == [([], [3, 4, 1]), 8192, ([], [3, 4, 1]), 16384, ([7, 8, 9], [3, 4, 1]), 20005]
    short.output_ids += list(range(100, 100 + CAUGHT_UP))  # within CAUGHT_UP: extended at once
    drafter.new_step()
    drafter._budget = 0
    drafter.propose(short, 3)
    assert short.draft_index is not None and len(short.draft_index.tokens) == short.seq_len


def test_greedy_emits_the_targets_up_to_the_first_disagreement() -> None:
    assert greedy_accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus a bonus
    assert greedy_accept([5, 6, 7], [5, 2, 7, 8]) == [5, 2]  # the target's token where they part
    assert greedy_accept([], [4]) == [4]  # no drafts: a plain decode step
    with pytest.raises(ValueError, match="target tokens"):
        greedy_accept([1], [1])


def empirical(samples: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(samples), minlength=vocab).float() / len(samples)


@pytest.mark.parametrize("with_draft_model", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(with_draft_model: bool) -> None:
    """Vocabulary of 4, two drafts; the first emitted token follows p_0 and, given it was the
    first draft, the second follows p_1: within 4 standard errors over 20,000 seeded runs."""
    p = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.4, 0.1], [0.7, 0.1, 0.1, 0.1]])
    q = torch.tensor([[0.4, 0.4, 0.1, 0.1], [0.1, 0.1, 0.7, 0.1]])
    rng = random.Random(0)
    firsts, seconds = [], []
    for seed in range(20_000):
        gen = torch.Generator().manual_seed(seed)
        if with_draft_model:
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        else:
            drafts = [rng.choice([1, 2]), 2]  # an n-gram drafter's fixed guesses
        out = rejection_sample(drafts, p, q if with_draft_model else None, gen)
        assert 1 <= len(out) <= 3
        firsts.append(out[0])
        if len(out) > 1 and out[0] == drafts[0]:
            seconds.append(out[1])
    n = len(firsts)
    assert torch.allclose(empirical(firsts, 4), p[0], atol=4 * (0.25 / n) ** 0.5)
    assert torch.allclose(empirical(seconds, 4), p[1], atol=4 * (0.25 / len(seconds)) ** 0.5)


def test_a_certain_draft_is_always_accepted() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    out = rejection_sample([1], p, None, torch.Generator().manual_seed(0))
    assert out == [1, 2]


def test_decode_graphs_take_verify_steps_up_to_a_bound() -> None:
    """A row per request without drafts; 1 + k per drafting request with them, no more than
    `speculative_disable_by_batch_size` - 1 of them draft, and at most `MAX_VERIFY_ROWS`."""
    from swaserve.worker.config import EngineConfig
    from swaserve.worker.runner.model_runner import MAX_VERIFY_ROWS, decode_rows

    plain = EngineConfig(model="m")
    spec = EngineConfig(model="m", speculative_method="ngram", num_speculative_tokens=3)
    assert decode_rows(plain, 256) == 256
    assert decode_rows(spec, 16) == 64
    assert decode_rows(spec, 256) == max(256, MAX_VERIFY_ROWS) == 512
    limited = spec.model_copy(update={"speculative_disable_by_batch_size": 9})
    assert decode_rows(limited, 256) == 256  # 8 drafting requests: 32 rows, fewer than 256
    assert decode_rows(limited, 4) == 16
