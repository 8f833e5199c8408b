"""Clusters and their gRPC servers on an event loop in a background thread, so that tests
talk to them with the stock, synchronous gRPC clients."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Coroutine, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import openai
import ray

from swaserve.cluster.cluster import Cluster, ClusterConfig
from swaserve.cluster.grpc_server import GrpcServer, GrpcServerConfig
from swaserve.cluster.http_server import HttpServer
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc
from swaserve.proto.text.tokenizer import TextTokenizer
from swaserve.router import RouterConfig
from swaserve.router.policies import BALANCE_FREE_SHARE
from swaserve.worker import Engine, EngineConfig, SamplingParams

T = TypeVar("T")

WINDOW = 8  # W of the test model: small, so that SWA freeing and the window rule matter
MAX_TOTAL_TOKENS = 2048
# A bound on waits for what takes new Ray worker processes (a cluster, a recreated group, a
# `swaserve serve` subprocess): their start and model load, minutes on a loaded machine. A
# bound, not a wait: every such wait ends on the state it waits for.
STARTUP_TIMEOUT_S = 600.0


class LoopThread:
    """An asyncio loop in a daemon thread; `run(coro)` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 300.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class ServedCluster:
    """A started `Cluster` and one or more gRPC servers in front of it."""

    def __init__(self, loop: LoopThread, cluster: Cluster, server: GrpcServer) -> None:
        self.loop = loop
        self.cluster = cluster
        self.servers = [server]

    @property
    def port(self) -> int:
        assert self.servers[0].port is not None
        return self.servers[0].port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def add_server(self, config: GrpcServerConfig) -> GrpcServer:
        server = GrpcServer(self.cluster, config)
        self.loop.run(server.start())
        self.servers.append(server)
        return server

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stub(self) -> pb_grpc.InferenceStub:
        return pb_grpc.InferenceStub(self.channel())

    def load(self) -> dict[str, pb.WorkerLoad]:
        with self.channel() as channel:
            reply = pb_grpc.InferenceStub(channel).GetLoad(pb.GetLoadRequest(), timeout=10)
        return {w.worker_id: w for w in reply.workers}

    def stop(self) -> None:
        try:
            for server in self.servers:
                self.loop.run(server.stop(0))
        finally:
            self.loop.run(self.cluster.shutdown(timeout_s=10))


def running_cluster(model: Path, **options: Any) -> Iterator[ServedCluster]:
    """A module fixture's body: `serve_cluster(model, **options)`, stopped after."""
    loop, served = serve_cluster(model, **options)
    try:
        yield served
    finally:
        try:
            served.stop()
        finally:
            loop.close()


def openai_client(served: ServedCluster) -> Iterator[openai.OpenAI]:
    """A module fixture's body: the OpenAI HTTP API on `served`'s cluster (a free port) and a
    stock client of it; the server is stopped after."""
    server = HttpServer(served.cluster, port=0)
    served.loop.run(server.start())
    try:
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=120,
        )
    finally:
        served.loop.run(server.stop())


def model_name_of(served: ServedCluster) -> str:
    assert served.cluster.model_info is not None
    return served.cluster.model_info.model_name


def serve_cluster(
    model: Path,
    *,
    replicas: int = 1,
    tp_size: int = 1,
    router: RouterConfig | None = None,
    grpc_config: GrpcServerConfig | None = None,
    **engine: Any,
) -> tuple[LoopThread, ServedCluster]:
    """Start a cluster on the session's Ray and a gRPC server on a free port."""
    engine.setdefault("max_total_tokens", MAX_TOTAL_TOKENS)
    config = ClusterConfig(
        engine=EngineConfig(model=str(model), device="cpu", tp_size=tp_size, **engine),
        router=router or RouterConfig(),
        replicas=replicas,
        report_interval_s=0.05,
    )
    loop = LoopThread()
    try:
        cluster = loop.run(Cluster.start(config))
    except BaseException:
        loop.close()
        raise
    server = GrpcServer(cluster, grpc_config or GrpcServerConfig(port=0))
    served = ServedCluster(loop, cluster, server)
    try:
        loop.run(server.start())
    except BaseException:
        served.stop()
        loop.close()
        raise
    return loop, served


def stream(
    stub: pb_grpc.InferenceStub, request: pb.GenerateRequest, timeout_s: float = 60.0
) -> tuple[list[int], str, pb.GenerateResponse]:
    """All token ids, the joined text and the last item of one Generate stream."""
    ids: list[int] = []
    text = ""
    last = None
    for item in stub.Generate(request, timeout=timeout_s):
        ids.extend(item.token_ids)
        text += item.text
        last = item
    assert last is not None
    return ids, text, last


def greedy(max_new_tokens: int, **more: object) -> pb.SamplingParams:
    return pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **more)


def shared_prefix_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts in 5 families: a 40-token family prefix, then 3-12 tokens of their own."""
    rng = random.Random(seed)
    families = [[rng.randrange(256) for _ in range(40)] for _ in range(5)]
    return [
        families[i % 5] + [rng.randrange(256) for _ in range(rng.randint(3, 12))] for i in range(n)
    ]


def reference_tokens(model: Path, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(model), device="cpu", max_total_tokens=MAX_TOTAL_TOKENS))
    try:
        params = [SamplingParams(max_new_tokens=m, temperature=0.0) for m in max_new]
        return [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        engine.shutdown()


def wait_idle(served: ServedCluster, timeout_s: float = 60.0) -> dict[str, pb.WorkerLoad]:
    """GetLoad once the router has seen every worker report no running or waiting request,
    holds no request of its own on any of them, and holds each worker's latest report (its
    view is what the next route admits by; an idle report from before the last request
    would look the same but for its counters)."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = served.load()
        idle = all(w.num_running == 0 and w.num_waiting == 0 for w in load.values())
        if idle and _router_holds_latest_idle_reports(served):
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"workers still busy: {load}")
        time.sleep(0.05)


def wait_idle_for_reuse(served: ServedCluster) -> dict[str, pb.WorkerLoad]:
    """`wait_idle`, and no worker's full pool under pressure: there the `ttft` policy keeps a
    session's next turn on the worker that caches its history. Under pressure it may move a
    short history to the freest worker (`policies.BALANCE_FREE_SHARE`), so a test that counts
    a turn's cached tokens runs while the pools are mostly free (early in its module)."""
    load = wait_idle(served)
    for worker_id, w in load.items():
        free = w.full_free_tokens / w.full_total_tokens
        assert free >= BALANCE_FREE_SHARE, (
            f"worker {worker_id} is {1 - free:.0%} full: routing weighs free KV there; "
            "count cached tokens before the module's other tests fill the pools"
        )
    return load


def _router_holds_latest_idle_reports(served: ServedCluster) -> bool:
    statuses = served.loop.run(served.cluster.load())
    for status in statuses:
        latest = ray.get(served.cluster.groups[status.worker_id].engine.report.remote(), timeout=60)
        if status.load != 0 or latest is None or status.headroom != latest.headroom:
            return False
    return True


def worker_pids(served: ServedCluster, worker_ids: Iterable[str] = ()) -> list[int]:
    """The rank-0 processes of the given workers (default: every live one)."""
    engines = [served.cluster.groups[w].engine for w in worker_ids or served.cluster.live_workers]
    return [ray.get(engine.pid.remote(), timeout=60) for engine in engines]


@contextlib.contextmanager
def stopped(pids: Iterable[int]) -> Iterator[None]:
    """Inside the block the processes stand still (SIGSTOP; SIGCONT after): a worker stopped
    so streams no token and ends no request, so the test acts on requests that are surely
    still open, however fast or slow the machine. Calls to it wait; its reports pause.
    Entered once every thread of every process has stopped."""
    pids = list(pids)
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while not all(_all_threads_stopped(pid) for pid in pids):
            assert time.monotonic() < deadline, f"processes {pids} did not stop"
            time.sleep(0.01)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped (state T in /proc), or the process is gone."""
    for path in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            state = path.read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # that thread ended meanwhile
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def run_concurrent_streams(served: ServedCluster, cluster_model: Path, n: int = 50) -> set[str]:
    """`n` concurrent greedy streams with shared prefixes; each must give exactly the tokens of
    an in-process engine, and its text deltas must join to the decode of its tokens."""
    prompts = shared_prefix_prompts(n)
    max_new = [4 + i % 5 for i in range(n)]
    expected = reference_tokens(cluster_model, prompts, max_new)
    tokenizer = TextTokenizer(cluster_model)
    with served.channel() as channel:
        stub = pb_grpc.InferenceStub(channel)

        def one(i: int) -> tuple[list[int], str, pb.GenerateResponse]:
            request = pb.GenerateRequest(
                request_id=f"c{i}", token_ids=prompts[i], sampling_params=greedy(max_new[i])
            )
            return stream(stub, request)

        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(one, range(n)))
    for i, (ids, text, last) in enumerate(results):
        assert ids == expected[i], f"request {i}"
        assert text == tokenizer.decode(ids)
        assert last.finish_reason in ("length", "stop")
        assert last.usage.prompt_tokens == len(prompts[i])
        assert last.usage.completion_tokens == len(ids)
    return {last.worker_id for _, _, last in results}


def kv_in_use(load: dict[str, pb.WorkerLoad]) -> dict[str, tuple[int, int]]:
    """Per worker, the full and SWA tokens neither free nor evictable (held by requests)."""
    return {
        w.worker_id: (
            w.full_total_tokens - w.full_free_tokens - w.full_evictable_tokens,
            w.swa_total_tokens - w.swa_free_tokens - w.swa_evictable_tokens,
        )
        for w in load.values()
    }
