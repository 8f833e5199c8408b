"""bench/router_sim.py --quick runs in-process and reports the promised JSON keys, and with
reports after every change the router predicts each worker's real reuse exactly, repaired
window hits included (no timing asserts: the bench is a measurement, not a test)."""

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
    assert report["window_repair_tokens"] == 256  # L_swa = 2, W = 128, P = 16
    runs = [m for by_policy in report["runs"].values() for m in by_policy.values()]
    assert [m["predicted_equals_real"] for m in runs] == [1.0] * 6
    assert report["predicted_equals_real"] == 1.0
    # The trace reaches repaired hits on every policy (a shared system prompt whose window
    # checkpoint the SWA pool evicted: its full KV stays, a new session repairs R of it).
    assert min(m["repaired"] for m in report["runs"]["chat"].values()) > 0
