"""Seeded random lifecycles: adds, aborts at random points, tiny pools, both cache modes.
No leak, no crash, every request that was not aborted finishes, within a bounded number of
steps (the liveness property over random configs is in test_engine_liveness.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from swaserve.worker import Engine, EngineConfig, SamplingParams


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "mode",
    [
        {"enable_prefix_cache": True, "page_size": 1},
        {"enable_prefix_cache": False, "page_size": 4},
        {"enable_prefix_cache": True, "page_size": 4, "schedule_policy": "lpm"},
        {"disable_hybrid_swa_memory": True, "page_size": 2},
    ],
)
@pytest.mark.parametrize("arch", ["mimo-v2-flash", "gemma3"])
def test_random_lifecycle(
    tiny_model_factory: Callable[..., Path], seed: int, mode: dict, arch: str
) -> None:
    path = tiny_model_factory(arch, num_layers=3, sliding_window_size=4, hidden_size=32, seed=2)
    engine = Engine(
        EngineConfig(
            model=str(path),
            max_total_tokens=256,
            swa_full_tokens_ratio=0.5,
            chunked_prefill_size=16,
            swa_eviction_interval=4,
            max_running_requests=6,
            **mode,
        )
    )
    rng = random.Random(seed)
    shared = [rng.randrange(1, 250) for _ in range(20)]
    live: set[str] = set()
    finished: set[str] = set()
    aborted: set[str] = set()
    for step in range(400):
        if rng.random() < 0.3 and step < 300:
            n = rng.randint(1, 60)
            prompt = (shared + [rng.randrange(1, 250) for _ in range(n)])[: n + rng.choice([0, 20])]
            params = SamplingParams(
                temperature=rng.choice([0.0, 1.0]),
                max_new_tokens=rng.randint(1, 30),
                seed=rng.randrange(100),
            )
            live.add(engine.add_request(prompt, params))
        if live and rng.random() < 0.08:
            victim = rng.choice(sorted(live))
            assert engine.abort(victim)
            live.discard(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                finished.add(out.request_id)
        engine.check()
    drain_steps = 0
    while engine.has_unfinished_requests():
        assert drain_steps < 1000, f"stalled: {engine.headroom()}"  # steps, not time
        drain_steps += 1
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                finished.add(out.request_id)
        engine.check()
    assert not live
    assert not finished & aborted
    engine.flush_cache()
    head = engine.headroom()
    assert head.full_free_tokens == head.full_total_tokens
    assert head.swa_free_tokens == head.swa_total_tokens
