"""Worker groups on Ray: one placement group per replica, one actor per TP rank.

    placement group (STRICT_PACK, one bundle per rank: {"GPU": 1} or {"CPU": 1})
      bundle 0: EngineWorker  rank 0: engine + scheduler + EngineLoop thread; streams tokens
      bundle r: RankWorker    rank r: `run_worker_rank` (the TP rank loop, unchanged)

Rank 0's engine starts the other ranks through `RayRanks` (the engine's `RankHandles`): it opens
the rendezvous store (TCPStore, port 0; the bundles share one node) and calls each
`RankWorker.run(...)`, a call that lasts as long as the rank. `RayRanks.dead()` is a
`ray.wait(timeout=0)` on those calls, which the engine checks before every step and, idle,
every report interval; a dead rank makes the engine loop end, which ends rank 0's
`serve_forever()` call, on which the driver's `WorkerGroup.watch()` waits. So one dead rank
takes its whole group down, and `WorkerGroup.kill()` ends every actor and the placement group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from swaserve.cluster.model_info import WorkerInfo, model_info_of_engine
from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.messages import WorkerReport
from swaserve.proto.stream import GenerateChunk
from swaserve.worker.config import EngineConfig
from swaserve.worker.engine.engine_loop import EngineLoop
from swaserve.worker.runner.executor import RankSpec, run_worker_rank

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # model load on every rank
KILL_TIMEOUT_S = 10.0


class RankWorker:
    """TP rank r >= 1 of a group: runs the rank loop for as long as the group lives."""

    def run(self, rank: int, world_size: int, host: str, port: int, spec: RankSpec) -> None:
        run_worker_rank(rank, world_size, host, port, spec)

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        """The rank's process (what an operator, or a chaos test, would kill)."""
        return os.getpid()


class RayRanks:
    """`RankHandles` over `RankWorker` actors: `start` calls their long `run`, `dead` asks Ray
    which of those calls ended, `stop` waits for them and then kills the actors."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self._runs: list[Any] = []
        self._reported: set[int] = set()

    def start(self, store_host: str, store_port: int, spec: RankSpec) -> None:
        world = len(self.actors) + 1
        self._runs = [
            actor.run.remote(rank, world, store_host, store_port, spec)
            for rank, actor in enumerate(self.actors, start=1)
        ]

    def _ended(self) -> list[int]:
        if not self._runs:
            return []
        ready, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        ended = {id(ref) for ref in ready}
        return [i for i, ref in enumerate(self._runs) if id(ref) in ended]

    def dead(self) -> list[str]:
        return [f"TP rank {i + 1} (Ray actor)" for i in self._ended()]

    def errors(self) -> list[str]:
        messages = []
        for i in self._ended():
            if i in self._reported:
                continue
            self._reported.add(i)
            try:
                ray.get(self._runs[i], timeout=0)
                messages.append(f"TP rank {i + 1} stopped")
            except Exception as exc:  # the rank's own failure, or the actor's death
                messages.append(f"TP rank {i + 1}: {type(exc).__name__}: {exc}")
        return messages

    def stop(self, join_timeout_s: float) -> None:
        if self._runs and join_timeout_s > 0:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=join_timeout_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


class EngineWorker:
    """TP rank 0 of a group (an async Ray actor): the engine, its loop thread, the token
    streams, abort, and the reports to the router actor."""

    loop: EngineLoop | None
    info: WorkerInfo | None

    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        rank_actors: list[Any],
        router: Any = None,
        report_interval_s: float = 0.1,
    ) -> None:
        self.worker_id = worker_id
        self.config = config
        self.rank_actors = rank_actors
        self.router = router
        self.report_interval_s = report_interval_s
        self.loop: EngineLoop | None = None
        self.info: WorkerInfo | None = None

    async def start(self) -> WorkerInfo:
        """Build the engine (every rank loads its shard) and start its loop."""
        return await asyncio.to_thread(self.start_sync)

    def start_sync(self) -> WorkerInfo:
        from swaserve.worker import Engine

        ranks = RayRanks(self.rank_actors) if self.rank_actors else None
        engine = Engine(self.config, tp_ranks=ranks)
        on_report = self._push_report if self.router is not None else None
        self.loop = EngineLoop(
            engine,
            self.worker_id,
            on_report=on_report,
            report_interval_s=self.report_interval_s,
            stream_interval_s=self.config.stream_interval_ms / 1e3,
        )
        self.loop.start()
        self.info = WorkerInfo(
            worker_id=self.worker_id,
            device=str(engine.runner.device),
            node_id=ray.get_runtime_context().get_node_id(),
            model=model_info_of_engine(engine),
        )
        return self.info

    def _push_report(self, report: WorkerReport) -> None:
        """Send a report without waiting (Ray keeps one caller's order). The answer (an
        ObjectRef, or a DeploymentResponse under Serve) is awaited off the engine loop's
        thread; True makes the next report a snapshot (`EngineLoop.take_router_answer`)."""
        answer = self.router.update.remote(report)
        if self.loop is not None:
            self.loop.take_router_answer(report.seq, answer)

    async def serve_forever(self) -> None:
        """Lasts as long as the engine loop; raises the error that ended it (a dead rank)."""
        loop = self._loop()
        while not await asyncio.to_thread(loop.wait, 1.0):
            pass

    async def generate(self, request: EngineRequest) -> AsyncIterator[GenerateChunk | Exception]:
        """Stream the request's chunks. The first item is an empty chunk once the engine took
        the request, or the `RequestError` that refused it (then the stream ends)."""
        loop, request_id = self._loop(), request.request_id
        chunks: asyncio.Queue[GenerateChunk] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def sink(chunk: GenerateChunk) -> None:
            event_loop.call_soon_threadsafe(chunks.put_nowait, chunk)

        try:
            await asyncio.wrap_future(loop.submit(request, sink))
        except Exception as exc:
            yield exc
            return
        yield GenerateChunk(request_id)
        finished = False
        try:
            while not finished:
                chunk = await chunks.get()
                while not chunk.finished and not chunks.empty():  # merge what piled up
                    chunk.merge(chunks.get_nowait())
                finished = chunk.finished
                chunk.worker_id = self.worker_id
                yield chunk
        finally:
            if not finished:  # the caller went away (cancel, deadline): free the KV now
                loop.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._loop().abort(request_id)

    async def report(self) -> WorkerReport | None:
        return self._loop().latest_report

    async def num_open(self) -> int:
        return self._loop().num_open

    async def take_step_log(self) -> list[tuple[int, int, int, int, float, float]]:
        """The engine's step records since the last call (`StepRecord`s as tuples)."""
        records = await asyncio.wrap_future(self._loop().call(lambda e: e.step_log.take()))
        return [tuple(r) for r in records]

    async def check(self) -> None:
        """The engine's invariant checks, run on its loop thread; raise on a broken one."""
        await asyncio.wrap_future(self._loop().call(lambda engine: engine.check()))

    async def pid(self) -> int:
        """Rank 0's process (what an operator, or a chaos test, would kill)."""
        return os.getpid()

    async def shutdown(self) -> None:
        """Stop the loop (open requests end with "abort") and the engine with its TP ranks."""
        if self.loop is None:
            return
        self.loop.stop()
        try:
            await asyncio.to_thread(self.loop.wait, 30.0)
        except BaseException:
            logger.warning("worker %s ended with an error", self.worker_id, exc_info=True)
        # The group kills this process next: a background compile's graph is not waited for.
        await asyncio.to_thread(self.loop.engine.shutdown, wait_compiles=False)

    def _loop(self) -> EngineLoop:
        if self.loop is None:
            raise RuntimeError(f"worker {self.worker_id} has not started")
        return self.loop


class WorkerGroup:
    """The driver's handle on one replica: its placement group and its rank actors."""

    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        *,
        router: Any = None,
        use_gpu: bool = False,
        report_interval_s: float = 0.1,
    ) -> None:
        self.worker_id = worker_id
        self.config = config
        tp = config.tp_size
        bundle = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
        self.placement_group: PlacementGroup = placement_group(
            [dict(bundle) for _ in range(tp)],
            strategy="STRICT_PACK",
            name=f"swaserve-{worker_id}-{uuid.uuid4().hex[:8]}",
        )
        resources = {"num_gpus": 1} if use_gpu else {"num_cpus": 1}

        def on_bundle(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=index
            )

        self.rank_actors = [
            ray.remote(RankWorker)
            .options(
                max_restarts=0,
                max_concurrency=2,  # `ping` answers while `run` holds the rank
                scheduling_strategy=on_bundle(rank),
                **resources,
            )
            .remote()
            for rank in range(1, tp)
        ]
        self.engine: Any = (  # the EngineWorker actor's handle
            ray.remote(EngineWorker)
            .options(
                max_restarts=0, max_concurrency=1000, scheduling_strategy=on_bundle(0), **resources
            )
            .remote(worker_id, config, self.rank_actors, router, report_interval_s)
        )
        self.info: WorkerInfo | None = None
        self._serving: Any = None
        self.alive = True

    @property
    def actors(self) -> list[Any]:
        return [self.engine, *self.rank_actors]

    async def start(self, timeout_s: float = READY_TIMEOUT_S) -> WorkerInfo:
        """Wait for the placement group, load the model on every rank, start serving."""
        await asyncio.wait_for(self.placement_group.ready(), timeout_s)
        info: WorkerInfo = await asyncio.wait_for(self.engine.start.remote(), timeout_s)
        self.info = info
        self._serving = self.engine.serve_forever.remote()
        return info

    async def watch(self) -> Exception | None:
        """Wait until the group stops serving; the error that stopped it (None: shut down)."""
        try:
            await self._serving
        except Exception as exc:
            return exc
        return None

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop serving cleanly if the group still lives, then kill what is left. Bounded:
        a Ray that is itself going down cannot hang it."""
        if self.alive:
            try:
                await asyncio.wait_for(self.engine.shutdown.remote(), timeout_s)
            except Exception:
                logger.warning("worker %s did not shut down cleanly", self.worker_id, exc_info=True)
        try:
            await asyncio.wait_for(asyncio.to_thread(self.kill), KILL_TIMEOUT_S)
        except TimeoutError:
            logger.warning("worker %s: Ray did not confirm the kill", self.worker_id)

    def kill(self) -> None:
        """End every actor of the group and free its placement group (idempotent)."""
        self.alive = False
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                logger.debug("kill of an actor of %s failed", self.worker_id, exc_info=True)
        try:
            remove_placement_group(self.placement_group)
        except Exception:
            logger.debug("placement group of %s already removed", self.worker_id, exc_info=True)
