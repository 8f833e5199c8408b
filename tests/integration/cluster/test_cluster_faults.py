"""Faults and limits: a killed worker process (its streams migrate, its group is recreated), a
killed TP rank, a killed router actor (restarted; it rebuilds its view), a request retried
after its worker died before streaming, and a router queue that is full. After each fault,
nothing is lost: every stream gives exactly the tokens of an undisturbed run, and the
survivors' `check()` passes."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import ray
from cluster_harness import (
    STARTUP_TIMEOUT_S,
    ServedCluster,
    greedy,
    reference_tokens,
    stopped,
    stream,
    wait_idle,
    worker_pids,
)

from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc
from swaserve.router import RouterConfig
from swaserve.worker import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.slow

MakeCluster = Callable[..., ServedCluster]


class StreamThread(threading.Thread):
    """One Generate call in a thread: its items, and the status code it ended with. Its
    deadline bounds a wait for a recreated group too (`STARTUP_TIMEOUT_S`)."""

    def __init__(self, served: ServedCluster, request: pb.GenerateRequest) -> None:
        super().__init__(daemon=True)
        self.served = served
        self.request = request
        self.items: list[pb.GenerateResponse] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""  # the error's message, when it ended with one
        self.first = threading.Event()

    def run(self) -> None:
        with self.served.channel() as channel:
            try:
                for item in pb_grpc.InferenceStub(channel).Generate(
                    self.request, timeout=STARTUP_TIMEOUT_S
                ):
                    self.items.append(item)
                    self.first.set()
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                self.code, self.details = exc.code(), exc.details() or ""
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


def undisturbed(model: Path, requests: list[pb.GenerateRequest]) -> list[list[int]]:
    """The tokens each request (greedy or seeded) gets from one in-process engine."""
    engine = Engine(EngineConfig(model=str(model), device="cpu", max_total_tokens=4096))
    try:
        params = [
            SamplingParams(
                max_new_tokens=r.sampling_params.max_new_tokens,
                temperature=r.sampling_params.temperature,
                seed=r.sampling_params.seed if r.sampling_params.HasField("seed") else None,
                ignore_eos=True,
            )
            for r in requests
        ]
        return [o.token_ids for o in engine.generate([list(r.token_ids) for r in requests], params)]
    finally:
        engine.shutdown()


def started(served: ServedCluster, requests: list[pb.GenerateRequest]) -> list[StreamThread]:
    """One stream per request, each past its first item."""
    streams = [StreamThread(served, r) for r in requests]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(120)
    return streams


def sigkill(actor: object) -> None:
    """SIGKILL the actor's process, as an operator or the OOM killer would."""
    os.kill(ray.get(actor.pid.remote(), timeout=30), signal.SIGKILL)  # type: ignore[attr-defined]


def assert_nothing_lost(streams: list[StreamThread], expected: list[list[int]]) -> None:
    for s, want in zip(streams, expected, strict=True):
        s.join(STARTUP_TIMEOUT_S + 60)
        assert not s.is_alive()
        assert s.code == grpc.StatusCode.OK, (s.request.request_id, s.details)
        assert [t for item in s.items for t in item.token_ids] == want, s.request.request_id
        last = s.items[-1]
        assert last.finish_reason == "length"
        assert last.usage.completion_tokens == len(want)
        assert last.usage.prompt_tokens == len(s.request.token_ids)


def check_survivors(served: ServedCluster) -> None:
    """Every live worker's engine and the router pass their invariant checks."""
    cluster = served.cluster
    for worker_id in cluster.live_workers:
        ray.get(cluster.groups[worker_id].engine.check.remote(), timeout=60)
    ray.get(cluster.router.check.remote(), timeout=30)


def test_killed_worker_process_streams_migrate_and_the_group_comes_back(
    make_cluster: MakeCluster, cluster_model: Path
) -> None:
    served = make_cluster(replicas=2)
    requests = [long_request(i, 300) for i in range(6)]
    for i, r in enumerate(requests[::2]):  # half of them sample, seeded: exact on the move too
        r.sampling_params.temperature = 0.9
        r.sampling_params.seed = 100 + i
    expected = undisturbed(cluster_model, requests)
    streams = started(served, requests)
    on = {s.worker_id for s in streams}
    assert on == {"worker-0", "worker-1"}, on
    victim = "worker-1"
    moved = [s for s in streams if s.worker_id == victim]
    (pid,) = worker_pids(served, [victim])
    with stopped([pid]):  # its streams cannot end before it dies
        assert all(s.code is None for s in moved)
        os.kill(pid, signal.SIGKILL)
    assert_nothing_lost(streams, expected)
    assert all({i.worker_id for i in s.items} == {victim, "worker-0"} for s in moved)
    assert served.cluster.migrations >= 1
    wait_for(lambda: set(served.load()) == {"worker-0", "worker-1-r1"}, STARTUP_TIMEOUT_S)
    assert victim in served.cluster.lost and not served.cluster.groups[victim].alive
    assert served.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10).num_workers == 2
    again = started(served, [long_request(10 + i, 100) for i in range(4)])
    assert_nothing_lost(again, undisturbed(cluster_model, [s.request for s in again]))
    assert "worker-1-r1" in {s.worker_id for s in again}  # the recreated group takes requests
    check_survivors(served)


def test_request_routed_to_a_dead_worker_before_any_token_is_retried(
    make_cluster: MakeCluster, cluster_model
) -> None:
    # The dead worker stays fresh in the router's view however long the follow-up takes.
    served = make_cluster(replicas=2, router=RouterConfig(report_timeout_s=STARTUP_TIMEOUT_S))
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
    load = set(served.load())
    assert last.worker_id in load and victim not in load


def test_killed_tp_rank_takes_its_group_down_and_the_stream_waits_for_its_return(
    make_cluster: MakeCluster, cluster_model: Path
) -> None:
    served = make_cluster(replicas=1, tp_size=2, tp_timeout_s=10)
    request = long_request(0, 200)
    expected = undisturbed(cluster_model, [request])
    (running,) = started(served, [request])
    group = served.cluster.groups["worker-0"]
    rank_1 = ray.get(group.rank_actors[0].pid.remote(), timeout=30)
    with stopped(worker_pids(served)):  # rank 0 takes no step before rank 1 is gone
        assert running.code is None
        os.kill(rank_1, signal.SIGKILL)
    # No other worker: the stream waits for the recreated group and continues there.
    assert_nothing_lost([running], expected)
    assert {i.worker_id for i in running.items} == {"worker-0", "worker-0-r1"}
    with pytest.raises(ray.exceptions.RayActorError):  # rank 0 went down with its group
        ray.get(group.engine.num_open.remote(), timeout=30)
    wait_for(lambda: set(served.load()) == {"worker-0-r1"}, STARTUP_TIMEOUT_S)
    assert served.cluster.groups["worker-0-r1"].info.model.tp_size == 2
    check_survivors(served)


def test_killed_router_actor_is_restarted_and_rebuilds_its_view(
    make_cluster: MakeCluster, cluster_model: Path
) -> None:
    served = make_cluster(replicas=2)
    stub = served.stub()
    prompt = [(13 * j) % 250 for j in range(48)]
    _, _, first = stream(stub, pb.GenerateRequest(token_ids=prompt, sampling_params=greedy(4)))
    holder = first.worker_id
    requests = [long_request(i, 200) for i in range(4)]
    expected = undisturbed(cluster_model, requests)
    streams = started(served, requests)
    router = served.cluster.router
    old_pid = ray.get(router.pid.remote(), timeout=10)
    sigkill(router)
    assert_nothing_lost(streams, expected)  # streams do not need the router once placed
    # The restarted router knows both workers again from their reports ...
    wait_for(lambda: set(served.load()) == {"worker-0", "worker-1"}, STARTUP_TIMEOUT_S)
    assert ray.get(router.pid.remote(), timeout=10) != old_pid  # a new instance
    # ... and their caches, from the snapshots they sent when it asked: the follow-up goes
    # where its prefix is cached.
    wait_for(lambda: ray.get(router.predict_hits.remote(prompt), timeout=10).get(holder, 0) > 0)
    follow_up = [*prompt, 9, 9]
    _, _, last = stream(stub, pb.GenerateRequest(token_ids=follow_up, sampling_params=greedy(2)))
    assert last.worker_id == holder and last.cached_tokens > 0
    check_survivors(served)


def test_full_router_queue_gets_resource_exhausted_with_a_retry_hint(
    make_cluster: MakeCluster,
) -> None:
    served = make_cluster(replicas=1, max_total_tokens=512, router=RouterConfig(max_queue_len=0))
    holder = StreamThread(served, long_request(0, max_new_tokens=450))
    holder.start()
    assert holder.first.wait(120)
    stub = served.stub()
    with stopped(worker_pids(served)):  # the holder holds its room throughout
        call = stub.Generate(long_request(1, max_new_tokens=450), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(err.value.trailing_metadata())["retry-after-s"] == "1"
        assert stub.Abort(pb.AbortRequest(request_id="long-0"), timeout=10).aborted
    holder.join(60)
    assert holder.items[-1].finish_reason == "abort"
    wait_idle(served)
    ids, _, _ = stream(stub, long_request(2, max_new_tokens=450))
    assert len(ids) == 450  # room again: the same request now fits


def test_queued_request_waits_for_room_and_a_caller_that_leaves_the_queue_frees_its_place(
    make_cluster: MakeCluster,
) -> None:
    # The holder's output nearly fills the model's context, and its worker stands still until
    # the holder is aborted, so it holds the room until then. The queued request needs as
    # much: whatever share of the holder's output the worker still reserves, the pool cannot
    # hold both, so it waits in the router's queue until the abort.
    served = make_cluster(replicas=1, max_total_tokens=4608, router=RouterConfig(max_queue_len=4))
    router = served.cluster.router

    def queue_len() -> int:
        return ray.get(router.stats.remote(), timeout=10)["queue_len"]

    holder = StreamThread(served, long_request(0, max_new_tokens=4000))
    holder.start()
    assert holder.first.wait(120)
    queued = StreamThread(served, long_request(1, max_new_tokens=4000))
    with stopped(worker_pids(served)):
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
