"""bench/cluster_sim.py: its step cost fit, and a simulated cluster whose workers are the
engine's own host side (scheduler, KV manager, prefix cache), checked against hand-computed
times on a workload small enough to follow step by step."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from cluster_sim import simulate
from sim_calibration import Calibration, Hop, StepCost

from swaserve.worker.engine.stats import StepRecord

SYSTEM = list(range(1, 41))  # 40 tokens
USERS = [[[50 + t for t in range(20)], [90 + t for t in range(12)]]]  # one session, 2 turns
ANSWERS = {(0, 0): [7, 8, 9, 10], (0, 1): [11, 12, 13, 14]}
COST = StepCost(
    fixed_s=0.010,
    decode_row_s=0.002,
    prefill_request_s=0.0,
    prefill_token_s=0.001,
    context_s=0.0,
    loop_s=0.0,
)


def test_the_fit_recovers_a_step_cost_and_the_loop_gap() -> None:
    rng = random.Random(0)
    truth = (0.004, 0.0005, 0.001, 0.0001, 0.00002)
    log, t = [], 0.0
    for _ in range(200):
        rows, prefills = rng.randint(1, 8), rng.randint(0, 3)
        tokens = prefills * rng.randint(1, 300)
        context = prefills * rng.randint(0, 2000)
        ctx = tokens * context / (1000 * max(prefills, 1))
        seconds = truth[0] + truth[1] * rows + truth[2] * prefills + truth[3] * tokens
        seconds += truth[4] * ctx
        log.append(StepRecord(rows, prefills, tokens, context, seconds, t))
        t += seconds + 0.0003  # the loop's own time between steps
    fitted = StepCost.fit([log])
    terms = (fitted.fixed_s, fitted.decode_row_s, fitted.prefill_request_s)
    terms += (fitted.prefill_token_s, fitted.context_s)
    assert terms == pytest.approx(truth, rel=1e-6)
    assert fitted.loop_s == pytest.approx(0.0003, rel=1e-6)
    assert fitted.error([log]) < 1e-6
    assert len(fitted.noise) + len(fitted.prefill_noise) == len(log)  # decode-only, prefill
    assert all(r == pytest.approx(1.0) for r in fitted.noise + fitted.prefill_noise)
    with pytest.raises(ValueError, match="too few"):
        StepCost.fit([log[:3]])


@pytest.mark.parametrize("policy", ["round_robin", "prefix"])
def test_a_turn_waits_its_uncached_prefill_in_the_real_scheduler(
    tiny_model_factory: Callable[..., Path], policy: str
) -> None:
    """One client, no hops: turn 1 takes one prefill step of its 60 tokens (its first token),
    then 3 decode steps. Turn 2 (60 + 4 + 12 = 76 tokens) on the same worker computes what
    the engine's own prefix cache lacks (at most its 16 new tokens: turn 1's prompt is
    cached), on the other worker all 76."""
    model = tiny_model_factory(arch="gpt-oss", num_layers=2, sliding_window_size=4)
    calibration = Calibration(COST, (Hop(0.0, 0.0, 0.0),))
    run = simulate(
        policy=policy,
        router_config={},
        model_dir=str(model),
        max_total_tokens=4096,
        system=SYSTEM,
        users=USERS,
        answers=ANSWERS,
        concurrency=1,
        calibration=calibration,
    )
    assert run["requests"] == 2
    first_ttft = COST.fixed_s + 60 * COST.prefill_token_s
    decode_s = COST.fixed_s + COST.decode_row_s  # one row
    span_first = first_ttft + 3 * decode_s
    if policy == "prefix":  # the same worker: turn 2 computes what its cache lacks
        uncached = 76 - run["cached_tokens"]
        assert 0 < uncached <= 76 - 60
        workers = sorted(run["requests_per_worker"].values())
        assert workers == [0, 2]
    else:  # round robin: the other worker, nothing cached
        uncached = 76
        assert run["cached_tokens"] == 0
        assert sorted(run["requests_per_worker"].values()) == [1, 1]
    second_ttft = COST.fixed_s + uncached * COST.prefill_token_s
    assert run["ttft_ms"] == [pytest.approx(1e3 * first_ttft), pytest.approx(1e3 * second_ttft)]
    assert run["wall_s"] == pytest.approx(span_first + second_ttft + 3 * decode_s)
