"""Prompts in flight: a prompt routed to an event-sending worker counts as that worker's hit
until a report shows it cached, under the window rule, and leaves when its events arrive,
when its request is cancelled, or a report timeout after it finished; `InflightPrompts`'
own bookkeeping and its `check`."""

from __future__ import annotations

import numpy as np
import pytest
from router_scenario import Cluster, P, pages_of, stored

from swaserve.proto.kv_events import KVTombstoned
from swaserve.router import Outcome, RouteDecision
from swaserve.router.cache_view import CacheViewCorrupted
from swaserve.router.inflight_view import InflightPrompts

SYSTEM = list(range(1, 25))  # 24 tokens: 12 pages, W = 4
TASKS = [SYSTEM + [100 + 10 * i + t for t in range(5)] for i in range(3)]  # 29 tokens each


def routed(decision: RouteDecision) -> tuple[str | None, int]:
    assert decision.outcome == Outcome.ROUTED
    return decision.worker_id, decision.predicted_hit_tokens


def fan_out(**config: object) -> Cluster:
    """Two cold workers, b with 10 prompt tokens queued: a request goes where it waits least
    (the default policy), so a sibling goes to a only if a's hit saves it more than that."""
    c = Cluster("a", "b", **config)
    c.report("a")
    c.report("b", queued_prefill_tokens=10)
    return c


def test_a_sibling_follows_the_shared_prompt_in_flight() -> None:
    c = fan_out()
    assert routed(c.router.route("t0", TASKS[0], 8)) == ("a", 0)  # cold everywhere
    # No report shows t0's pages yet, but a computes them before it admits t1: t1 hits the
    # 24 system tokens there (the pages t0's prompt holds whole: 28 tokens, 14 pages).
    assert c.router.predict_hits(TASKS[1][:-1]) == {"a": 24, "b": 0}
    assert routed(c.router.route("t1", TASKS[1], 8)) == ("a", 24)
    # Without the rule the sibling sees two cold workers, a behind t0's 28 tokens: b.
    off = fan_out(inflight_prefixes=False)
    assert routed(off.router.route("t0", TASKS[0], 8)) == ("a", 0)
    assert routed(off.router.route("t1", TASKS[1], 8)) == ("b", 0)
    c.router.check()
    off.router.check()


def test_a_record_leaves_once_the_worker_reports_the_prompt_cached() -> None:
    c = fan_out()
    c.router.route("t0", TASKS[0], 8)
    c.report("a", [], admitted=["t0"])  # admitted, still prefilling: no events yet
    assert c.router.predict_hits(TASKS[1][:-1])["a"] == 24
    c.report("a", [stored(TASKS[0])])
    # The exact view answers now, and it sees what the worker did since: a tombstone at
    # pages [9, 10) leaves tokens [20, 28) live, so a match ending at 24 has its W = 4.
    c.report("a", [KVTombstoned(pages_of(TASKS[0], 9, 10))])
    assert c.router.predict_hits(TASKS[1][:-1])["a"] == 24
    c.report("a", [KVTombstoned(pages_of(TASKS[0], 10, 12))])  # [20, 24) gone: back to 18
    assert c.router.predict_hits(TASKS[1][:-1])["a"] == 18
    c.router.check()


def test_a_cancelled_request_leaves_at_once_a_finished_one_a_report_timeout_later() -> None:
    c = fan_out(report_timeout_s=5.0)
    c.router.route("t0", TASKS[0], 8)
    c.router.route("t1", TASKS[1], 8)
    assert c.router.finish("t0")  # cancelled: its prompt may never be cached
    assert c.router.predict_hits(SYSTEM)["a"] == 24  # t1's record still holds the pages
    assert c.router.finish("t1", generated_tokens=8)
    c.clock.now += 4.9
    c.report("a")  # its prompt was cached; the report that shows it may still be on its way
    assert c.router.predict_hits(SYSTEM)["a"] == 24
    c.clock.now += 0.1
    c.report("a")  # none did: evicted before any report showed it, or never stored
    assert c.router.predict_hits(SYSTEM)["a"] == 0
    c.router.check()


def test_a_restart_or_removal_drops_the_worker_s_records() -> None:
    c = fan_out()
    c.router.route("t0", TASKS[0], 8)
    c.report("a", instance="i1")  # a new instance: an empty cache
    assert c.router.predict_hits(SYSTEM)["a"] == 0
    c.router.check()
    c.router.route("t1", TASKS[1], 8)
    owner = c.router.route("t2", TASKS[2], 8).worker_id
    c.router.remove_worker(owner)  # type: ignore[arg-type]
    c.router.check()


def test_an_extension_shorter_than_a_window_keeps_the_exact_view_s_window_rule() -> None:
    c = Cluster("a")
    # a holds the system prompt with its last page [22, 24) tombstoned: a match ending at 24
    # lacks its window, ending at 22 has [18, 22) live: 22 before the prompt is in flight.
    c.report("a", [stored(SYSTEM), KVTombstoned(pages_of(SYSTEM, 11, 12))])
    assert c.router.predict_hits(SYSTEM)["a"] == 22
    short = [*SYSTEM, 90, 91, 92]  # its whole pages add one past the view's: < W
    assert routed(c.router.route("s", short, 8)) == ("a", 22)
    assert c.router.predict_hits([*short[:-1], 0])["a"] == 22
    longer = SYSTEM + list(range(200, 207))  # adds 3 pages (6 tokens >= W) in flight
    assert routed(c.router.route("l", longer, 8)) == ("a", 22)
    # Its 15 whole pages are 3 past the view's (6 tokens >= W), all live once computed.
    assert c.router.predict_hits(longer[:-1])["a"] == 30
    c.router.check()


def test_inflight_prompts_count_shared_pages_and_match_by_worker() -> None:
    view = InflightPrompts(P)
    keys = [11, 12, 13, 14]
    view.add("r0", 0, keys)
    view.add("r1", 0, keys[:2])
    view.add("r2", 3, keys[:3])
    with pytest.raises(ValueError, match="already"):
        view.add("r0", 1, keys)
    hits = view.match_columns(keys, 0b1011, 4)
    assert hits.tolist() == [8, 0, 0, 6]
    assert view.match_columns(keys, 0b0010, 4).tolist() == [0, 0, 0, 0]
    assert view.match_columns([11, 99], 0b1001, 4).tolist() == [2, 0, 0, 2]
    owners = {"r0": 0, "r1": 0, "r2": 3}
    view.check(owners.get)
    view.remove("r0")
    assert view.match_columns(keys, 0b1001, 4).tolist() == [4, 0, 0, 6]
    view.settle(3, lambda key: key == 13, 0.0, 1.0)  # r2's last page is cached now
    assert len(view) == 1 and "r2" not in view
    view.check(owners.get)
    view.finished("r1", 10.0)
    view.settle(0, lambda key: False, 10.5, 1.0)
    assert "r1" in view
    view.settle(0, lambda key: False, 11.0, 1.0)
    assert len(view) == 0 and not np.any(view.match_columns(keys, 0b1111, 4))
    view.check(owners.get)


def test_inflight_check_fails_on_broken_bookkeeping() -> None:
    view = InflightPrompts(P)
    view.add("r0", 0, [1, 2])
    with pytest.raises(CacheViewCorrupted, match="elsewhere"):
        view.check({"r0": 1}.get)
    view._mask[2] = 0b11
    with pytest.raises(CacheViewCorrupted, match="masks"):
        view.check({"r0": 0}.get)
