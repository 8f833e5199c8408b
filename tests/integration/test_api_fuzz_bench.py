"""bench/api_fuzz.py in CI: 2,000 generated requests per interface (HTTP from the server's own
OpenAPI document, gRPC from the message descriptors) against a real local cluster, in a
subprocess with its own local Ray. Every answer is a documented status, a canary stream keeps
its tokens, and the cluster ends whole. No timing asserts."""

from __future__ import annotations

import pytest
from bench_subprocess import run_bench_script

EXAMPLES = 2000


@pytest.mark.slow
def test_the_api_fuzz_meets_only_documented_answers() -> None:
    data = run_bench_script("api_fuzz", [f"--examples={EXAMPLES}", "--seed=0"])
    for interface in ("http", "grpc"):
        result = data[interface]
        assert result["tried"] >= EXAMPLES, result
        assert result["failures"] == 0, result["first_failures"]
        assert sum(result["statuses"].values()) == result["tried"]
    assert data["http"]["statuses"].get("200", 0) > 0  # valid requests were served too
    assert data["grpc"]["statuses"].get("OK", 0) > 0
    assert data["canary"]["runs"] >= 1 and data["canary"]["failures"] == 0, data["canary"]
    assert data["after"]["whole"] and data["after"]["serving"], data["after"]
