"""bench/router_sim.py --quick runs in-process and reports the promised JSON keys, and with
reports after every change the router predicts each worker's real reuse exactly, repaired
window hits included; the comparison with the anchors' rules replays every request of each
trace for every policy and report delay, and the exact-KV baseline (no window rule) predicts
what an SWA-unaware view predicts (no timing asserts: the bench is a measurement, not a
test)."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _load(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # its sibling modules
    spec = importlib.util.spec_from_file_location("router_sim", ROOT / "bench" / "router_sim.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "router_sim", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


def test_ttft_floor_counts_only_pages_sent_strictly_earlier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = _load(monkeypatch)
    req = bench.SimRequest
    requests = [
        req("r1", list(range(1, 9)), [9, 10], None, arrival_s=0.0),  # cold: 8 tokens
        req("r2", [1, 2, 3, 4, 5, 6, 20, 21], [0], None, arrival_s=0.0),  # same time: cold
        req("r3", [*range(1, 11), 30], [0], None, arrival_s=1.0),  # r1's 5 pages: 1 to go
        req("r4", [1, 2, 3, 99, 5, 6], [0], None, arrival_s=2.0),  # page [1, 2] only: 4
    ]
    floors = bench.ttft_floors_s(requests, page_size=2, tokens_per_s=10.0)
    assert floors == pytest.approx([0.8, 0.8, 0.1, 0.4])


def test_router_sim_quick_reports_json(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _load(monkeypatch)
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

    comparison = report["comparison"]["runs"]
    assert set(comparison) == {"chat", "agentic", "skewed"}
    # Every trace's requests: chat 23 turns; agentic 4 runs × (4 subs + 1 join); skewed 24.
    sizes = {"chat": 23, "agentic": 20, "skewed": 24}
    policies = {"prefix", "ttft", "round_robin", "least_load"}
    policies |= {"sglang_cache_aware", "ray_prefix_affinity", "exact_kv"}
    for workload, by_delay in comparison.items():
        assert set(by_delay) == {"0", "100", "500"}
        for by_policy in by_delay.values():
            assert set(by_policy) == policies
            for m in by_policy.values():
                assert (m["requests"], m["refused"], m["stuck"]) == (sizes[workload], 0, 0)
                assert 0 < m["ttft_p50_ms"] <= m["ttft_p99_ms"] and m["throughput_tok_s"] > 0
                # A floor, up to float rounding (it sums tokens / rate, the run adds times).
                assert 0 < m["ttft_floor_p99_ms"] <= m["ttft_p99_ms"] + 1e-6
    for workload in ("chat", "agentic"):
        instant = comparison[workload]["0"]
        assert instant["prefix"]["predicted_equals_real"] == 1.0
        assert instant["ttft"]["predicted_equals_real"] == 1.0
        exact = instant["exact_kv"]
        # A tombstoned page counts as a hit: it predicts what the SWA-unaware view does ...
        assert exact["predicted_equals_real"] == exact["swa_unaware_equals_real"]
    # ... and misses the real reuse where the window was lost (chat's SWA pressure: cached
    # histories lose their windows between turns).
    assert comparison["chat"]["0"]["exact_kv"]["predicted_equals_real"] < 1.0
    ratios = report["comparison"]["ratios"]
    assert set(ratios["agentic"]) == {"0", "100", "500"}
    assert ratios["agentic"]["0"]["ours"] in {"prefix", "ttft"}
    for workload, by_delay in ratios.items():
        for delay, r in by_delay.items():
            # The room is the best anchor's p99 over the floor or the one-pool reference,
            # whichever is larger (the reference is one run per workload, every delay alike).
            by_policy = comparison[workload][delay]
            anchor_ms = by_policy[r["best_anchor"]]["ttft_p99_ms"]
            floor_ms = by_policy[r["ours"]]["ttft_floor_p99_ms"]
            assert r["one_pool_p99_ms"] == ratios[workload]["0"]["one_pool_p99_ms"] > 0
            assert r["room"] == pytest.approx(anchor_ms / max(floor_ms, r["one_pool_p99_ms"]))


def test_the_one_pool_reference_holds_the_fleet_s_memory_and_prefill_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = _load(monkeypatch)
    spec = bench.WorkerSpec()
    one = bench.pooled(spec, 4)
    assert (one.full_tokens, one.swa_tokens) == (4 * spec.full_tokens, 4 * spec.swa_tokens)
    assert one.prefill_tokens_per_s == 4 * spec.prefill_tokens_per_s
    assert (one.window, one.page_size, one.chunk_tokens) == (
        spec.window,
        spec.page_size,
        spec.chunk_tokens,
    )


def test_sim_workers_report_the_prefill_under_way_and_their_measured_speed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the engine's: the first report carries the prefill timed at start; a started prefill
    is in `prefilling_tokens` by what is left of it, and in the counters once it ended."""
    bench = _load(monkeypatch)
    spec = bench.WorkerSpec()
    slow = bench.SimWorker("w0", bench.replace(spec, speed=0.5))
    first = slow.report(0.0).headroom
    assert first.prefill_tokens_total == bench.CALIBRATION_TOKENS
    assert first.prefill_s_total == pytest.approx(
        bench.CALIBRATION_TOKENS / (0.5 * spec.prefill_tokens_per_s)
    )
    prompt = list(range(1, 4001))  # 4000 cold tokens: 0.4 s at half of 20k tokens/s
    admitted = slow.submit(bench.SimRequest("r", prompt, [7] * 8, None), 0.0)
    assert [r.request_id for r in admitted] == ["r"]
    assert slow.report(0.1).headroom.prefilling_tokens == 3000
    ended = slow.report(0.5).headroom
    assert ended.prefilling_tokens == 0
    assert ended.prefill_tokens_total == bench.CALIBRATION_TOKENS + 4000
    assert ended.prefill_s_total == pytest.approx(first.prefill_s_total + 0.4)
