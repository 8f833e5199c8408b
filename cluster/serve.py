"""The Ray Serve application: `serve run swaserve.cluster.serve:build_app model=DIR replicas=2`.

    SwaIngress (FastAPI: OpenAI API, /health, /metrics; Serve's gRPC proxy: swaserve.v1.Inference)
      │  route(request) ──► RouterActor (the cluster's Router, fed by worker reports): a plain
      │  ◄── worker id        Ray actor owned by the SwaRouter deployment's one replica
      ├─ generate(..., worker_id=…) ──► SwaWorker × replicas   (PinnedRequestRouter sends it there)
      │      one Serve replica = one TP worker group: placement_group_bundles (one per rank,
      │      STRICT_PACK); the replica is rank 0, ranks 1.. are RankWorker actors in its bundles
      └─ /v1/responses store ──► SwaResponses   (one replica: the stored responses, so that
             previous_response_id and GET work whichever ingress replica a request reaches)

swaserve's router, not Serve's power-of-two default, places every request: the ingress asks
the router first (prefix, SWA window, headroom; its queue and its refusals become HTTP 429 /
RESOURCE_EXHAUSTED before the request enters Serve's queues), then calls the worker
deployment with the chosen worker id, and `PinnedRequestRouter` — a Serve `RequestRouter` that
only honours that choice — hands it to that replica. One router instance holds the one KV-event
view of the fleet; a `RequestRouter` alone runs in every handle's process and would need it in
each. The ingress and the workers reach the router actor directly (`DirectRouter`, its handle
asked of the SwaRouter replica), not through Serve's handle path. The ingress code is
`swaserve serve`'s: the same `RoutedCluster` logic, OpenAI app and gRPC service, only the
worker transport differs (`ServeCluster`).

Faults: the router actor restarts in place if its process dies; a router replica that died
(and its actor with it) is replaced by Serve, and the callers fetch the new actor. A worker
replica whose engine loop ended or whose TP rank died fails Serve's health
check (`SwaWorker.check_health`) and is replaced under a new replica id. The ingress drops a
worker from the router only when it is gone (ActorDiedError, a stopped engine, a lost rank); a
call that reached another replica (FinishReason.MISROUTED) or met an unreachable one (ActorUnavailableError)
is routed again and drops nobody.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from pathlib import Path
from typing import Any, Literal, NoReturn

import grpc
import ray
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from swaserve.cluster.grpc_server import (
    UNAUTHENTICATED_DETAILS,
    BearerToken,
    InferenceService,
    RpcFailure,
    grpc_client,
)
from swaserve.cluster.ingress_limits import IngressLimits
from swaserve.cluster.metrics import ServingMetrics
from swaserve.cluster.model_info import ModelInfo, WorkerInfo, model_info_of
from swaserve.cluster.openai_api import OpenAIServer, build_openai_app
from swaserve.cluster.openai_api.responses import ResponseStore, SharedResponseStore
from swaserve.cluster.routed import RoutedCluster, WorkerLost
from swaserve.cluster.router_actor import RouterActor
from swaserve.proto import environment
from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.sampling_params import SamplingParams
from swaserve.proto.stream import FinishReason, GenerateChunk
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.text.tokenizer import load_tokenizer
from swaserve.router import RouterConfig
from swaserve.worker.config import EngineConfig

logger = logging.getLogger(__name__)

WORKER_ID_KWARG = "worker_id"
ANY_WORKER = "*"  # routing="serve": whichever replica Serve picks
INGRESS_NAME, ROUTER_NAME, WORKER_NAME = "SwaIngress", "SwaRouter", "SwaWorker"
RESPONSES_NAME = "SwaResponses"


class PinnedRequestRouter(RequestRouter):
    """Sends a request to the replica named by its `worker_id` keyword argument (the choice
    of swaserve's router). Without one, or when that replica is not running, any replica:
    the worker then answers that it was not the one chosen, and the ingress routes again."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        wanted = pending_request.kwargs.get(WORKER_ID_KWARG) if pending_request else None
        for replica in candidate_replicas:
            if replica.replica_id.unique_id == wanted:
                return [[replica]]
        return [candidate_replicas]


class ServeAppArgs(BaseModel):
    """`build_app`'s arguments (from `serve run ... key=value` or a config file's `args`):
    the Serve knobs, then every `EngineConfig` field by its name, every `RouterConfig`
    field as `router_<name>` and every `IngressLimits` field as `limit_<name>`."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: str | None = Field(None, description="HF model dir (default: the demo model)")
    replicas: int = Field(1, ge=1, description="worker replicas, each one TP group")
    served_model_name: str | None = None
    use_gpu: bool | None = Field(None, description="GPU bundles (default: if Ray has GPUs)")
    max_ongoing_requests: int = Field(256, ge=1, description="per worker replica")
    ingress_replicas: int = Field(1, ge=1)
    report_interval_s: float = Field(0.1, gt=0, le=1.0)
    retry_after_s: float = Field(1.0, gt=0)
    max_attempts: int = Field(
        3, ge=1, description="workers a request may try (a lost worker's requests migrate)"
    )
    api_key: str | None = Field(
        None, description="bearer token the HTTP API and the gRPC API (Serve's proxy) require"
    )
    api_key_file: str | None = Field(
        None, description="file holding that token (e.g. a mounted Secret); else $SWASERVE_API_KEY"
    )
    health_check_period_s: float = Field(
        2.0,
        gt=0,
        description="Serve asks each worker and router replica this often whether it is healthy",
    )
    health_check_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a worker or router replica that does not answer in time is unhealthy",
    )
    routing: Literal["swaserve", "serve"] = Field(
        "swaserve",
        description="swaserve: the router places requests; serve: Serve's default "
        "power-of-two routing (the baseline of bench/serve_load.py)",
    )

    def resolved_api_key(self) -> str | None:
        """`api_key`, else the contents of `api_key_file`, else `$SWASERVE_API_KEY` (so a
        Kubernetes Secret never has to appear in the Serve config)."""
        if self.api_key:
            return self.api_key
        return environment.api_key(self.api_key_file)

    def engine_config(self) -> EngineConfig:
        from swaserve.cluster.serve_command import ensure_demo_model

        extra = dict(self.model_extra or {})
        engine = {k: v for k, v in extra.items() if k in EngineConfig.model_fields}
        model = self.model or str(ensure_demo_model())
        return EngineConfig(model=model, **engine)

    def router_config(self) -> RouterConfig:
        extra = dict(self.model_extra or {})
        fields = {k[len("router_") :]: v for k, v in extra.items() if k.startswith("router_")}
        return RouterConfig(**fields)

    def limits(self) -> IngressLimits:
        extra = dict(self.model_extra or {})
        fields = {k[len("limit_") :]: v for k, v in extra.items() if k.startswith("limit_")}
        return IngressLimits(**fields)

    def check_extra(self) -> None:
        for key in self.model_extra or {}:
            known = (
                key in EngineConfig.model_fields
                or (
                    key.startswith("router_") and key[len("router_") :] in RouterConfig.model_fields
                )
                or (key.startswith("limit_") and key[len("limit_") :] in IngressLimits.model_fields)
            )
            if not known:
                raise ValueError(f"unknown argument {key!r} for swaserve's Serve app")


class SwaRouter:
    """The router's Serve deployment (one replica). The router itself is a plain Ray actor
    (`RouterActor`) that the replica starts and owns, so that the ingress and the workers
    call it directly (`DirectRouter`): one Ray actor call per route, finish and report, not a
    call through Serve's handle path (its own queue and replica choice, and a wait on this
    replica's event loop), which cost the ingress 15-20 ms per route at the bench's load.

    The actor lives as long as its replica (Ray ends an actor with its owner) and restarts in
    place if its own process dies, as `swaserve serve`'s router does (the workers' next
    reports rebuild its view). The replica's health check asks the actor; a replica that
    died or failed the check is replaced by Serve, and the new one starts a new actor, which
    the callers fetch again (`actor`) when a call meets the old one's death."""

    def __init__(self, config: RouterConfig) -> None:
        node = ray.get_runtime_context().get_node_id()
        self.router = (
            ray.remote(RouterActor)
            .options(
                num_cpus=0,
                max_restarts=-1,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True),
            )
            .remote(config)
        )

    async def actor(self) -> Any:
        """The router actor's handle."""
        return self.router

    async def check_health(self) -> None:
        """Serve calls it every few seconds: the router actor answers (a restart in place
        is waited for), or the replica is unhealthy and replaced."""
        await self.router.pid.remote()


class DirectRouter:
    """The SwaRouter deployment's router actor, called as an actor handle is:
    `await router.route.remote(...)`. Its handle is asked of the deployment on first use and
    again after a call met the actor's death (its replica was replaced). A call goes out when
    `remote` is called, also when nobody awaits its answer (a finish), once the handle is
    known; before that, from a thread without a running event loop (a worker's engine loop),
    it goes out when its answer is awaited."""

    def __init__(self, deployment: Any) -> None:
        self.deployment = deployment
        self._actor: Any = None
        self._fetching: asyncio.Task[Any] | None = None  # the one fetch the callers await

    def __getattr__(self, method: str) -> _RouterMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _RouterMethod(self, method)

    def _call(self, method: str, args: tuple[Any, ...]) -> Awaitable[Any]:
        actor = self._actor
        if actor is not None:
            return _RouterAnswer(self, actor, getattr(actor, method).remote(*args))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return _Deferred(lambda: self._call_fetched(method, args))
        return loop.create_task(self._call_fetched(method, args))

    async def _call_fetched(self, method: str, args: tuple[Any, ...]) -> Any:
        actor = self._actor
        if actor is None:
            actor = await self._fetch()
        return await _RouterAnswer(self, actor, getattr(actor, method).remote(*args))

    async def _fetch(self) -> Any:
        """The actor's handle from the deployment: one call for all the callers that wait
        for it (a worker sends a report every 100 ms while a replaced replica starts)."""
        loop = asyncio.get_running_loop()
        fetching = self._fetching
        if fetching is None or fetching.get_loop() is not loop:
            fetching = self._fetching = loop.create_task(self._ask_deployment())
        try:
            return await asyncio.shield(fetching)
        finally:
            if fetching.done() and self._fetching is fetching:
                self._fetching = None

    async def _ask_deployment(self) -> Any:
        actor = await self.deployment.actor.remote()
        self._actor = actor
        return actor

    def _forget(self, actor: Any) -> None:
        if self._actor is actor:
            self._actor = None


class _RouterMethod:
    def __init__(self, link: DirectRouter, method: str) -> None:
        self.link, self.method = link, method

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self.link._call(self.method, args)


class _RouterAnswer:
    """A router call's answer; a call that met the actor's death makes the link fetch the
    actor again on its next call."""

    def __init__(self, link: DirectRouter, actor: Any, ref: Any) -> None:
        self.link, self.actor, self.ref = link, actor, ref

    def __await__(self) -> Generator[Any, None, Any]:
        try:
            return (yield from self.ref.__await__())
        except ray.exceptions.RayActorError:
            self.link._forget(self.actor)
            raise


class _Deferred:
    """An awaitable that makes its coroutine only when awaited (none is left un-awaited)."""

    def __init__(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        self.make = make

    def __await__(self) -> Generator[Any, None, Any]:
        return self.make().__await__()


class SwaResponses(ResponseStore):
    """The Responses API's store as a Serve deployment (one replica), shared by the ingress
    replicas through `SharedResponseStore`. Its stored responses live as long as the replica."""


class ServeCluster(RoutedCluster):
    """`RoutedCluster` over the SwaRouter and SwaWorker deployments (handles)."""

    # A call that met the SwaRouter replica's death: Serve replaces it; ask again.
    router_errors = (ray.exceptions.RayActorError,)

    def __init__(self, router: Any, workers: Any, args: ServeAppArgs) -> None:
        super().__init__(args.retry_after_s, args.max_attempts, args.limits())
        self.router = DirectRouter(router)
        self.workers = workers
        self.args = args
        self.engine = args.engine_config()
        self.tokenizer = load_tokenizer(self.engine.model, self.engine.tokenizer)
        self._known: set[str] = set()

    async def ready(self) -> None:
        known: ModelInfo | None = getattr(self, "model_info", None)
        if known is not None:
            return
        await self.load()
        info: WorkerInfo = await self.workers.info_of.remote()
        self.model_info = model_info_of(self.engine, info, self.args.served_model_name)

    def _stream(
        self, worker_id: str, request: EngineRequest
    ) -> AsyncIterator[GenerateChunk | Exception]:
        return self._stream_from(worker_id, request)

    async def _stream_from(
        self, worker_id: str, request: EngineRequest
    ) -> AsyncIterator[GenerateChunk | Exception]:
        stream = self.workers.options(stream=True).generate_on.remote(request, worker_id=worker_id)
        try:
            async for item in stream:
                yield item
        except ray.exceptions.ActorUnavailableError as exc:
            # Unreachable for this call (a network blip, the GCS restarting): the replica may
            # well be healthy, so it stays in the router; Serve's health check replaces it if
            # not. Cancel the call (the replica aborts the request if it still runs it) and
            # route again.
            stream.cancel()
            yield GenerateChunk(
                request.request_id,
                finished=True,
                finish_reason=FinishReason.MISROUTED,
                error=f"worker {worker_id} was unreachable: {exc}",
            )
        except ray.exceptions.RayActorError as exc:  # ActorDiedError: the replica is gone
            raise WorkerLost(str(exc)) from exc

    def _abort_on(self, worker_id: str, request_id: str) -> None:
        if worker_id == ANY_WORKER:  # no way to name the replica: ask every one
            for replica in sorted(self._known):
                self.workers.abort_on.remote(request_id, worker_id=replica)
        else:
            self.workers.abort_on.remote(request_id, worker_id=worker_id)

    async def _route(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        session_id: str | None,
        deadline: float | None = None,
    ) -> str:
        if self.args.routing == "serve":
            return ANY_WORKER
        return await super()._route(request_id, token_ids, params, session_id, deadline)

    def _worker_alive(self, worker_id: str) -> bool:
        return worker_id not in self.lost

    def _lose(self, worker_id: str, why: str) -> None:
        if worker_id in self.lost or worker_id == ANY_WORKER:
            return
        logger.error("worker %s lost (%s); serving on the others", worker_id, why)
        self.lost[worker_id] = why
        self.router.remove_worker.remote(worker_id)

    @property
    def live_workers(self) -> list[str]:
        return sorted(self._known - set(self.lost))

    async def load(self) -> list[Any]:
        statuses = await super().load()
        timeout = self.router_config_timeout_s
        fresh = [s for s in statuses if s.report_age_s <= timeout]
        self._known = {s.worker_id for s in fresh}
        return fresh

    @property
    def router_config_timeout_s(self) -> float:
        return self.args.router_config().report_timeout_s


@serve.ingress()
class SwaIngress:
    """HTTP (OpenAI API) and gRPC (through Serve's proxy) in front of the cluster."""

    def __init__(self, router: Any, workers: Any, responses: Any, args: ServeAppArgs) -> None:
        self.cluster = ServeCluster(router, workers, args)
        model_name = args.served_model_name or Path(self.cluster.engine.model).name
        self.metrics = ServingMetrics(model_name)
        self.service = InferenceService(self.cluster, self.metrics)
        api_key = args.resolved_api_key()
        self.openai = OpenAIServer(
            self.cluster, self.metrics, api_key, store=SharedResponseStore(responses)
        )
        self.grpc_auth = BearerToken(api_key) if api_key else None

    def __serve_build_asgi_app__(self) -> Any:
        """Serve asks for the HTTP app once the constructor ran: the OpenAI app over this
        replica's cluster."""
        app = build_openai_app()
        app.state.openai = self.openai
        return app

    def _authorize(self, grpc_context: Any) -> None:
        """The API key on the gRPC path, by the standalone server's rule (`BearerToken`):
        raises `RpcFailure` UNAUTHENTICATED when a key is set and the call's metadata does not
        carry `authorization: Bearer <key>` (a call without a gRPC context has none)."""
        if self.grpc_auth is None:
            return
        metadata = grpc_context.invocation_metadata() if grpc_context is not None else ()
        if not self.grpc_auth.allows(metadata):
            raise RpcFailure(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)

    # Serve's gRPC context carries no deadline (no `time_remaining()`): Generate runs without
    # `timeout_s`, bounded by the router's own queue timeout.
    async def Generate(
        self, request: pb.GenerateRequest, grpc_context: Any = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            self._authorize(grpc_context)
            client = grpc_client(grpc_context, self.grpc_auth is not None)
            async for item in self.service.generate(request, client=client):
                yield item
        except RpcFailure as failure:
            _fail(grpc_context, failure)

    async def Abort(self, request: pb.AbortRequest, grpc_context: Any = None) -> pb.AbortResponse:
        try:
            self._authorize(grpc_context)
            return await self.service.abort(request)
        except RpcFailure as failure:
            _fail(grpc_context, failure)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, grpc_context: Any = None
    ) -> pb.ModelInfo:
        try:
            self._authorize(grpc_context)
        except RpcFailure as failure:
            _fail(grpc_context, failure)
        return await self.service.model_info(request)

    async def GetLoad(
        self, request: pb.GetLoadRequest, grpc_context: Any = None
    ) -> pb.LoadResponse:
        try:
            self._authorize(grpc_context)
        except RpcFailure as failure:
            _fail(grpc_context, failure)
        return await self.service.load(request)


def _fail(grpc_context: Any, failure: RpcFailure) -> NoReturn:
    """End the call with `failure`. Serve's proxy takes the code and details set on its context
    when the method then raises (a stream that ends without an item would end OK); trailing
    metadata (`retry-after-s`) reaches the client only on a stream that yielded an item."""
    if grpc_context is not None:
        grpc_context.set_code(failure.code)
        grpc_context.set_details(failure.details)
        if failure.trailing:
            grpc_context.set_trailing_metadata(list(failure.trailing))
    raise failure


GRPC_SERVICER_FUNCTION = (
    "swaserve.proto.swaserve.v1.inference_pb2_grpc.add_InferenceServicer_to_server"
)


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application (see the module docstring); `args` as `ServeAppArgs`."""
    from swaserve.cluster.serve_worker import SwaWorker  # the engine: only worker replicas load it

    try:
        parsed = ServeAppArgs(**args)
        parsed.check_extra()
        engine = parsed.engine_config()
        router_config = parsed.router_config()
        parsed.limits()
    except (ValidationError, ValueError) as exc:
        raise ValueError(f"swaserve Serve app: bad arguments: {exc}") from exc
    use_gpu = parsed.use_gpu
    if use_gpu is None:
        use_gpu = engine.device.startswith("cuda") or (
            engine.device == "auto"
            and ray.is_initialized()
            and ray.cluster_resources().get("GPU", 0) > 0
        )
    if engine.device == "auto":
        engine = engine.model_copy(update={"device": "cuda" if use_gpu else "cpu"})
    bundle = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
    actor_options = {"num_gpus": 1} if use_gpu else {"num_cpus": 1}
    routing: dict[str, Any] = {}
    if parsed.routing == "swaserve":
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class=f"{__name__}.{PinnedRequestRouter.__name__}"  # type: ignore[arg-type]
        )
    router = serve.deployment(
        name=ROUTER_NAME,
        num_replicas=1,
        max_ongoing_requests=10_000,
        health_check_period_s=parsed.health_check_period_s,
        health_check_timeout_s=parsed.health_check_timeout_s,
        ray_actor_options={"num_cpus": 0},
        logging_config={"enable_access_log": False},  # health checks and handle fetches
    )(SwaRouter)
    workers = serve.deployment(
        name=WORKER_NAME,
        num_replicas=parsed.replicas,
        max_ongoing_requests=parsed.max_ongoing_requests,
        health_check_period_s=parsed.health_check_period_s,
        health_check_timeout_s=parsed.health_check_timeout_s,
        ray_actor_options=actor_options,
        placement_group_bundles=[dict(bundle) for _ in range(engine.tp_size)],
        placement_group_strategy="STRICT_PACK",
        **routing,
    )(SwaWorker)
    ingress = serve.deployment(
        name=INGRESS_NAME,
        num_replicas=parsed.ingress_replicas,
        max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0},
    )(SwaIngress)
    responses = serve.deployment(
        name=RESPONSES_NAME,
        num_replicas=1,
        max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0},
        logging_config={"enable_access_log": False},
    )(SwaResponses)
    router_app = router.bind(router_config)
    worker_app = workers.bind(engine, router_app, parsed.report_interval_s)
    return ingress.bind(router_app, worker_app, responses.bind(), parsed)


__all__ = ["GRPC_SERVICER_FUNCTION", "PinnedRequestRouter", "ServeAppArgs", "build_app"]
