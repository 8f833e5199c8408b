"""One local Ray per test session, and the clusters the tests share."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import WINDOW, LoopThread, ServedCluster, running_cluster, serve_cluster

RAY_NUM_CPUS = 8


@pytest.fixture(scope="session")
def ray_session() -> Iterator[str]:
    """The session's local Ray (logical CPUs, so that several actors fit on 2 cores);
    yields its address for processes that join it."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts its workers at nice 15: beside one busy process at nice 0 a worker gets a
    # few percent of a core, a model load takes minutes, and Serve's own start-up checks fail
    # (it kills a proxy not ready in 5 s). The tests' workers compete on equal terms instead;
    # what is slow then is the load, not a priority. Processes that join this Ray (the
    # `swaserve serve` subprocesses) and a local Ray the tests start inherit both settings.
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
    ray.init(
        address="local",  # a Ray of its own, never another one running on the machine
        num_cpus=RAY_NUM_CPUS,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def cluster_model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="gpt-oss", num_layers=4, sliding_window_size=WINDOW)


@pytest.fixture
def make_cluster(ray_session: str, cluster_model: Path) -> Iterator[Callable[..., ServedCluster]]:
    """`make_cluster(replicas=..., tp_size=..., ...)`: a cluster stopped after the test."""
    made: list[tuple[LoopThread, ServedCluster]] = []

    def make(**options: Any) -> ServedCluster:
        made.append(serve_cluster(options.pop("model", cluster_model), **options))
        return made[-1][1]

    yield make
    for loop, served in made:
        try:
            served.stop()
        finally:
            loop.close()


@pytest.fixture(scope="module")
def two_workers(ray_session: str, cluster_model: Path) -> Iterator[ServedCluster]:
    """2 replicas × TP 1, shared by a module's tests (they must leave it idle)."""
    yield from running_cluster(cluster_model, replicas=2)
