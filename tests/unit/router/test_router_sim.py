"""bench/router_sim.py --quick runs in-process and reports the promised JSON keys (no timing
asserts: the bench is a measurement, not a test)."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_router_sim_quick_reports_json(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("router_sim", ROOT / "bench" / "router_sim.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "router_sim", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = io.StringIO()
    with redirect_stdout(out):
        bench.main(["--quick", "--json", "--workers", "2", "--seed", "3"])
    report = json.loads(out.getvalue().strip().splitlines()[-1])
    for key in ("prefix_vs_round_robin", "imbalance", "predicted_equals_real", "p99_decision_ms"):
        assert isinstance(report[key], float), key
    assert set(report["runs"]) == {"chat", "independent"}
    assert set(report["runs"]["chat"]) == {"prefix", "round_robin", "least_load"}
    chat = report["runs"]["chat"]["prefix"]
    assert chat["requests"] > 0 and chat["stuck"] == 0
    assert report["cached_sequences"] == 400
