"""Faults and limits: a killed worker group, a killed TP rank, a request retried after its
worker died before streaming, and a router queue that is full."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest
import ray
from cluster_harness import (
    ServedCluster,
    greedy,
    reference_tokens,
    stream,
    wait_idle,
)

from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc
from swaserve.router import RouterConfig

pytestmark = pytest.mark.slow

MakeCluster = Callable[..., ServedCluster]


class StreamThread(threading.Thread):
    """One Generate call in a thread: its items, and the status code it ended with."""

    def __init__(self, served: ServedCluster, request: pb.GenerateRequest) -> None:
        super().__init__(daemon=True)
        self.served = served
        self.request = request
        self.items: list[pb.GenerateResponse] = []
        self.code: grpc.StatusCode | None = None
        self.first = threading.Event()

    def run(self) -> None:
        with self.served.channel() as channel:
            try:
                for item in pb_grpc.InferenceStub(channel).Generate(self.request, timeout=120):
                    self.items.append(item)
                    self.first.set()
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                self.code = exc.code()
            finally:
                self.first.set()

    @property
    def worker_id(self) -> str:
        return self.items[0].worker_id if self.items else ""


def wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def long_request(i: int, max_new_tokens: int = 1500) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"long-{i}",
        token_ids=[(7 * i + j) % 250 for j in range(12)],
        sampling_params=greedy(max_new_tokens, ignore_eos=True),
    )


def test_killed_worker_group_is_dropped_and_the_rest_serves_on(make_cluster: MakeCluster) -> None:
    served = make_cluster(replicas=2)
    streams = [StreamThread(served, long_request(i, 400)) for i in range(6)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(60)
    on = {s.worker_id for s in streams}
    assert on == {"worker-0", "worker-1"}, on
    victim, survivor = "worker-1", "worker-0"
    ray.kill(served.cluster.groups[victim].engine, no_restart=True)
    for s in streams:
        s.join(120)
        assert not s.is_alive()
    for s in streams:
        if s.worker_id == victim:
            assert s.code == grpc.StatusCode.UNAVAILABLE  # tokens were streamed: no retry
        else:
            assert s.code == grpc.StatusCode.OK
            assert s.items[-1].finish_reason == "length"
            assert sum(len(i.token_ids) for i in s.items) == 400
    wait_for(lambda: set(served.load()) == {survivor})
    stub = served.stub()
    for i in range(4):
        ids, _, last = stream(
            stub, pb.GenerateRequest(token_ids=[3, 4, 5, i], sampling_params=greedy(3))
        )
        assert last.worker_id == survivor and len(ids) == 3
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).num_workers == 1
    assert victim in served.cluster.lost
    assert not served.cluster.groups[victim].alive


def test_request_routed_to_a_dead_worker_before_any_token_is_retried(
    make_cluster: MakeCluster, cluster_model
) -> None:
    served = make_cluster(replicas=2)
    stub = served.stub()
    prompt = [(11 * j) % 250 for j in range(40)]
    _, _, first = stream(stub, pb.GenerateRequest(token_ids=prompt, sampling_params=greedy(4)))
    victim = first.worker_id
    wait_idle(served)
    # Hold the watcher back, so that the router still sees the dead worker as fresh and
    # routes the follow-up there (its prefix is cached there).
    served.loop.loop.call_soon_threadsafe(served.cluster._watchers[victim].cancel)
    ray.kill(served.cluster.groups[victim].engine, no_restart=True)
    follow_up = [*prompt, 1, 2, 3]
    ids, _, last = stream(stub, pb.GenerateRequest(token_ids=follow_up, sampling_params=greedy(5)))
    assert last.worker_id != victim
    assert ids == reference_tokens(cluster_model, [follow_up], [5])[0]
    assert "lost during request" in served.cluster.lost[victim]
    assert set(served.load()) == {last.worker_id}


def test_killed_tp_rank_takes_its_group_down(make_cluster: MakeCluster) -> None:
    served = make_cluster(replicas=1, tp_size=2, tp_timeout_s=10)
    running = StreamThread(served, long_request(0))
    running.start()
    assert running.first.wait(60)
    group = served.cluster.groups["worker-0"]
    ray.kill(group.rank_actors[0], no_restart=True)
    running.join(60)
    assert not running.is_alive()
    assert running.code == grpc.StatusCode.UNAVAILABLE
    wait_for(lambda: served.load() == {})
    with pytest.raises(ray.exceptions.RayActorError):  # rank 0 went down with its group
        ray.get(group.engine.num_open.remote(), timeout=30)
    with pytest.raises(grpc.RpcError) as err:
        list(served.stub().Generate(pb.GenerateRequest(token_ids=[1, 2]), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_full_router_queue_gets_resource_exhausted_with_a_retry_hint(
    make_cluster: MakeCluster,
) -> None:
    served = make_cluster(replicas=1, max_total_tokens=512, router=RouterConfig(max_queue_len=0))
    holder = StreamThread(served, long_request(0, max_new_tokens=450))
    holder.start()
    assert holder.first.wait(60)
    stub = served.stub()
    call = stub.Generate(long_request(1, max_new_tokens=450), timeout=30)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(err.value.trailing_metadata())["retry-after-s"] == "1"
    assert stub.Abort(pb.AbortRequest(request_id="long-0"), timeout=10).aborted
    holder.join(30)
    assert holder.items[-1].finish_reason == "abort"
    wait_idle(served)
    time.sleep(0.2)  # a report after the abort reaches the router
    ids, _, _ = stream(stub, long_request(2, max_new_tokens=450))
    assert len(ids) == 450  # room again: the same request now fits


def test_queued_request_waits_for_room_and_a_caller_that_leaves_the_queue_frees_its_place(
    make_cluster: MakeCluster,
) -> None:
    # The holder's output nearly fills the model's context: it holds the room until it is
    # aborted (thousands of decode steps, far past the waits below). The queued request needs
    # as much: whatever share of the holder's output the worker still reserves, the pool cannot
    # hold both, so it waits in the router's queue until the abort.
    served = make_cluster(replicas=1, max_total_tokens=4608, router=RouterConfig(max_queue_len=4))
    router = served.cluster.router

    def queue_len() -> int:
        return ray.get(router.stats.remote(), timeout=10)["queue_len"]

    holder = StreamThread(served, long_request(0, max_new_tokens=4000))
    holder.start()
    assert holder.first.wait(60)
    queued = StreamThread(served, long_request(1, max_new_tokens=4000))
    queued.start()
    wait_for(lambda: queue_len() == 1)
    with pytest.raises(grpc.RpcError) as err:
        list(served.stub().Generate(long_request(2, max_new_tokens=4000), timeout=1.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: queue_len() == 1)  # the one that left is out of the queue
    assert holder.code is None and not queued.items  # still waiting for room
    assert served.stub().Abort(pb.AbortRequest(request_id="long-0"), timeout=10).aborted
    assert queued.first.wait(120) and queued.items  # room was made: it runs
    assert queue_len() == 0
    assert served.stub().Abort(pb.AbortRequest(request_id="long-1"), timeout=10).aborted
    queued.join(120)
    assert queued.code == grpc.StatusCode.OK and queued.items[-1].finish_reason == "abort"
    ray.get(router.check.remote(), timeout=10)
