"""bench/cluster_load.py end to end at tiny sizes, in a subprocess (its own local Ray, shut
down by the bench): every policy named serves every turn of every session, the usage the
server reports adds up to the workload, and prefix routing reuses more prompt tokens than round
robin on a multi-turn workload over 3 workers (`--replicas`); `--simulate` fits the simulator to the runs and
replays them. No timing asserts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from bench_subprocess import ROOT, run_bench_script

SESSIONS, TURNS, MAX_NEW_TOKENS = 4, 3, 8
REPLICAS = 3


@pytest.mark.slow
def test_cluster_load_bench() -> None:
    argv = [
        f"--sessions={SESSIONS}",
        f"--turns={TURNS}",
        "--concurrency=3",
        f"--max-new-tokens={MAX_NEW_TOKENS}",
        "--system-tokens=64",
        "--user-tokens=48",
        "--hidden=64",
        "--layers=2",
        "--window=8",
        "--max-total-tokens=4096",
        "--repeats=1",
        f"--replicas={REPLICAS}",
        "--policies=round_robin,prefix,ttft",
        "--simulate",
        "--sim-repeats=1",
    ]
    data = run_bench_script("cluster_load", argv)

    requests = SESSIONS * TURNS
    assert data["workload_requests"] == requests
    # Answer lengths drawn per turn, 1/2 to 3/2 of --max-new-tokens.
    low, high = MAX_NEW_TOKENS // 2, MAX_NEW_TOKENS + MAX_NEW_TOKENS // 2
    assert requests * low <= data["workload_answer_tokens"] <= requests * high
    runs = {run["policy"]: run for run in data["runs"]}
    assert sorted(runs) == ["prefix", "round_robin", "ttft"]
    assert len(data["runs"]) == 3
    assert data["policies"] == ["round_robin", "prefix", "ttft"]
    assert sorted(data["ratios"]) == ["prefix", "ttft"]  # each against the first, the baseline
    for policy, ratio in data["ratios"].items():  # one round: its ratio is the medians'
        assert data["round_ratios"][policy]["ttft_p50"] == [ratio["ttft_p50"]] * 2
    for run in runs.values():
        assert run["requests"] == requests
        assert run["finished"] == requests  # every turn ended with "length" (ignore_eos)
        assert run["generated_tokens"] == data["workload_answer_tokens"]  # ignore_eos
        assert run["prompt_tokens"] == data["workload_prompt_tokens"]
        assert 0.0 <= run["cached_share"] <= 1.0
        assert sum(run["requests_per_worker"].values()) == requests
        # Every request's first token came back from its Ray worker with its timings.
        parts = run["ttft_parts"]
        assert sum(parts["held_by"].values()) == requests
        assert parts["prefill_steps"] >= 1.0 and parts["prefill_ms"]["p50"] > 0
        # Every request in one size class by the prompt tokens it computed; the CPU it took
        # per request read from the engines', the router's and this process's counters.
        sizes = run["ttft_by_size"]
        assert list(sizes) == ["a message", "+1 turn", "more"]
        assert sum(c["requests"] for c in sizes.values()) == requests
        assert set(run["cpu_ms_per_request"]) == {"engines", "router", "ingress and clients"}
        assert run["cpu_ms_per_request"]["engines"] > 0
    alike = data["like_for_like"]
    assert sorted(alike) == sorted(runs)
    for policy, run in runs.items():  # one round: the medians are the run's own figures
        sizes = {k: c["p50_ms"] for k, c in run["ttft_by_size"].items()}
        assert alike[policy]["ttft_p50_ms_by_size"] == sizes
        assert alike[policy]["cpu_ms_per_request"] == run["cpu_ms_per_request"]
    # Greedy decoding: where the prefix cache hits must not change a single token.
    assert runs["prefix"]["answers_equal_first_run"] == 1.0
    assert runs["ttft"]["answers_equal_first_run"] == 1.0
    # Round robin moves a session's turns between the workers; prefix keeps them together.
    # User turns longer than the system prompt make the history, not the shared prompt (which
    # window checkpoints and repair keep on both workers), what a misrouted turn loses.
    assert runs["prefix"]["cached_share"] > runs["round_robin"]["cached_share"]
    assert data["replicas"] == REPLICAS
    assert runs["round_robin"]["requests_per_worker"] == {
        f"worker-{i}": requests // REPLICAS for i in range(REPLICAS)
    }
    # The simulator, fitted to these runs' engine steps and hops, replayed every policy on
    # the same workload with the real answers, its engines reusing as the real ones do.
    # The fit is non-negative least squares over a few dozen steps: which term carries a
    # prefill's cost (per token, per request, fixed) is up to the noise; that a simulated
    # decode step and a simulated turn's prefill take time is not.
    cost = data["calibration"]["cost"]
    assert cost["fixed_s"] + cost["decode_row_s"] > 0
    assert cost["fixed_s"] + cost["prefill_request_s"] + 48 * cost["prefill_token_s"] > 0
    assert len(data["calibration"]["hops"]) == 3 * requests
    for policy in runs:
        assert data["predicted"][policy]["requests"] == requests
        assert set(data["prediction_error"][policy]) == {"ttft_p50_ms", "ttft_p99_ms", "tok_s"}
    predicted = {p: data["predicted"][p]["cached_share"] for p in runs}
    assert predicted["prefix"] > predicted["round_robin"]


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        ("prefix,bogus", "unknown policy 'bogus'"),
        ("prefix", "name at least two different policies"),
        ("prefix,prefix", "name at least two different policies"),
    ],
)
def test_cluster_load_refuses_bad_policies(policies: str, message: str) -> None:
    """A bad --policies is refused before any cluster starts (argparse's exit status 2)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cluster_load.py"), f"--policies={policies}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert message in done.stderr
