"""The metrics registry: request histograms and the per-worker snapshot, in Prometheus text."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from swaserve.cluster.metrics import ServingMetrics, tombstoned_tokens
from swaserve.cluster.routed import TTFTBreakdown
from swaserve.cluster.router_actor import WorkerStatus
from swaserve.proto.messages import Headroom
from swaserve.proto.stream import RequestTimings

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
    window_repair_tokens_total=64,
    prefill_tokens_total=2560,
    prefill_s_total=0.5,
    spec_verifies_total=30,
    spec_draft_tokens_total=90,
    spec_accepted_tokens_total=45,
    spec_method="mtp",
)


class Snapshot:
    """What `render` reads from a cluster: the router's view of the workers and its stats,
    and the cluster's fault counters."""

    migrations = 5
    recreated = 2

    async def load(self) -> list[WorkerStatus]:
        return [WorkerStatus("worker-0", HEADROOM, 0.05, 4)]

    async def router_stats(self) -> dict:
        return {"decisions": {"prefix/routed": 7, "prefix/overloaded": 2}, "queue_len": 1}


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def test_snapshot_and_histograms_render_with_their_labels() -> None:
    metrics = ServingMetrics("tiny")
    timer = metrics.tracker(arrival_s=10.0)
    timer.tokens(1, "worker-0", now_s=10.25)
    timer.tokens(2, "worker-0", now_s=10.45)  # two tokens 0.1 s apart
    timer.finish(now_s=10.5)
    got = samples(asyncio.run(metrics.render(Snapshot())))
    w = (("model_name", "tiny"), ("worker", "worker-0"))
    assert got["swaserve:num_requests_running", w] == 3
    assert got["swaserve:num_requests_waiting", w] == 1
    assert got["swaserve:token_usage", w] == 1 - 750 / 1000
    assert got["swaserve:swa_token_usage", w] == 1 - 720 / 800
    assert got["swaserve:swa_tombstoned_tokens", w] == (150 + 50) - (20 + 30)
    assert got["swaserve:prefix_cache_queries_total", w] == 400
    assert got["swaserve:prefix_cache_hits_total", w] == 120
    assert got["swaserve:window_repair_tokens_total", w] == 64
    assert got["swaserve:prefill_tokens_total", w] == 2560
    assert got["swaserve:prefill_seconds_total", w] == 0.5
    drafter = tuple(sorted((*w, ("method", "mtp"))))  # the worker's drafter labels them
    assert got["swaserve:spec_decode_num_drafts_total", drafter] == 30
    assert got["swaserve:spec_decode_num_draft_tokens_total", drafter] == 90
    assert got["swaserve:spec_decode_num_accepted_tokens_total", drafter] == 45
    routed = (("model_name", "tiny"), ("outcome", "routed"), ("policy", "prefix"))
    assert got["swaserve:router_decisions_total", routed] == 7
    assert got["swaserve:router_queue_len", (("model_name", "tiny"),)] == 1
    assert got["swaserve:request_migrations_total", (("model_name", "tiny"),)] == 5
    assert got["swaserve:worker_groups_recreated_total", (("model_name", "tiny"),)] == 2
    assert got["swaserve:time_to_first_token_seconds_count", w] == 1
    assert got["swaserve:time_to_first_token_seconds_sum", w] == 0.25
    assert got["swaserve:inter_token_latency_seconds_count", w] == 2
    assert abs(got["swaserve:inter_token_latency_seconds_sum", w] - 0.2) < 1e-9
    assert got["swaserve:e2e_request_latency_seconds_sum", w] == 0.5


def test_every_token_after_the_first_is_one_inter_token_sample() -> None:
    """However the stream merged them: 3 tokens, the first two in one chunk, give 2 samples."""
    metrics = ServingMetrics("tiny")
    timer = metrics.tracker(arrival_s=10.0)
    timer.tokens(2, "worker-0", now_s=10.25)  # the first token and the second, merged
    timer.tokens(1, "worker-0", now_s=10.45)
    timer.finish(now_s=10.5)
    got = samples(asyncio.run(metrics.render(Snapshot())))
    w = (("model_name", "tiny"), ("worker", "worker-0"))
    assert got["swaserve:time_to_first_token_seconds_count", w] == 1
    assert got["swaserve:time_to_first_token_seconds_sum", w] == 0.25
    assert got["swaserve:inter_token_latency_seconds_count", w] == 2
    assert abs(got["swaserve:inter_token_latency_seconds_sum", w] - 0.2) < 1e-9


def test_a_first_tokens_parts_go_to_their_histograms_by_worker() -> None:
    """`watch` hooks a cluster's breakdowns (twice: once); a worker that sent no timings gives
    the route only."""

    class Cluster:
        on_ttft_breakdown = None

    metrics, cluster = ServingMetrics("tiny"), Cluster()
    metrics.watch(cluster)  # type: ignore[arg-type]  # the hook is all it sets
    metrics.watch(cluster)  # type: ignore[arg-type]  # a second ingress: the same hook
    assert cluster.on_ttft_breakdown is not None
    timings = RequestTimings(0.02, 0.25, "", 1, 0, 16, loop_wait_s=0.01)
    cluster.on_ttft_breakdown(TTFTBreakdown("r1", "worker-0", 0.005, 8, timings, 0.3))
    cluster.on_ttft_breakdown(TTFTBreakdown("r2", "worker-1", 0.004, 0, None, 0.1))
    got = samples(asyncio.run(metrics.render(Snapshot())))
    w0 = (("model_name", "tiny"), ("worker", "worker-0"))
    w1 = (("model_name", "tiny"), ("worker", "worker-1"))
    assert got["swaserve:request_route_time_seconds_sum", w0] == 0.005
    assert got["swaserve:request_route_time_seconds_sum", w1] == 0.004
    assert got["swaserve:request_queue_time_seconds_sum", w0] == 0.02
    assert got["swaserve:request_prefill_time_seconds_sum", w0] == 0.25
    assert abs(got["swaserve:request_transport_time_seconds_sum", w0] - 0.025) < 1e-9
    for part in ("queue", "prefill", "transport"):
        assert ("swaserve:request_" + part + "_time_seconds_count", w1) not in got


def test_single_pool_workers_have_no_tombstones() -> None:
    from dataclasses import replace

    assert tombstoned_tokens(replace(HEADROOM, hybrid=False)) == 0
    assert tombstoned_tokens(HEADROOM) == 150
