"""Router rules, one test each, with exact workers, hits, budgets and times: the window rule
and window repair in the hit, the work that balances (`prefix`), two-pool admission, the queue bound and
deadlines, stale workers, restarts, lost reports and snapshot resyncs, report ages on the
router's clock, pending requests covered by the ids a report lists."""

from __future__ import annotations

import pytest
from router_scenario import Cluster, P, W, pages_of, stored

from swaserve.proto.kv_events import KVCleared, KVTombstoned
from swaserve.router import Outcome, Overloaded, RouteDecision, RouterConfig
from swaserve.router.worker_state import RequestNeed

PROMPT = list(range(1, 18))  # 17 tokens: the engine matches the first 16 (8 pages)


def routed(decision: RouteDecision) -> tuple[str | None, int]:
    assert decision.outcome == Outcome.ROUTED
    return decision.worker_id, decision.predicted_hit_tokens


# ---- rule: SWA-aware predicted hit ----------------------------------------------------------------


def test_route_predicts_the_hit_under_the_window_rule() -> None:
    c = Cluster("a")
    c.report("a", [stored(PROMPT), KVTombstoned(pages_of(PROMPT, 4, 5))])  # [9,10] tombstone
    # Ends after the tombstone need W = 4 live tokens: 14 is the first; 16 still holds.
    assert routed(c.router.route("r1", PROMPT, 8)) == ("a", 16)
    assert routed(c.router.route("r2", PROMPT[:13], 8)) == ("a", 8)  # matches 12: 2 live
    assert c.router.predict_hits(PROMPT[:12]) == {"a": 8}
    assert c.router.stats.predicted_hit_tokens == 24


def test_a_chunked_worker_is_matched_by_the_chunk_rule() -> None:
    """Worker a reports chunked local layers (C = 8, W = 7), b a window of 7; both hold the
    prompt. Positions [2, 10) tombstoned: a resumes at the chunk boundary 8 inside the
    tombstone (no live KV needed there), b only at 2 (no tombstone before it). Positions [2, 8)
    tombstoned: an end at 10 needs [8, 10) live under chunks (a: 10) but 7 live tokens under the
    window (b: 2)."""
    c = Cluster("a", "b", inflight_prefixes=False)
    inside = [stored(PROMPT), KVTombstoned(pages_of(PROMPT, 1, 5))]
    c.report("a", inside, sliding_window_size=7, attention_chunk_size=8)
    c.report("b", inside, sliding_window_size=7)
    assert c.router.predict_hits(PROMPT[:10]) == {"a": 8, "b": 2}
    assert c.router.predict_hits(PROMPT) == {"a": 16, "b": 2}  # 16 is a boundary too
    c = Cluster("a", "b", inflight_prefixes=False)
    before = [stored(PROMPT), KVTombstoned(pages_of(PROMPT, 1, 4))]
    c.report("a", before, sliding_window_size=7, attention_chunk_size=8)
    c.report("b", before, sliding_window_size=7)
    assert c.router.predict_hits(PROMPT[:10]) == {"a": 10, "b": 2}
    assert c.router.predict_hits(PROMPT) == {"a": 16, "b": 16}


def test_route_scores_a_repairing_worker_by_the_tokens_its_hit_saves() -> None:
    c = Cluster("a", "b", inflight_prefixes=False)  # r1's prompt stays b's 10 cached tokens
    # a: all 8 pages, [3..14] tombstoned: only [15,16] live before 16, so its plain match is
    # 2; repairing R = 4 tokens it skips 16 - 4 = 12. b: [1..10] live, a plain hit of 10.
    c.report("a", [stored(PROMPT), KVTombstoned(pages_of(PROMPT, 1, 7))])
    c.report("b", [stored(PROMPT[:10])])
    assert c.router.predict_hits(PROMPT[:16]) == {"a": 2, "b": 10}
    assert routed(c.router.route("r1", PROMPT, 8)) == ("b", 10)
    c.report("a", window_repair_tokens=4)
    assert c.router.predict_hits(PROMPT[:16]) == {"a": 12, "b": 10}
    assert routed(c.router.route("r2", PROMPT, 8)) == ("a", 12)
    # Its need counts the 4 recomputed tokens as uncached: 17 - 12 + 8 new; SWA 5 + W + P.
    state = c.router._workers["a"]
    assert state.inflight["r2"].need == RequestNeed(13, 5 + W + P)
    assert state.pending_full_tokens == 13
    assert c.router.stats.predicted_hit_tokens == 22
    c.report("a", window_repair_tokens=12)  # 16 - 12 = 4 <= 10: b again, and a saves 4
    assert routed(c.router.route("r3", PROMPT, 8)) == ("b", 10)
    assert c.router.predict_hits(PROMPT[:16])["a"] == 4


# ---- rule: the load that balances is work -------------------------------------------------------


@pytest.mark.parametrize(
    ("a_running", "queued", "expected"),
    [
        # score = queued + uncached × (1 + load): a 1 × (1 + running), b 17, c 9
        (2, {"a": 0, "b": 0, "c": 0}, ("a", 16)),  # a 3
        (2, {"a": 6, "b": 0, "c": 0}, ("a", 16)),  # a 9 = c 9: the longer hit
        (2, {"a": 7, "b": 0, "c": 0}, ("c", 8)),  # a 10 > c 9
        (2, {"a": 40, "b": 0, "c": 30}, ("b", 0)),  # a 43, c 39, b 17
        (12, {"a": 0, "b": 0, "c": 0}, ("c", 8)),  # a 13: its 12 requests wait for it too
    ],
)
def test_prefix_keeps_a_session_while_its_worker_is_about_as_busy_as_the_rest(
    a_running: int, queued: dict[str, int], expected: tuple[str, int]
) -> None:
    """The work queued on a worker and the delay the request's own prefill adds to each
    request there (`prefix_load_weight` = 1), against the idle b and c."""
    c = Cluster("a", "b", "c", policy="prefix", inflight_prefixes=False)
    c.report("a", [stored(PROMPT)], queued_prefill_tokens=queued["a"], num_running=a_running)
    c.report("b", queued_prefill_tokens=queued["b"])
    c.report("c", [stored(PROMPT[:8])], queued_prefill_tokens=queued["c"])
    assert routed(c.router.route("r", PROMPT, 8)) == expected


def test_prefix_counts_the_requests_and_prefill_routed_since_the_last_report() -> None:
    """Prompts sharing a's 16 cached tokens, each with 26 new ones (42 in all): a scores
    26 on its own, then 26 + 26 × 2 with the first routed there, against the idle b's 42;
    b then scores 42 + 42 × 2 = 126, a 78."""
    c = Cluster("a", "b", policy="prefix", inflight_prefixes=False)
    c.report("a", [stored(PROMPT)])
    c.report("b")
    prompts = [PROMPT[:16] + [100 * (i + 1) + t for t in range(26)] for i in range(4)]
    hits = [routed(c.router.route(f"r{i}", prompts[i], 8)) for i in range(3)]
    assert hits == [("a", 16), ("b", 0), ("a", 16)]
    for request_id in ("r0", "r1", "r2"):
        c.router.finish(request_id)
    c.report("a", admitted=["r0", "r2"], queued_prefill_tokens=0)
    c.report("b", admitted=["r1"], queued_prefill_tokens=0)
    assert routed(c.router.route("r3", prompts[3], 8)) == ("a", 16)
    c.router.check()


def test_prefix_counts_a_workers_running_decodes_as_its_decode_step() -> None:
    """A worker's running requests cost a new one about one decode step: its measured
    decode step's seconds in its own prompt tokens (`WorkerState.decode_tokens`)."""
    c = Cluster("a", "b", policy="prefix", inflight_prefixes=False)
    prefill = {"prefill_tokens_total": 1000, "prefill_s_total": 0.1}  # 0.1 ms per token
    c.report("a", [stored(PROMPT)], **prefill)
    c.report("b", **prefill)
    # a decodes 8 requests in 5 ms steps, 50 tokens' worth: 50 + 1 × 9 > b's 17.
    c.report("a", num_running=8, decode_steps_total=10, decode_s_total=0.05, **prefill)
    assert c.router.worker("a").decode_tokens == 50
    assert routed(c.router.route("r1", PROMPT, 8)) == ("b", 0)
    c.router.finish("r1")
    # With nothing running its decode step costs nothing: a keeps its hit.
    c.report("a", num_running=0, decode_steps_total=10, decode_s_total=0.05, **prefill)
    assert c.router.worker("a").decode_tokens == 0
    assert routed(c.router.route("r2", PROMPT, 8)) == ("a", 16)


# ---- rule: admission by both pools ----------------------------------------------------------------


def test_admission_refuses_when_one_pool_lacks_room_while_the_other_has_plenty() -> None:
    c = Cluster("a", "b")
    # Request: 17 prompt tokens, no hit, 20 new. Full need 17 + 20 = 37. SWA need (no
    # chunking) 17 + W + P = 23.
    c.report("a", full_free_tokens=36)  # full short by one, SWA 10_000 free
    c.report("b", swa_free_tokens=22)  # SWA short by one, full 10_000 free
    assert c.router.route("r", PROMPT, 20).outcome == Outcome.QUEUED
    c.report("b", swa_free_tokens=10, swa_evictable_tokens=13)  # evictable counts: 23
    assert [(d.request_id, d.worker_id) for d in c.router.poll()] == [("r", "b")]


def test_admission_charges_reservations_waiting_work_and_requests_routed_since() -> None:
    c = Cluster("a")
    # full: 200 - 60 reserved - 40 queued = 100; SWA: 200 - 30 reserved - 1 waiting × (W + P)
    # - min(40 queued, chunk 8) = 156 (the queue's prefill holds one chunk at a time).
    c.report(
        "a",
        full_free_tokens=200,
        full_reserved_tokens=60,
        queued_prefill_tokens=40,
        num_waiting=1,
        swa_free_tokens=200,
        swa_reserved_tokens=30,
        chunked_prefill_size=8,
    )
    state = c.router._workers["a"]
    assert state.budgets() == (100, 156)
    assert c.router.route("r1", PROMPT, 83).outcome == Outcome.ROUTED  # full need 100
    # Pending until a report covers it: its full need, and a window once it runs (the
    # chunk in flight is already counted).
    assert state.budgets() == (0, 156 - (W + P))
    assert c.router.route("r2", [1, 2], 150).outcome == Outcome.QUEUED  # full need 152
    c.clock.now = 1.0
    # A later report that does not list r1 was made before the worker took it: still pending,
    # whatever the worker's clock says.
    c.report("a", full_free_tokens=200, timestamp_s=1e9)
    # Unchunked now: its whole 17-token prompt is the prefill in flight.
    assert state.budgets() == (100, 10_000 - (W + P) - 17) and c.router.poll() == []
    c.report("a", full_free_tokens=200, admitted=["r1", "unknown"])  # r1 is in this one
    assert state.budgets() == (200, 10_000) and state.num_pending == 0
    assert routed(c.router.poll()[0]) == ("a", 0)
    c.router.check()


def test_a_waiting_request_the_router_routed_is_charged_its_own_full_need() -> None:
    """A report counts a waiting prompt whole; the engine admits it for its uncached tokens
    and its new ones, which the router predicted when it routed it."""
    c = Cluster("a", inflight_prefixes=False)
    c.report("a", [stored(PROMPT)], full_free_tokens=200)
    state = c.router._workers["a"]
    assert c.router.route("r1", PROMPT, 5).predicted_hit_tokens == 16  # full need 1 + 5
    assert state.budgets()[0] == 200 - 6
    waiting = {"num_waiting": 1, "queued_prefill_tokens": len(PROMPT), "full_free_tokens": 200}
    c.report("a", admitted=["r1"], **waiting)
    assert state.num_pending == 0 and state.budgets()[0] == 200 - 6  # not 200 - 17
    # Two waiting, one the router did not route: the report's whole prompts.
    c.report("a", **{**waiting, "num_waiting": 2, "queued_prefill_tokens": 40})
    assert state.budgets()[0] == 200 - 40
    c.router.check()


def test_queued_requests_charge_what_a_running_one_holds_each_and_one_prefill_chunk() -> None:
    c = Cluster("a")
    c.report("a", swa_free_tokens=100, chunked_prefill_size=8)
    state = c.router._workers["a"]
    for rid in ("r1", "r2", "r3"):  # 17 uncached tokens each: a chunk of 8 + W + P = 14
        assert c.router.route(rid, PROMPT, 1).outcome == Outcome.ROUTED
    # Three windows (they will all run) and one chunk (their prefills come one at a time).
    assert state.budgets()[1] == 100 - 3 * (W + P) - 8
    c.report(
        "a",
        swa_free_tokens=100,
        chunked_prefill_size=8,
        num_waiting=3,
        admitted=["r1", "r2", "r3"],
        queued_prefill_tokens=51,
    )
    assert state.budgets()[1] == 100 - 3 * (W + P) - 8
    # Two requests run, reserving 10 SWA tokens between them. Holding 4 between them (less
    # than a window each), a queued one will hold its window and reserve their average (5).
    running = {"num_running": 2, "swa_reserved_tokens": 10, "num_waiting": 3}
    queue = {"queued_prefill_tokens": 51, "chunked_prefill_size": 8}
    c.report("a", swa_free_tokens=100, swa_total_tokens=104, **running, **queue)
    assert state.budgets()[1] == 100 - 10 - 3 * (W + P + 5) - 8
    # Holding 40 between them (windows, a chunk under way, cached windows they lock), each
    # queued one will hold as much as one of them: 20 + 5.
    c.report("a", swa_free_tokens=100, swa_total_tokens=140, **running, **queue)
    assert state.budgets()[1] == 100 - 10 - 3 * (20 + 5) - 8
    c.router.check()


# ---- rule: queue bound → Overloaded; FIFO --------------------------------------------------------


def test_full_queue_raises_overloaded() -> None:
    c = Cluster("a", max_queue_len=2)
    c.report("a", full_free_tokens=0)
    assert [c.router.route(f"r{i}", PROMPT, 1).outcome for i in range(2)] == [Outcome.QUEUED] * 2
    with pytest.raises(Overloaded) as raised:
        c.router.route("r2", PROMPT, 1)
    assert (raised.value.request_id, raised.value.queue_len) == ("r2", 2)
    assert c.router.stats.decisions == {("ttft", "queued"): 2, ("ttft", "overloaded"): 1}
    assert c.router.finish("r0") and c.router.queue_len == 1  # cancelled while queued
    assert c.router.route("r3", PROMPT, 1).outcome == Outcome.QUEUED


def test_queue_is_fifo_and_new_requests_do_not_overtake() -> None:
    c = Cluster("a")
    c.report("a", full_free_tokens=30)
    assert c.router.route("big", PROMPT, 20).outcome == Outcome.QUEUED  # needs 37
    assert c.router.route("small", [1, 2], 1).outcome == Outcome.QUEUED  # fits, but waits
    assert c.router.poll() == []  # the head still does not fit
    c.report("a", full_free_tokens=40)  # 37 + 3: both fit now, in order
    assert [d.request_id for d in c.router.poll()] == ["big", "small"]
    c.router.check()


# ---- rule: deadline expiry ------------------------------------------------------------------------


def test_queued_request_expires_at_its_deadline() -> None:
    c = Cluster("a", queue_timeout_s=30.0, report_timeout_s=100.0)
    c.report("a", full_free_tokens=0)
    c.router.route("soon", PROMPT, 1, deadline_s=10.0)
    c.router.route("later", PROMPT, 1)  # default deadline 0 + 30
    assert c.router.route("past", PROMPT, 1, deadline_s=0.0).outcome == Outcome.EXPIRED
    c.clock.now = 9.5
    assert c.router.poll() == []
    c.clock.now = 10.0
    assert c.router.poll() == [RouteDecision("soon", Outcome.EXPIRED, None, "ttft", 0, 10.0)]
    c.clock.now = 11.0
    c.report("a")
    assert c.router.poll() == [RouteDecision("later", Outcome.ROUTED, "a", "ttft", 0, 11.0)]
    stats = c.router.stats
    assert (stats.queue_waits, stats.queue_wait_s_total, stats.queue_wait_s_max) == (2, 21.0, 11.0)
    assert stats.decisions[("ttft", "expired")] == 2


# ---- rule: stale worker skipped -------------------------------------------------------------------


def test_stale_worker_is_skipped_and_taken_back_after_a_report() -> None:
    c = Cluster("a", "b", report_timeout_s=5.0)
    c.report("a", [stored(PROMPT)])
    c.clock.now = 3.0
    c.report("b")
    c.clock.now = 5.5  # a's report is 5.5 s old, b's 2.5 s
    assert routed(c.router.route("r1", PROMPT, 1)) == ("b", 0)
    assert c.router.stats.stale_skips == 1
    c.report("a")
    assert routed(c.router.route("r2", PROMPT, 1)) == ("a", 16)
    c.clock.now = 100.0  # nobody is fresh: the request waits
    assert c.router.route("r3", PROMPT, 1).outcome == Outcome.QUEUED


def test_worker_without_a_report_takes_nothing() -> None:
    c = Cluster("a")
    assert c.router.route("r", PROMPT, 1).outcome == Outcome.QUEUED
    c.report("a")
    assert routed(c.router.poll()[0]) == ("a", 0)


# ---- rule: a restart (or a cache clear) drops the view; lost reports ask for a snapshot ------------


def test_restart_clears_the_workers_view() -> None:
    c = Cluster("a", "b")
    c.report("a", [stored(PROMPT)])
    c.report("b", [stored(PROMPT)])
    assert c.router.predict_hits(PROMPT) == {"a": 16, "b": 16}
    c.report("a", instance="i1")  # restarted: empty cache, no events yet
    assert c.router.predict_hits(PROMPT) == {"a": 0, "b": 16}
    assert c.router.stats.restarts == 1
    c.report("b", [KVCleared()])
    assert c.router.predict_hits(PROMPT) == {"a": 0, "b": 0}
    c.router.check()


def test_lost_report_asks_for_a_snapshot_and_keeps_the_view_until_it_comes() -> None:
    c = Cluster("a")
    assert c.report("a", [stored(PROMPT[:8])]) is False
    # seq 1 -> 3: report 2 was lost. The view stays, the new events still apply to it, and
    # the worker stays routable; every answer asks for a snapshot until one comes.
    assert c.report("a", [stored(PROMPT[8:], parent=PROMPT[:8])], skip=1) is True
    assert c.router.predict_hits(PROMPT) == {"a": 16}
    assert routed(c.router.route("r1", PROMPT, 1)) == ("a", 16)
    assert c.report("a") is True
    stats = c.router.stats
    assert (stats.lost_reports, stats.resyncs_requested, stats.event_mismatches) == (1, 1, 0)
    c.seq["a"] = 1  # report 2 arrives late: ignored, and the answer still asks
    assert c.report("a", [stored(PROMPT)]) is True
    assert stats.out_of_order_reports == 1
    c.seq["a"] = 4
    # The snapshot: the lost report had evicted all but the first 2 pages; r1 is open there.
    snapshot = [KVCleared(), stored(PROMPT[:4])]
    assert c.report("a", snapshot, snapshot=True, admitted=["r1"]) is False
    assert c.router.predict_hits(PROMPT) == {"a": 4}
    state = c.router.worker("a")
    assert (stats.snapshots, state.needs_snapshot, state.seq, state.num_pending) == (1, False, 5, 0)
    assert c.report("a") is False
    c.router.check()


def test_a_start_the_router_missed_asks_for_a_snapshot() -> None:
    c = Cluster("a")
    c.seq["a"] = 6  # a new router (e.g. restarted) whose first report from "a" is its 7th
    assert c.report("a", [stored(PROMPT[8:], parent=PROMPT[:8])]) is True
    assert c.router.stats.event_mismatches == 1  # under a page this router never saw
    assert c.router.stats.resyncs_requested == 1 and c.router.stats.lost_reports == 0
    assert routed(c.router.route("r1", PROMPT, 1)) == ("a", 0)  # routable meanwhile
    assert c.router.worker("a").num_pending == 1
    assert c.report("a", [KVCleared(), stored(PROMPT)], snapshot=True, admitted=["r1"]) is False
    assert c.router.predict_hits(PROMPT) == {"a": 16}
    assert c.router.worker("a").num_pending == 0
    # A restart whose first report arrives is a fresh, empty cache: nothing to ask.
    assert c.report("a", instance="i1") is False
    assert c.router.predict_hits(PROMPT) == {"a": 0} and c.router.stats.restarts == 1
    # A restart whose first reports were lost: its cache may hold pages already.
    assert c.report("a", [stored(PROMPT[:4])], instance="i2", skip=2) is True
    assert c.router.stats.restarts == 2 and c.router.predict_hits(PROMPT) == {"a": 4}
    c.router.check()


def test_workers_without_events_are_never_asked_for_a_snapshot() -> None:
    c = Cluster("a", kv_events=False)
    c.report("a")
    assert routed(c.router.route("r1", PROMPT, 1)) == ("a", 0)  # records PROMPT for a
    assert c.report("a", skip=3) is False  # a gap loses no events: the view stays
    assert c.router.predict_hits(PROMPT) == {"a": 16}
    fresh = Cluster("a", kv_events=False)
    fresh.seq["a"] = 9  # nor when a new router missed their start
    assert fresh.report("a") is False and fresh.router.stats.resyncs_requested == 0
    c.router.check()


def test_report_age_counts_from_its_receipt_on_the_routers_clock() -> None:
    c = Cluster("a", report_timeout_s=5.0)
    c.clock.now = 100.0
    c.report("a", timestamp_s=0.0)  # the worker's clock is 100 s behind: not stale
    assert c.router.worker("a").reported_at_s == 100.0
    assert routed(c.router.route("r1", PROMPT, 1)) == ("a", 0)
    c.report("a", timestamp_s=1e9)  # ... or far ahead: no effect either
    c.clock.now = 105.5
    assert c.router.route("r2", PROMPT, 1).outcome == Outcome.QUEUED  # 5.5 s since receipt


# ---- rule: approximate mode (workers without KV events) under its memory cap ----------------------


def test_cache_view_approx_tracks_routed_prompts_and_ignores_the_events() -> None:
    """`RouterConfig(cache_view="approx")` (`--router-cache-view approx`): workers added as the
    cluster adds them (no `kv_events` argument) are tracked by the prompts routed to them; what
    their reports say they stored does not count."""
    c = Cluster("a", "b", cache_view="approx")
    assert not c.router.worker("a").kv_events and not c.router.worker("b").kv_events
    c.report("a")
    c.report("b", [stored(PROMPT[:16])])  # b reports the prompt cached: ignored
    assert c.router.predict_hits(PROMPT) == {"a": 0, "b": 0}
    assert routed(c.router.route("r1", PROMPT, 1)) == ("a", 0)  # records PROMPT for a
    assert c.router.predict_hits(PROMPT) == {"a": 16, "b": 0}
    exact = Cluster("a", "b")  # the default: the events count
    exact.report("a")
    exact.report("b", [stored(PROMPT[:16])])
    assert exact.router.predict_hits(PROMPT) == {"a": 0, "b": 16}
    c.router.check()
    exact.router.check()


def test_approximate_workers_get_affinity_from_routed_prompts_under_one_cap() -> None:
    c = Cluster("a", "b", kv_events=False, approx_max_tokens=20)
    c.report("a")
    c.report("b")
    other = [90 + t for t in range(17)]
    assert routed(c.router.route("r1", PROMPT, 1)) == ("a", 0)  # records 8 pages (16 tokens)
    assert routed(c.router.route("r2", other, 1)) == ("b", 0)  # 8 more: 16 pages, cap 10
    # The cap (20 tokens, both workers together) evicted a's 6 oldest entries: its deepest pages.
    assert c.router.predict_hits(PROMPT) == {"a": 4, "b": 0}
    assert c.router.predict_hits(other) == {"a": 0, "b": 16}
    assert routed(c.router.route("r3", PROMPT, 1)) == ("a", 4)
    c.report("a", instance="i1")  # a restart drops the approximate view too
    assert c.router.predict_hits(PROMPT) == {"a": 0, "b": 0}
    c.router.check()


# ---- API edges ------------------------------------------------------------------------------------


def test_bad_requests_and_workers_raise_clear_errors() -> None:
    c = Cluster("a")
    c.report("a")
    c.router.route("r", PROMPT, 1)
    with pytest.raises(ValueError, match="already routed"):
        c.router.route("r", PROMPT, 1)
    with pytest.raises(ValueError, match="non-empty prompt"):
        c.router.route("e", [], 1)
    with pytest.raises(ValueError, match="already registered"):
        c.router.add_worker("a")
    with pytest.raises(KeyError, match="unknown worker"):
        c.router.remove_worker("zz")
    c.router.add_worker("b")
    with pytest.raises(ValueError, match="page_size=4"):
        c.report("b", page_size=4)
    with pytest.raises(ValueError, match="unknown routing policy"):
        RouterConfig(policy="random")


def test_remove_worker_forgets_its_requests_and_view() -> None:
    c = Cluster("a", "b")
    c.report("a", [stored(PROMPT)])
    c.report("b")
    assert routed(c.router.route("r", PROMPT, 1)) == ("a", 16)
    c.router.remove_worker("a")
    assert c.router.worker_ids == ["b"] and not c.router.finish("r")
    assert c.router.predict_hits(PROMPT) == {"b": 0}
    c.router.add_worker("c")  # reuses a's view bit, with an empty view
    c.report("c")
    assert c.router.predict_hits(PROMPT) == {"b": 0, "c": 0}
    c.router.check()


def test_config_defaults_and_validation() -> None:
    config = RouterConfig()
    assert (config.policy, config.prefix_load_weight) == ("ttft", 1.0)
    assert (config.report_timeout_s, config.max_queue_len, config.queue_timeout_s) == (
        5.0,
        1024,
        30.0,
    )
    assert config.approx_max_tokens == 1 << 20
    for bad in ({"prefix_load_weight": -1}, {"prefix_load_weight": None}, {"typo": 1}):
        with pytest.raises(ValueError):
            RouterConfig(**bad)  # type: ignore[arg-type]
