"""`SwaWorker`: one TP worker group as one replica of the Serve app (`swaserve.cluster.serve`).
This module imports the engine; the app's ingress and router replicas never import it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from swaserve.cluster.model_info import WorkerInfo
from swaserve.cluster.serve import ANY_WORKER, DirectRouter
from swaserve.cluster.worker_group import EngineWorker, RankWorker
from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.stream import FinishReason, GenerateChunk
from swaserve.worker.config import EngineConfig
from swaserve.worker.engine.engine_loop import EngineLoop

logger = logging.getLogger(__name__)


class SwaWorker(EngineWorker):
    """One TP worker group as one Serve replica: the replica is rank 0; it starts ranks
    1..tp-1 in the other bundles of its placement group."""

    def __init__(self, config: EngineConfig, router: Any, report_interval_s: float) -> None:
        worker_id = serve.get_replica_context().replica_id.unique_id
        ranks = []
        if config.tp_size > 1:
            group = get_current_placement_group()
            if group is None:
                raise RuntimeError("a TP worker replica needs placement_group_bundles")
            use_gpu = config.device.startswith("cuda")
            resources = {"num_gpus": 1} if use_gpu else {"num_cpus": 1}
            ranks = [
                ray.remote(RankWorker)
                .options(
                    max_restarts=0,
                    max_concurrency=2,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=rank
                    ),
                    **resources,
                )
                .remote()
                for rank in range(1, config.tp_size)
            ]
        super().__init__(worker_id, config, ranks, DirectRouter(router), report_interval_s)
        self.start_sync()

    async def info_of(self) -> WorkerInfo:
        assert self.info is not None
        return self.info

    async def generate_on(
        self, request: EngineRequest, worker_id: str
    ) -> AsyncIterator[GenerateChunk | Exception]:
        if worker_id not in (self.worker_id, ANY_WORKER):  # Serve could not reach it
            yield GenerateChunk(
                request.request_id,
                finished=True,
                finish_reason=FinishReason.MISROUTED,  # route again; the chosen worker is not lost
                error=f"the call for worker {worker_id} reached {self.worker_id}: "
                f"{worker_id} is not among the running replicas",
            )
            return
        async for item in self.generate(request):
            yield item

    async def check_health(self) -> None:
        """Serve calls it every `health_check_period_s`; raising marks the replica unhealthy
        and Serve replaces it (under a new replica id, so the router sees a new worker).
        Raises once the engine loop has ended (the error that ended it: a dead or hung TP
        rank, a broken step) or when a TP rank has died (`TensorParallelError`)."""
        loop = self.loop
        if loop is None:
            raise RuntimeError(f"worker {self.worker_id} has stopped")
        if loop.wait(0):  # re-raises the error that ended the loop
            raise RuntimeError(f"worker {self.worker_id}: its engine loop has ended")
        launcher = loop.engine.launcher
        if launcher is not None:  # TP > 1; asks Ray, so off the replica's event loop
            await asyncio.to_thread(launcher.check_alive)

    async def abort_on(self, request_id: str, worker_id: str) -> None:
        if worker_id == self.worker_id:
            await self.abort(request_id)

    def __del__(self) -> None:
        """Serve calls it when the replica stops: end the loop, the engine and its ranks."""
        loop: EngineLoop | None = getattr(self, "loop", None)
        if loop is None:
            return
        self.loop = None
        loop.stop()
        try:
            loop.wait(10.0)
        except BaseException:
            logger.warning("worker %s ended with an error", self.worker_id, exc_info=True)
        loop.engine.shutdown(wait_compiles=False)  # the replica's process ends next
