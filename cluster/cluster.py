"""Cluster: `swaserve serve`'s serving cluster on Ray — the router actor and one worker group
(Ray actors on a placement group) per replica — behind the routing of `RoutedCluster`.

Every group is watched (`WorkerGroup.watch`); a group that stops is killed, taken out of the
router and out of `load()`, and the cluster goes on with the rest. `drain()` refuses new
requests and waits (bounded) for the open ones; `shutdown()` stops every actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import ray
from pydantic import BaseModel, ConfigDict, Field
from ray.exceptions import RayActorError

from swaserve.cluster.engine_loop import GenerateChunk
from swaserve.cluster.routed import (
    ClusterBusy,
    ClusterError,
    GenerationFailed,
    InvalidRequest,
    ModelInfo,
    RoutedCluster,
    Unavailable,
    WorkerLost,
    model_info_of,
)
from swaserve.cluster.router_actor import RouterActor
from swaserve.cluster.worker_group import KILL_TIMEOUT_S, WorkerGroup
from swaserve.router import RouterConfig
from swaserve.worker import EngineConfig, SamplingParams
from swaserve.worker.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "Cluster",
    "ClusterBusy",
    "ClusterConfig",
    "ClusterError",
    "GenerationFailed",
    "InvalidRequest",
    "ModelInfo",
    "Unavailable",
]


class ClusterConfig(BaseModel):
    """Everything `swaserve serve` (and the Serve app) sets up."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig
    router: RouterConfig = Field(default_factory=RouterConfig)
    replicas: int = Field(1, ge=1, description="worker groups (each tp_size ranks)")
    served_model_name: str | None = Field(None, description="name clients use; default: dir name")
    use_gpu: bool | None = Field(None, description="GPU bundles; default: if Ray has GPUs")
    report_interval_s: float = Field(0.1, gt=0, le=1.0, description="worker → router reports")
    startup_timeout_s: float = Field(600.0, gt=0, description="placement + model load")
    retry_after_s: float = Field(1.0, gt=0, description="hint sent with RESOURCE_EXHAUSTED")


class Cluster(RoutedCluster):
    """See the module docstring. Create with `await Cluster.start(config)`; Ray must be up."""

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config.retry_after_s)
        self.config = config
        self.groups: dict[str, WorkerGroup] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}  # worker id -> its watch

    @classmethod
    async def start(cls, config: ClusterConfig) -> Cluster:
        cluster = cls(config)
        try:
            await cluster._start()
        except BaseException:
            await cluster.shutdown()
            raise
        return cluster

    async def _start(self) -> None:
        config = self.config
        engine = config.engine
        use_gpu = config.use_gpu
        if use_gpu is None:
            use_gpu = engine.device.startswith("cuda") or (
                engine.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
            )
        if engine.device == "auto":
            engine = engine.model_copy(update={"device": "cuda" if use_gpu else "cpu"})
        self.router = (
            ray.remote(RouterActor).options(num_cpus=0, max_restarts=0).remote(config.router)
        )
        for i in range(config.replicas):
            worker_id = f"worker-{i}"
            self.groups[worker_id] = WorkerGroup(
                worker_id,
                engine,
                router=self.router,
                use_gpu=use_gpu,
                report_interval_s=config.report_interval_s,
            )
        infos = await asyncio.gather(
            *(g.start(config.startup_timeout_s) for g in self.groups.values())
        )
        for group in self.groups.values():
            await self.router.add_worker.remote(group.worker_id)
            self._watchers[group.worker_id] = asyncio.create_task(self._watch(group))
        self.model_info = model_info_of(engine, infos[0], config.served_model_name)
        self.tokenizer = load_tokenizer(engine.model, engine.tokenizer)
        await self._wait_reported()

    async def _wait_reported(self, timeout_s: float = 30.0) -> None:
        """Until every worker's first report reached the router (so the first request routes)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            statuses = await self.router.workers.remote()
            if all(s.headroom is not None for s in statuses):
                return
            await asyncio.sleep(0.02)
        raise TimeoutError("the workers' first reports did not reach the router")

    async def _watch(self, group: WorkerGroup) -> None:
        error = await group.watch()
        if not self._closing:
            self._lose(group.worker_id, f"stopped serving: {error}")

    # ---- the workers: Ray actor groups -----------------------------------------------------
    def _lose(self, worker_id: str, why: str) -> None:
        """Take a lost group out: kill its actors, remove it from the router."""
        group = self.groups[worker_id]
        if not group.alive:
            return
        logger.error("worker %s lost (%s); serving on the others", worker_id, why)
        self.lost[worker_id] = why
        group.kill()
        self.router.remove_worker.remote(worker_id)

    def _worker_alive(self, worker_id: str) -> bool:
        group = self.groups.get(worker_id)
        return group is not None and group.alive

    @property
    def live_workers(self) -> list[str]:
        return [w for w, g in self.groups.items() if g.alive]

    async def _stream(
        self, worker_id: str, request_id: str, token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerateChunk | Exception]:
        stream = self.groups[worker_id].engine.generate.remote(request_id, token_ids, params)
        try:
            async for ref in stream:
                yield await ref
        except RayActorError as exc:
            raise WorkerLost(str(exc)) from exc

    def _abort_on(self, worker_id: str, request_id: str) -> None:
        self.groups[worker_id].engine.abort.remote(request_id)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop every worker group and the router actor (open streams end with "abort");
        each group gets `timeout_s` to stop cleanly before it is killed."""
        self._closing = True
        for task in self._watchers.values():
            task.cancel()
        await asyncio.gather(
            *(g.shutdown(timeout_s) for g in self.groups.values()), return_exceptions=True
        )
        if self.router is not None:
            router, self.router = self.router, None
            try:
                await asyncio.wait_for(
                    asyncio.to_thread(ray.kill, router, no_restart=True), KILL_TIMEOUT_S
                )
            except Exception:
                logger.warning("the router actor did not stop cleanly", exc_info=True)
