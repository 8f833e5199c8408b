"""bench/chaos.py end to end at tiny sizes, in a subprocess (its own local Ray): a worker
process and then the router actor are SIGKILLed while streams run over gRPC and HTTP; no
stream is lost, every stream's tokens equal the undisturbed run's, the killed worker's streams
migrated, and the cluster lists 2 workers again. No timing asserts."""

from __future__ import annotations

import pytest
from bench_subprocess import run_bench_script


@pytest.mark.slow
def test_chaos_bench_loses_nothing() -> None:
    data = run_bench_script(
        "chaos", ["--streams=6", "--max-new-tokens=64", "--hidden=64", "--layers=2"]
    )
    for fault in ("worker", "router"):
        result = data[fault]
        assert result["lost"] == 0, result
        assert result["differ"] == 0, result
        assert result["recovery_s"] is not None
    assert data["worker"]["migrations"] >= 1  # the victim held streams when it died
    assert data["recreated_groups"] == 1
