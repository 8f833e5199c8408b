"""Clusters and their gRPC servers on an event loop in a background thread, so that tests
talk to them with the stock, synchronous gRPC clients."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc

from swaserve.cluster.cluster import Cluster, ClusterConfig
from swaserve.cluster.grpc_server import GrpcServer, GrpcServerConfig
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc
from swaserve.router import RouterConfig
from swaserve.worker import EngineConfig

T = TypeVar("T")

WINDOW = 8  # W of the test model: small, so that SWA freeing and the window rule matter
MAX_TOTAL_TOKENS = 2048


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
