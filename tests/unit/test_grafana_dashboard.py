"""The Grafana dashboard (deploy/grafana/swaserve-dashboard.json) against the metrics that
`swaserve.cluster.metrics` really exports: every series a query names exists, with the labels
the query filters on; every exported metric is charted; the layout and variables are sound."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from swaserve.cluster.metrics import ServingMetrics
from swaserve.cluster.routed import TTFTBreakdown
from swaserve.cluster.router_actor import WorkerStatus
from swaserve.proto.messages import Headroom
from swaserve.proto.stream import RequestTimings

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "swaserve-dashboard.json"
GRID_COLUMNS = 24
# A metric name in PromQL; digits too (`e2e_request_latency_seconds`)
METRIC_RE = re.compile(r"swaserve:[a-z0-9_]+")
# A selector: the name and, when present, its label matchers
SELECTOR_RE = re.compile(r"(swaserve:[a-z0-9_]+)(\{[^}]*\})?")
RANGE_RE = re.compile(r"\[([^\]]*)\]")
PAIRS = {")": "(", "]": "[", "}": "{"}

HEADROOM = Headroom(
    full_total_tokens=1000,
    full_free_tokens=600,
    full_evictable_tokens=150,
    swa_total_tokens=800,
    swa_free_tokens=700,
    swa_evictable_tokens=20,
    num_running=3,
    num_waiting=1,
    full_protected_tokens=50,
    swa_protected_tokens=30,
    prompt_tokens_total=400,
    cached_tokens_total=120,
)


@cache
def exported() -> dict[str, tuple[str, frozenset[str]]]:
    """Each sample name the registry exposes → (its family's name, the labels it carries).

    The registry is fed one worker, one routing decision and one request (with its first
    token's parts), so every family has samples; a family's sample names are the client's own
    suffix rules (`_bucket`/`_count`/`_sum` for a histogram, `_total` for a counter). The
    `_created` timestamp families that prometheus-client adds beside each histogram are left
    out: nothing to chart.
    """
    metrics = ServingMetrics("m")
    metrics.snapshot.update(
        [WorkerStatus("worker-0", HEADROOM, 0.0, 0)],
        {"decisions": {"prefix/routed": 1}, "queue_len": 0},
    )
    timer = metrics.tracker(arrival_s=0.0)
    timer.tokens(1, "worker-0", now_s=0.1)
    timer.tokens(1, "worker-0", now_s=0.2)
    timer.finish(now_s=0.3)
    timings = RequestTimings(0.01, 0.05, "", 1, 0, 8)
    metrics.observe_ttft_parts(TTFTBreakdown("r", "worker-0", 0.01, 0, timings, 0.1))
    text = generate_latest(metrics.registry).decode()
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue
        for sample in family.samples:
            labels = out.get(sample.name, (family.name, frozenset()))[1]
            out[sample.name] = (family.name, labels | set(sample.labels))
    return out


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every query target."""
    return [
        (panel["title"], target["expr"])
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def unknown_series(expr: str) -> list[str]:
    """Metric names in `expr` that the registry does not expose."""
    return [name for name in METRIC_RE.findall(expr) if name not in exported()]


def unbalanced(expr: str) -> str | None:
    """Where `expr`'s (), [], {} first fail to pair (quoted strings skipped), or None."""
    stack: list[str] = []
    quote: str | None = None
    escaped = False
    for i, ch in enumerate(expr):
        if quote is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in PAIRS and (not stack or stack.pop() != PAIRS[ch]):
            return f"unmatched {ch!r} at {i}"
    if quote is not None:
        return "unterminated string"
    return f"unclosed {stack[-1]!r}" if stack else None


def test_the_checkers_catch_what_they_are_for() -> None:
    assert unknown_series('swaserve:token_usage_total{model_name=~"$model_name"}') == [
        "swaserve:token_usage_total"
    ]
    assert unknown_series("rate(swaserve:e2e_request_latency_seconds_bucket[5m])") == []
    assert unknown_series("swaserve:time_to_first_token_seconds") == [
        "swaserve:time_to_first_token_seconds"
    ]
    assert unbalanced('sum(rate(x{a="(("}[5m]))') is None
    assert unbalanced("sum(rate(x[5m])") == "unclosed '('"
    assert unbalanced("sum(x[5m)]") == "unmatched ')' at 8"


def test_exported_families_are_the_ones_the_dashboard_was_built_for() -> None:
    families = {family for family, _ in exported().values()}
    assert len(families) == 25
    assert exported()["swaserve:router_decisions_total"] == (
        "swaserve:router_decisions",
        frozenset({"model_name", "policy", "outcome"}),
    )
    assert exported()["swaserve:time_to_first_token_seconds_bucket"][1] == {
        "model_name",
        "worker",
        "le",
    }


def test_json_is_an_importable_dashboard_model() -> None:
    board = dashboard()
    assert board["id"] is None  # an import creates it; a fixed uid makes re-imports replace
    assert board["uid"] == "swaserve-overview"
    assert 36 <= board["schemaVersion"] <= 41
    assert board["panels"]


def test_panels_have_unique_ids_and_non_overlapping_grid_positions() -> None:
    panels = dashboard()["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"duplicate ids: {ids}"
    titles = [panel["title"] for panel in panels]
    assert len(titles) == len(set(titles)), f"duplicate titles: {titles}"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert {k: type(pos[k]) for k in "hwxy"} == dict.fromkeys("hwxy", int), panel["title"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] >= 0 and pos["y"] >= 0
        assert pos["x"] + pos["w"] <= GRID_COLUMNS, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                other = cells.setdefault((x, y), panel["title"])
                assert other == panel["title"], f"{panel['title']!r} overlaps {other!r}"


def test_every_query_names_only_exported_series() -> None:
    for title, expr in exprs():
        assert METRIC_RE.search(expr), f"{title}: no swaserve metric in {expr}"
        assert unknown_series(expr) == [], f"{title}: {expr}"


def test_every_exported_metric_is_charted() -> None:
    charted = {exported()[name][0] for _, expr in exprs() for name in METRIC_RE.findall(expr)}
    families = {family for family, _ in exported().values()}
    assert families - charted == set()


def test_every_selector_filters_on_the_template_variables_its_labels_allow() -> None:
    for title, expr in exprs():
        for name, matchers in SELECTOR_RE.findall(expr):
            labels = exported()[name][1]
            where = f"{title}: {name} in {expr}"
            assert 'model_name=~"$model_name"' in matchers, where
            assert ('worker=~"$worker"' in matchers) == ("worker" in labels), where


def test_ranges_use_the_rate_interval_and_buckets_go_through_histogram_quantile() -> None:
    for title, expr in exprs():
        assert set(RANGE_RE.findall(expr)) <= {"$__rate_interval"}, f"{title}: {expr}"
        if "_bucket" in expr:
            assert expr.startswith("histogram_quantile("), f"{title}: {expr}"
            assert "sum by (le) (rate(" in expr, f"{title}: {expr}"


def test_query_brackets_balance() -> None:
    for title, expr in exprs():
        assert unbalanced(expr) is None, f"{title}: {unbalanced(expr)} in {expr}"


def test_template_variables() -> None:
    found = variables()
    assert found["datasource"]["type"] == "datasource"
    assert found["datasource"]["query"] == "prometheus"
    for name, metric_filter in (("model_name", ""), ("worker", '{model_name=~"$model_name"}')):
        var = found[name]
        assert var["type"] == "query"
        assert var["multi"] is True and var["includeAll"] is True
        # `.*` also matches a series without the label (e2e of a request that streamed nothing)
        assert var["allValue"] == ".*"
        match = re.fullmatch(r"label_values\((swaserve:[a-z0-9_]+)(\{.*\})?, (\w+)\)", var["query"])
        assert match is not None, var["query"]
        metric, got_filter, label = match.groups()
        assert label == name
        assert name in exported()[metric][1], f"{metric} has no {name} label"
        assert (got_filter or "") == metric_filter


def test_every_panel_and_query_reads_the_datasource_variable() -> None:
    wanted = {"type": "prometheus", "uid": "${datasource}"}
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == wanted, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == wanted, panel["title"]
    assert variables()["model_name"]["datasource"] == wanted
    assert variables()["worker"]["datasource"] == wanted


def test_layout_a_user_reads() -> None:
    panels = {panel["title"]: panel for panel in dashboard()["panels"] if panel["type"] != "row"}
    stats = [p for p in panels.values() if p["type"] == "stat"]
    assert sorted(p["title"] for p in stats) == [
        "Prefix-cache hit rate",
        "Requests running",
        "Requests waiting",
        "TTFT p99",
    ]
    assert {p["gridPos"]["y"] for p in stats} == {min(p["gridPos"]["y"] for p in panels.values())}
    full, swa = panels["Full pool usage"]["gridPos"], panels["SWA pool usage"]["gridPos"]
    assert full["y"] == swa["y"] and full["x"] + full["w"] == swa["x"]
    decisions = panels["Router decisions"]
    assert decisions["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert "by (model_name, policy, outcome)" in decisions["targets"][0]["expr"]
    legends = [t["legendFormat"] for t in panels["Time to first token"]["targets"]]
    assert legends == ["p50", "p90", "p99"]
    quantiles = [t["expr"].split(",")[0] for t in panels["Time to first token"]["targets"]]
    assert quantiles == [
        "histogram_quantile(0.5",
        "histogram_quantile(0.9",
        "histogram_quantile(0.99",
    ]


def test_queries_parse_as_promql() -> None:
    promql_parser = pytest.importorskip("promql_parser")
    for _, expr in exprs():
        concrete = (
            expr.replace("$__rate_interval", "1m")
            .replace("$model_name", ".*")
            .replace("$worker", ".*")
        )
        promql_parser.parse(concrete)  # raises ValueError on a syntax error
