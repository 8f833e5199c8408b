"""Cluster: the driver's view of a serving cluster — the router actor and the worker groups.

    generate(request)  →  router actor: route (prefix, SWA window, headroom)  →  worker id
                       →  that group's rank 0: stream chunks  →  caller
                       worker lost before any token: drop it, route again; after: WorkerLost

The ingresses (gRPC, HTTP) call only this class. Every group is watched (`WorkerGroup.watch`);
a group that stops is killed, taken out of the router and out of `load()`, and the cluster
goes on with the rest. `drain()` refuses new requests and waits (bounded) for the open ones;
`shutdown()` stops every actor.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field
from ray.exceptions import RayActorError

from swaserve.cluster.engine_loop import WORKER_LOST, GenerateChunk
from swaserve.cluster.router_actor import RouteAnswer, RouterActor, WorkerStatus
from swaserve.cluster.worker_group import KILL_TIMEOUT_S, WorkerGroup, WorkerInfo
from swaserve.proto.kv_rules import page_ceil
from swaserve.router import RouterConfig
from swaserve.worker import EngineConfig, SamplingParams
from swaserve.worker.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)


class ClusterError(Exception):
    """Base of the errors the cluster gives its ingresses (each maps to one status code)."""


class InvalidRequest(ClusterError):
    """The request can never be served as it is (INVALID_ARGUMENT / HTTP 400)."""


class ClusterBusy(ClusterError):
    """No worker has room and the router's queue is full or the wait ran out
    (RESOURCE_EXHAUSTED / HTTP 429). `retry_after_s`: a hint for the client."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(ClusterError):
    """Draining, no worker left, or the worker was lost after tokens were streamed
    (UNAVAILABLE / HTTP 503)."""


class GenerationFailed(ClusterError):
    """The worker's step failed for this request (INTERNAL / HTTP 500)."""


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


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_name: str
    model_path: str
    architecture: str
    vocab_size: int
    max_model_len: int
    sliding_window_size: int
    page_size: int
    tp_size: int
    eos_token_ids: tuple[int, ...]
    has_tokenizer: bool
    full_pool_tokens: int
    max_unchunked_prompt_tokens: int | None


class _Lost(Exception):
    pass


class Cluster:
    """See the module docstring. Create with `await Cluster.start(config)`; Ray must be up."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.groups: dict[str, WorkerGroup] = {}
        self.lost: dict[str, str] = {}  # worker id -> why it was dropped
        self.router: Any = None
        self.model_info: ModelInfo | None = None
        self.tokenizer: TextTokenizer | None = None
        self.draining = False
        self._closing = False
        self._open: dict[str, WorkerGroup] = {}  # request id -> the group serving it
        self._watchers: dict[str, asyncio.Task[None]] = {}  # worker id -> its watch
        self._ids = itertools.count()

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
        self.model_info = self._model_info(engine, infos[0])
        tokenizer_dir = Path(engine.tokenizer or engine.model)
        if (tokenizer_dir / "tokenizer.json").is_file():
            self.tokenizer = TextTokenizer(tokenizer_dir)
        await self._wait_reported()

    def _model_info(self, engine: EngineConfig, info: WorkerInfo) -> ModelInfo:
        return ModelInfo(
            model_name=self.config.served_model_name or Path(engine.model).name,
            model_path=engine.model,
            architecture=info.architecture,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            sliding_window_size=info.sliding_window_size,
            page_size=info.page_size,
            tp_size=info.tp_size,
            eos_token_ids=info.eos_token_ids,
            has_tokenizer=(Path(engine.tokenizer or engine.model) / "tokenizer.json").is_file(),
            full_pool_tokens=info.full_pool_tokens,
            max_unchunked_prompt_tokens=info.max_unchunked_prompt_tokens,
        )

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
            self._drop(group, f"stopped serving: {error}")

    def _drop(self, group: WorkerGroup, why: str) -> None:
        """Take a lost group out: kill its actors, remove it from the router."""
        if not group.alive:
            return
        logger.error("worker %s lost (%s); serving on the others", group.worker_id, why)
        self.lost[group.worker_id] = why
        group.kill()
        self.router.remove_worker.remote(group.worker_id)

    @property
    def live_workers(self) -> list[str]:
        return [w for w, g in self.groups.items() if g.alive]

    def new_request_id(self) -> str:
        return f"req-{time.time_ns():x}-{next(self._ids)}"

    # ---- requests ------------------------------------------------------------------------
    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise `InvalidRequest` for what no worker can serve (the engine checks again)."""
        info = self.model_info
        assert info is not None
        if not token_ids:
            raise InvalidRequest("the prompt is empty")
        bad = next((t for t in token_ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
        if len(token_ids) >= info.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(token_ids)} tokens; the model's limit is "
                f"{info.max_model_len} in all"
            )
        need = page_ceil(len(token_ids) + params.max_new_tokens, info.page_size)
        if need > info.full_pool_tokens:
            raise InvalidRequest(
                f"prompt ({len(token_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"needs {need} KV tokens; a worker's full pool holds {info.full_pool_tokens}"
            )
        limit = info.max_unchunked_prompt_tokens
        if limit is not None and len(token_ids) > limit:
            raise InvalidRequest(
                f"a prompt of {len(token_ids)} tokens does not fit the SWA pool without chunked "
                f"prefill (at most {limit}); enable chunked_prefill_size"
            )
        bad_stop = next((t for t in params.stop_token_ids if t >= info.vocab_size), None)
        if bad_stop is not None:
            raise InvalidRequest(f"stop token id {bad_stop} is outside the vocabulary")

    async def generate(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        *,
        session_id: str | None = None,
    ) -> AsyncIterator[GenerateChunk]:
        """Stream the request's chunks (`worker_id` set on each). Raises a `ClusterError`.
        Closing the iterator early aborts the request on its worker and frees its KV."""
        if self.draining or self._closing:
            raise Unavailable("the server is draining; retry on another replica")
        self.check_request(token_ids, params)
        attempts = 0
        while True:
            group: WorkerGroup | None = None
            streamed = False
            finished = False
            try:
                group = await self._route(request_id, token_ids, params, session_id)
                self._open[request_id] = group
                stream = group.engine.generate.remote(request_id, token_ids, params)
                async for ref in stream:
                    item = await ref
                    if isinstance(item, Exception):
                        raise InvalidRequest(str(item))
                    if item.finish_reason == WORKER_LOST:
                        raise _Lost(item.error)
                    if item.finish_reason == "error":
                        finished = True
                        raise GenerationFailed(item.error or "the worker's step failed")
                    item.worker_id = group.worker_id
                    finished = item.finished
                    if item.token_ids or item.finished:
                        streamed = True
                        yield item
                    if finished:
                        return
                raise _Lost("the stream ended early")
            except (RayActorError, _Lost) as exc:
                assert group is not None  # routing itself does not lose workers
                finished = True  # nothing left to abort on a lost group
                self._drop(group, f"lost during request {request_id}: {exc}")
                attempts += 1
                if streamed or attempts > len(self.groups):
                    raise Unavailable(
                        f"worker {group.worker_id} was lost while serving {request_id}"
                    ) from exc
                logger.warning("request %s: retrying after losing %s", request_id, group.worker_id)
            finally:
                # Also when the caller left while the request was queued in the router.
                self._open.pop(request_id, None)
                self.router.finish.remote(request_id)
                if group is not None and not finished and group.alive:
                    group.engine.abort.remote(request_id)

    async def _route(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        session_id: str | None,
    ) -> WorkerGroup:
        while True:
            answer: RouteAnswer = await self.router.route.remote(
                request_id, token_ids, params.max_new_tokens, session_id
            )
            if answer.outcome in ("overloaded", "expired"):
                raise ClusterBusy(
                    f"request {request_id}: no worker has KV headroom ({answer.outcome}, "
                    f"{answer.queue_len} queued); retry later",
                    self.config.retry_after_s,
                )
            if answer.outcome == "no_workers":
                raise Unavailable("no worker is serving")
            if answer.outcome == "invalid":
                raise InvalidRequest(answer.message)
            assert answer.worker_id is not None
            group = self.groups[answer.worker_id]
            if group.alive:
                return group
            await self.router.finish.remote(request_id)  # raced with its removal: route again

    async def abort(self, request_id: str) -> bool:
        """Abort an open request (its stream ends with "abort"); False if none is open."""
        group = self._open.get(request_id)
        if group is None or not group.alive:
            return False
        await group.engine.abort.remote(request_id)
        return True

    # ---- queries -------------------------------------------------------------------------
    async def load(self) -> list[WorkerStatus]:
        """The router's view of every live worker: last headroom, report age, load."""
        statuses = await self.router.workers.remote()
        return [
            s for s in statuses if s.worker_id in self.groups and self.groups[s.worker_id].alive
        ]

    async def router_stats(self) -> dict[str, Any]:
        return await self.router.stats.remote()

    @property
    def num_open(self) -> int:
        return len(self._open)

    # ---- lifecycle -----------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, then wait up to `timeout_s` for the open ones; True if all
        ended."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._open

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
