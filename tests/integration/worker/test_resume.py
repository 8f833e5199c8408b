"""A request resumed elsewhere — a fresh engine given the prompt plus the tokens generated so
far — continues with exactly the tokens of the undisturbed run, greedy and seeded (what request
migration after a lost worker relies on)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.runner.sampler import seed_for_position


def test_seed_for_position_is_spread_and_in_range() -> None:
    seeds = {seed_for_position(s, p) for s in (0, 1, 2**63 - 1) for p in range(200)}
    assert len(seeds) == 600
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=24, temperature=1.3, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_new_tokens=24, temperature=0.8, top_k=20, seed=2**62, ignore_eos=True),
    ],
    ids=["greedy", "seeded-top-p", "seeded-top-k"],
)
def test_resumed_request_continues_exactly(
    tiny_model_factory: Callable[..., Path], params: SamplingParams
) -> None:
    path = tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=8, hidden_size=32)
    config = EngineConfig(model=str(path), max_total_tokens=512, chunked_prefill_size=16)
    prompt = [(7 * i + 3) % 100 for i in range(21)]
    first = Engine(config)
    noise = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True)
    # Batched with an unseeded neighbour, so the shared generator moves between draws.
    whole = first.generate([prompt, prompt[:9]], [params, noise])[0].token_ids
    assert len(whole) == 24
    for cut in (1, 5, 13):
        resumed = Engine(config)  # another worker: a cold cache, another generator state
        rest = params.model_copy(update={"max_new_tokens": 24 - cut})
        tail = resumed.generate([prompt + whole[:cut]], [rest])[0].token_ids
        assert tail == whole[cut:], f"cut at {cut}"
        resumed.check()
        resumed.shutdown()
    first.check()
    first.shutdown()
