"""bench/router_scale.py --quick runs end to end: the engine's event mix, the built cells'
exact page counts, the predicted cell derived from the built ones. No wall-clock asserts."""

from __future__ import annotations

import pytest
from bench_subprocess import run_bench_script

QUICK_CELLS = [(4, 10), (4, 100), (16, 10), (16, 100)]
SYSTEM_PAGES, PAGES_PER_SEQUENCE = 1024 // 16, 40


@pytest.fixture(scope="module")
def report() -> dict:
    return run_bench_script("router_scale", ["--quick"])


def test_the_event_mix_comes_from_an_engine_that_stores_tombstones_and_evicts(
    report: dict,
) -> None:
    mix = report["event_mix"]
    assert min(mix["stored_pages"], mix["removed_pages"], mix["tombstoned_pages"]) > 0
    assert mix["removed_per_stored"] == mix["removed_pages"] / mix["stored_pages"]
    assert 0 < mix["reports_with_events"] <= mix["steps"]


def test_built_cells_hold_every_page_sent_and_the_rest_are_predicted(report: dict) -> None:
    cells = {(c["workers"], c["sequences"]): c for c in report["cells"]}
    assert sorted(cells) == QUICK_CELLS
    built = [cells[k] for k in QUICK_CELLS[:3]]
    assert all(c["built"] for c in built) and not cells[16, 100]["built"]
    for c in built:
        n, s = c["workers"], c["sequences"]
        # Each worker: 1-4 turns of 16 pages per sequence (mean 40), plus the system prompts
        # its sequences use (at most 16 of 64 pages each, at least one).
        assert n * s * 16 + n * SYSTEM_PAGES <= c["pages_held"] <= n * (s * 64 + 16 * SYSTEM_PAGES)
        assert abs(c["pages_held"] - c["expected_pages"]) <= 0.1 * c["expected_pages"]
        assert c["trie_pages"] <= c["pages_held"]  # system prompt pages are shared in the trie
        assert c["memory_measure"] == "tracemalloc" and c["bytes_per_page"] > 0
        assert c["memory_bytes"] == pytest.approx(c["bytes_per_page"] * c["pages_held"])
        d = c["decision"]
        assert d["probes"] == 200 and 0 < d["p50_ms"] <= d["p99_ms"]
        assert d["hit_share"] >= 0.8  # 90 % of probes start with a cached prefix
        assert c["ingest"]["pages"] > 0 and c["ingest"]["pages_per_s"] > 0
    largest = max(built, key=lambda c: c["pages_held"])
    predicted = cells[16, 100]
    assert predicted["pages_held"] == predicted_pages(16, 100)
    assert predicted["bytes_per_page"] == largest["bytes_per_page"]
    assert predicted["memory_bytes"] == pytest.approx(
        predicted["pages_held"] * largest["bytes_per_page"]
    )
    assert predicted["decision"] == {k: cells[16, 10]["decision"][k] for k in ("p50_ms", "p99_ms")}


def test_the_summary_is_the_largest_cell_and_the_sharding_figure(report: dict) -> None:
    summary, cells = report["summary"], report["cells"]
    target = next(c for c in cells if (c["workers"], c["sequences"]) == (16, 100))
    assert summary["memory_bytes"] == target["memory_bytes"]
    assert summary["pages_per_router"] == pytest.approx(8e9 / summary["bytes_per_page"])
    assert summary["sequences_per_router"] == pytest.approx(summary["pages_per_router"] / 40)
    assert summary["routers_needed"] == 1  # 0.1 GB of state fits one router


def predicted_pages(workers: int, sequences: int) -> int:
    """The bench's expected size: unique pages plus the system prompts a worker's sequences
    use (16 prompts, weights 1 / (j + 1))."""
    weights = [1 / (j + 1) for j in range(16)]
    systems = sum(1 - (1 - w / sum(weights)) ** sequences for w in weights)
    return round(workers * (sequences * PAGES_PER_SEQUENCE + systems * SYSTEM_PAGES))
