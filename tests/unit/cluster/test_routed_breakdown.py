"""`RoutedCluster.breakdowns`: one record per request, at its first token, of where its time to
first token went (the router's answer, then the worker's own `RequestTimings`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from routed_fakes import FakeCluster

from swaserve.cluster.metrics import ServingMetrics
from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.sampling_params import SamplingParams
from swaserve.proto.stream import GenerateChunk, RequestTimings

TIMINGS = RequestTimings(
    queued_s=0.5,
    prefill_s=0.25,
    held_by="full",
    prefill_steps=2,
    step_decodes=3,
    step_prefill_tokens=40,
)


class TimedCluster(FakeCluster):
    """Workers that say where their time went, on the first token's chunk, as an engine does."""

    async def _stream(
        self, worker_id: str, request: EngineRequest
    ) -> AsyncIterator[GenerateChunk | Exception]:
        first = True
        async for item in super()._stream(worker_id, request):
            if isinstance(item, GenerateChunk) and item.token_ids and first:
                item.timings, first = TIMINGS, False
            yield item


def run(cluster: FakeCluster, *request_ids: str) -> None:
    params = SamplingParams(max_new_tokens=3, temperature=0.0)

    async def go() -> None:
        for request_id in request_ids:
            async for _ in cluster.generate(request_id, [5, 6, 7], params):
                pass

    asyncio.run(go())


def test_one_breakdown_per_request_with_the_workers_timings(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model_dir = tiny_model_factory(arch="gpt-oss", num_layers=2, sliding_window_size=4)
    cluster = TimedCluster(model_dir, None, ["w0"])
    run(cluster, "a", "b")
    assert [b.request_id for b in cluster.breakdowns] == ["a", "b"]
    assert all(b.worker_id == "w0" and b.worker == TIMINGS for b in cluster.breakdowns)
    assert all(b.route_s >= 0 and b.cached_tokens == 0 for b in cluster.breakdowns)
    for b in cluster.breakdowns:  # the rest of the first token's time is the way there and back
        assert b.first_token_s >= b.route_s
        assert b.transport_s == b.first_token_s - b.route_s - TIMINGS.queued_s - TIMINGS.prefill_s
    plain = FakeCluster(model_dir, None, ["w0"])  # a worker that sends no timings
    run(plain, "c")
    [only] = plain.breakdowns
    assert (only.request_id, only.worker, only.transport_s) == ("c", None, None)


def watched(
    kind: type[TimedCluster], tiny_model_factory: Callable[..., Path], *request_ids: str
) -> tuple[TimedCluster, ServingMetrics]:
    """A `kind` cluster of one worker ("w0") watched by a registry, after `request_ids` ran."""
    model_dir = tiny_model_factory(arch="gpt-oss", num_layers=2, sliding_window_size=4)
    cluster = kind(model_dir, None, ["w0"])
    metrics = ServingMetrics("tiny")
    metrics.watch(cluster)
    run(cluster, *request_ids)
    return cluster, metrics


def test_an_ingress_metrics_get_every_breakdown_as_it_is_taken(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """`ServingMetrics.watch`: each breakdown reaches the parts histograms, by its worker."""
    cluster, metrics = watched(TimedCluster, tiny_model_factory, "a", "b")
    labels = {"model_name": "tiny", "worker": "w0"}
    registry = metrics.registry
    for part, each in (("route", None), ("queue", 0.5), ("prefill", 0.25), ("transport", None)):
        name = f"swaserve:request_{part}_time_seconds"
        assert registry.get_sample_value(f"{name}_count", labels) == 2, part
        if each is not None:
            assert registry.get_sample_value(f"{name}_sum", labels) == 2 * each, part
    route = registry.get_sample_value("swaserve:request_route_time_seconds_sum", labels)
    assert route == sum(b.route_s for b in cluster.breakdowns)
    # the fake's timings are longer than its requests took: a negative rest counts as 0
    transport = registry.get_sample_value("swaserve:request_transport_time_seconds_sum", labels)
    assert transport == sum(max(0.0, b.transport_s or 0.0) for b in cluster.breakdowns) == 0.0


class AnyReplicaCluster(TimedCluster):
    """As under the Serve app's own routing: the route names no worker ("*"), and the replica
    that took the request names itself on its chunks."""

    async def _route(self, *args: Any, **kwargs: Any) -> str:
        await super()._route(*args, **kwargs)
        return "*"

    async def _stream(
        self, worker_id: str, request: EngineRequest
    ) -> AsyncIterator[GenerateChunk | Exception]:
        async for item in super()._stream("w0", request):
            if isinstance(item, GenerateChunk) and item.token_ids:
                item.worker_id = "replica-7"
            yield item


def test_a_breakdown_names_the_worker_that_served_the_request(
    tiny_model_factory: Callable[..., Path],
) -> None:
    cluster, metrics = watched(AnyReplicaCluster, tiny_model_factory, "a")
    assert [b.worker_id for b in cluster.breakdowns] == ["replica-7"]
    served = {"model_name": "tiny", "worker": "replica-7"}
    assert metrics.registry.get_sample_value("swaserve:request_prefill_time_seconds_count", served)
