"""Cluster: `swaserve serve`'s serving cluster on Ray — the router actor and one worker group
(Ray actors on a placement group) per replica — behind the routing of `RoutedCluster`.

Every group is watched (`WorkerGroup.watch`). A group that stops (its rank-0 process, or any
TP rank) is killed and taken out of the router and out of `load()`; its open requests migrate
to the other groups (`RoutedCluster`), and the cluster recreates the replica — a new placement
group of the same TP size, with backoff — which rejoins the router under a new worker id
(`worker-<i>-r<n>`). A request that finds no worker while a replica is being recreated waits
for it (bounded by its deadline). The router actor is supervised by Ray (restarted on death);
a restarted router rebuilds its view from the workers' reports (each worker sends a snapshot
of its cache when the router asks for one), and calls that met its death are retried.
`drain()` refuses new requests and waits (bounded) for the open ones; `shutdown()` stops
every actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import ray
from pydantic import BaseModel, ConfigDict, Field
from ray.exceptions import RayActorError

from swaserve.cluster.ingress_limits import IngressLimits
from swaserve.cluster.model_info import model_info_of
from swaserve.cluster.routed import (
    ClusterBusy,
    ClusterError,
    GenerationFailed,
    InvalidRequest,
    ModelInfo,
    RoutedCluster,
    Unavailable,
    WorkerLost,
)
from swaserve.cluster.router_actor import RouterActor
from swaserve.cluster.worker_group import KILL_TIMEOUT_S, WorkerGroup
from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.stream import GenerateChunk
from swaserve.proto.text.tokenizer import load_tokenizer
from swaserve.router import RouterConfig
from swaserve.worker.config import EngineConfig

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0

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
    max_attempts: int = Field(
        3, ge=1, description="workers a request may try (a lost worker's requests migrate)"
    )
    router_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources the router actor needs (e.g. to keep it on a node "
        "pool); it asks for no CPU",
    )
    limits: IngressLimits = Field(
        default_factory=IngressLimits, description="caps and per-client budgets of the ingresses"
    )
    recreate_lost_workers: bool = Field(True, description="recreate a lost worker group")
    recreate_backoff_s: float = Field(
        1.0, gt=0, description="first wait before recreating a lost group again (doubles, ≤ 30 s)"
    )


class Cluster(RoutedCluster):
    """See the module docstring. Create with `await Cluster.start(config)`; Ray must be up."""

    router_errors = (RayActorError,)

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config.retry_after_s, config.max_attempts, config.limits)
        self.config = config
        self.engine = config.engine
        self.use_gpu = False
        self.groups: dict[str, WorkerGroup] = {}
        self.replica_of: dict[str, int] = {}  # worker id -> replica index
        self.recreated = 0  # groups recreated after a loss
        self._watchers: dict[str, asyncio.Task[None]] = {}  # worker id -> its watch
        self._recreating: dict[int, asyncio.Task[None]] = {}  # replica -> its recreation
        self._generation = 0
        self._kills: set[asyncio.Task[None]] = set()
        self._rejoined = asyncio.Event()  # set whenever a recreated group rejoins

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
        self.engine, self.use_gpu = engine, use_gpu
        # Supervised: Ray restarts a dead router; its calls in flight fail and are retried.
        self.router = (
            ray.remote(RouterActor)
            .options(num_cpus=0, max_restarts=-1, resources=dict(config.router_resources))
            .remote(config.router)
        )
        groups = [self._new_group(f"worker-{i}", i) for i in range(config.replicas)]
        infos = await asyncio.gather(*(g.start(config.startup_timeout_s) for g in groups))
        for group in groups:
            await self._join(group)
        self.model_info = model_info_of(engine, infos[0], config.served_model_name)
        self.tokenizer = load_tokenizer(engine.model, engine.tokenizer)
        await self._wait_reported()

    def _new_group(self, worker_id: str, replica: int) -> WorkerGroup:
        group = WorkerGroup(
            worker_id,
            self.engine,
            router=self.router,
            use_gpu=self.use_gpu,
            report_interval_s=self.config.report_interval_s,
        )
        self.groups[worker_id] = group
        self.replica_of[worker_id] = replica
        return group

    async def _join(self, group: WorkerGroup) -> None:
        await self.router.add_worker.remote(group.worker_id)
        self._watchers[group.worker_id] = asyncio.create_task(self._watch(group))

    async def _wait_reported(self, timeout_s: float = 30.0) -> None:
        """Until every live worker's first report reached the router (so it routes there)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            statuses = await self._ask_router("workers")
            reported = {s.worker_id for s in statuses if s.headroom is not None}
            if set(self.live_workers) <= reported:
                return
            await asyncio.sleep(0.02)
        raise TimeoutError("the workers' first reports did not reach the router")

    async def _watch(self, group: WorkerGroup) -> None:
        error = await group.watch()
        if not self._closing:
            self._lose(group.worker_id, f"stopped serving: {error}")

    # ---- the workers: Ray actor groups -----------------------------------------------------
    def _lose(self, worker_id: str, why: str) -> None:
        """Take a lost group out (kill its actors, remove it from the router) and start
        recreating its replica."""
        group = self.groups[worker_id]
        if not group.alive:
            return
        logger.error("worker %s lost (%s); serving on the others", worker_id, why)
        self.lost[worker_id] = why
        group.alive = False
        self.router.remove_worker.remote(worker_id)
        watcher = self._watchers.pop(worker_id, None)
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()
        replica = self.replica_of[worker_id]
        if self.config.recreate_lost_workers and not (self._closing or self.draining):
            if replica not in self._recreating:
                self._recreating[replica] = asyncio.create_task(self._recreate(group, replica))
        else:
            task = asyncio.create_task(asyncio.to_thread(group.kill))  # off the event loop
            self._kills.add(task)
            task.add_done_callback(self._kills.discard)

    async def _recreate(self, lost: WorkerGroup, replica: int) -> None:
        """Kill the lost group's actors (off the event loop), then start a new group for the
        replica until one serves (backoff between tries); it joins the router."""
        try:
            await asyncio.wait_for(asyncio.to_thread(lost.kill), KILL_TIMEOUT_S)
        except TimeoutError:
            logger.warning("worker %s: Ray did not confirm the kill", lost.worker_id)
        backoff = self.config.recreate_backoff_s
        try:
            while not self._closing:
                self._generation += 1
                group = self._new_group(f"worker-{replica}-r{self._generation}", replica)
                try:
                    await group.start(self.config.startup_timeout_s)
                except Exception:
                    logger.exception(
                        "recreating replica %d failed; retry in %.1f s", replica, backoff
                    )
                    group.alive = False
                    await asyncio.to_thread(group.kill)
                    del self.groups[group.worker_id]
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                    continue
                if self._closing:
                    return
                await self._join(group)
                try:
                    await self._wait_reported()
                except (TimeoutError, RayActorError):
                    logger.warning("%s: no report yet; it joins when one comes", group.worker_id)
                self.recreated += 1
                logger.warning("replica %d serves again as %s", replica, group.worker_id)
                return
        finally:
            self._recreating.pop(replica, None)
            self._rejoined.set()
            self._rejoined = asyncio.Event()

    @property
    def recovering(self) -> bool:
        """A lost group is being recreated."""
        return bool(self._recreating)

    async def _await_worker(self, deadline: float | None) -> bool:
        """Wait until a recreated group rejoins (or `deadline`); False if none is coming."""
        if not self._recreating:
            return False
        event = self._rejoined
        timeout = self.config.startup_timeout_s
        if deadline is not None:
            timeout = min(timeout, max(deadline - time.monotonic(), 0.0))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return False
        return bool(self.live_workers)

    def _worker_alive(self, worker_id: str) -> bool:
        group = self.groups.get(worker_id)
        return group is not None and group.alive

    @property
    def live_workers(self) -> list[str]:
        return [w for w, g in self.groups.items() if g.alive]

    async def _stream(
        self, worker_id: str, request: EngineRequest
    ) -> AsyncIterator[GenerateChunk | Exception]:
        stream = self.groups[worker_id].engine.generate.remote(request)
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
        for task in [*self._watchers.values(), *self._recreating.values()]:
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
