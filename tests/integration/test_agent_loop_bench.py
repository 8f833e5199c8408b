"""bench/agent_loop.py end to end at tiny sizes, in a subprocess (its own local Ray, shut down
by the bench), on both chat formats: every agent's requests come back parsed (a call, then an
answer, each turn), and from turn 2 on the hybrid engine reuses as much of the prompts as the
one-pool engine and more than round-robin routing. No timing asserts."""

from __future__ import annotations

import pytest
from bench_subprocess import run_bench_script

AGENTS, TURNS = 4, 3


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt-oss", "mimo-v2-flash"])
def test_agent_loop_bench(arch: str) -> None:
    data = run_bench_script(
        "agent_loop",
        [
            f"--arch={arch}",
            "--replicas=2",
            f"--agents={AGENTS}",
            f"--turns={TURNS}",
            "--reasoning-chars=12",
            "--answer-chars=12",
            "--user-chars=48",
            "--result-chars=48",
            "--instruction-chars=96",
            "--hidden=32",
            "--layers=4",
            "--window=8",
            "--max-total-tokens=8192",
        ],
    )
    assert [r["variant"] for r in data["runs"]] == ["hybrid", "one-pool", "round-robin"]
    for run in data["runs"]:
        assert len(run["turns"]) == TURNS
        for turn in run["turns"]:
            assert turn["calls"] == AGENTS and turn["answers"] == AGENTS
            assert 0 <= turn["cached"] <= turn["prompt"]
    later = data["from_turn_2"]
    # The template drops each finished turn's reasoning: the hybrid engine resumes inside the
    # last sequences (checkpoints, repair) and loses nothing to the one-pool engine.
    assert later["hybrid"] >= 0.98 * later["one-pool"]
    assert later["hybrid"] > later["round-robin"]
