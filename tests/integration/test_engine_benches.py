"""The engine benchmarks run end to end (tiny sizes) and end with one JSON line. No timing asserts."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(name: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
def test_throughput_bench(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--requests",
        "4",
        "--max-prompt",
        "40",
        "--max-output",
        "17",
        "--hidden",
        "32",
        "--layers",
        "2",
    ]
    data = run_bench(
        "throughput", [*argv, "--window", "8", "--hf-batch", "2", "--kv-mib", "4"], capsys
    )
    assert data["requests"] == 4
    assert data["output_tokens"] > 0
    assert {
        "output_ratio",
        "total_ratio",
        "swaserve_output_tok_s",
        "transformers_output_tok_s",
    } <= set(data)


@pytest.mark.slow
def test_capacity_bench(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--kv-mib",
        "1",
        "--prompt-len",
        "64",
        "--new-tokens",
        "24",
        "--window",
        "8",
        "--interval",
        "8",
    ]
    data = run_bench("capacity", [*argv, "--chunk", "64"], capsys)
    assert data["hybrid_peak_running"] > data["single_pool_peak_running"] > 0
    assert 0 < data["hybrid_of_bound"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("churn", [False, True], ids=["pure-decode", "churn"])
def test_step_overhead_bench(capsys: pytest.CaptureFixture[str], churn: bool) -> None:
    argv = ["--steps", "12", "--repeats", "1", "--batches", "1,6", *(["--churn"] if churn else [])]
    data = run_bench("step_overhead", argv, capsys)
    host_phases = ("schedule", "input", "sample", "postprocess")
    for batch in ("1", "6"):
        ms = data["ms_per_step"][batch]
        assert min(ms[p] for p in (*host_phases, "model")) > 0
        assert ms["host"] == pytest.approx(sum(ms[p] for p in host_phases))
        assert data["host_over_model"][batch] == pytest.approx(ms["host"] / ms["model"])
    if churn:  # 6 requests of 6-18 tokens over 12 measured steps: some finish and are replaced
        assert data["ms_per_step"]["6"]["finished"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 4])
def test_reuse_bench_meets_its_goals(page_size: int, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--window", "8", "--hidden", "32", "--system-tokens", "60", "--user-tokens", "8"]
    argv += ["--turns", "4", "--users", "4", "--new-tokens", "20", "--page-size", str(page_size)]
    data = run_bench("reuse", argv, capsys)
    r = data["repair_tokens"]
    assert r == 16 and data["swa_layers"] == 2
    workloads = data["workloads"]
    for entry in workloads.values():  # greedy answers equal the cold run's, in every mode
        assert all(entry[mode]["tokens_equal_cold"] for mode in ("one-pool", "hybrid", "cold"))
    for name in ("chat", "same-prompt"):
        assert workloads[name]["hybrid_vs_one_pool_cached_share"] >= 0.98
    shared = workloads["shared-system"]
    hits = sum(1 for c in shared["hybrid"]["cached_per_request"] if c > 0)
    assert hits == 3
    assert shared["hybrid"]["prefill_tokens"] <= shared["one-pool"]["prefill_tokens"] + r * hits
    # The second user diverges 8 tokens before the first prompt's end: the checkpoint's slack
    # (window_checkpoint_slack_tokens) serves it without a repair; the branch checkpoint the rest.
    system = 160 // page_size * page_size
    assert shared["hybrid"]["cached_per_request"] == [0, system, system, system]
    assert shared["hybrid"]["prefill_tokens"] == shared["one-pool"]["prefill_tokens"]
    assert workloads["long-prefix"]["cold_vs_hybrid_prefill_of_hits"] >= 5
