"""The Serve app's worker transport and replica checks without Ray: `SwaWorker.generate_on`
and `check_health`, `ServeCluster` over scripted worker handles (who is lost and who is not,
which status a failure becomes), and the API key on the gRPC path (`SwaIngress`) with Serve's
own gRPC context class."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.grpc_util import RayServegRPCContext
from routed_fakes import Done, FakeRouter, Handle, counting_tokens, model_info

from swaserve.cluster import routed
from swaserve.cluster.grpc_server import UNAUTHENTICATED_DETAILS, RpcFailure
from swaserve.cluster.openai_api import api_error
from swaserve.cluster.openai_api.protocol import APIError
from swaserve.cluster.openai_api.responses import ResponseStore, SharedResponseStore, Stored
from swaserve.cluster.routed import InvalidRequest, Unavailable
from swaserve.cluster.router_actor import RouteAnswer
from swaserve.cluster.serve import DirectRouter, ServeAppArgs, ServeCluster, SwaIngress
from swaserve.cluster.serve_worker import SwaWorker
from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.sampling_params import SamplingParams
from swaserve.proto.stream import FinishReason, GenerateChunk
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.worker.engine.engine import RequestError
from swaserve.worker.engine.engine_loop import EngineLoop
from swaserve.worker.runner.parallel import TensorParallelError

PROMPT = [5, 6, 7]
PARAMS = SamplingParams(max_new_tokens=6)
TOKEN = "s3cret"


@pytest.fixture
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="gpt-oss", num_layers=2, sliding_window_size=4)


# ---- SwaWorker -----------------------------------------------------------------------------
class FakeLauncher:
    def __init__(self) -> None:
        self.dead = False

    def check_alive(self) -> None:
        if self.dead:
            raise TensorParallelError("TP rank ended: TP rank 1 (Ray actor)")


class IdleEngine:
    """As much of an `Engine` as an `EngineLoop` without requests touches."""

    def __init__(self, launcher: FakeLauncher | None) -> None:
        self.launcher = launcher
        self.scheduler = SimpleNamespace(running=[], waiting=[])

    def take_kv_events(self) -> list[Any]:
        return []

    def headroom(self) -> None:
        return None

    def has_unfinished_requests(self) -> bool:
        return False


@pytest.fixture
def make_worker() -> Iterator[Callable[[EngineLoop | None], SwaWorker]]:
    """A `SwaWorker` (no Serve replica, no engine) around the given loop; loops are stopped
    afterwards."""
    made: list[SwaWorker] = []

    def make(loop: EngineLoop | None) -> SwaWorker:
        worker = object.__new__(SwaWorker)
        worker.worker_id, worker.loop = "me", loop
        made.append(worker)
        return worker

    yield make
    for worker in made:
        loop, worker.loop = worker.loop, None  # what `__del__` would stop: nothing now
        if loop is not None:
            loop.stop()
            with contextlib.suppress(TensorParallelError):
                loop.wait(10)


def test_a_call_for_another_replica_is_misrouted_not_lost(
    make_worker: Callable[[EngineLoop | None], SwaWorker],
) -> None:
    worker = make_worker(None)

    async def collect() -> list[GenerateChunk | Exception]:
        return [
            c
            async for c in worker.generate_on(
                EngineRequest("r1", PROMPT, PARAMS), worker_id="other"
            )
        ]

    [chunk] = asyncio.run(collect())
    assert isinstance(chunk, GenerateChunk)
    assert (chunk.finished, chunk.finish_reason) == (True, FinishReason.MISROUTED)
    assert chunk.error == (
        "the call for worker other reached me: other is not among the running replicas"
    )


def test_health_check_passes_while_the_loop_runs_and_every_rank_lives(
    make_worker: Callable[[EngineLoop | None], SwaWorker],
) -> None:
    loop = EngineLoop(IdleEngine(FakeLauncher()), "me", report_interval_s=0.01)
    loop.start()
    asyncio.run(make_worker(loop).check_health())
    single = EngineLoop(IdleEngine(None), "me")
    single.start()
    asyncio.run(make_worker(single).check_health())  # TP 1: no launcher


def test_health_check_fails_when_a_tp_rank_died(
    make_worker: Callable[[EngineLoop | None], SwaWorker],
) -> None:
    launcher = FakeLauncher()
    loop = EngineLoop(IdleEngine(launcher), "me")  # not started
    worker = make_worker(loop)
    asyncio.run(worker.check_health())
    launcher.dead = True
    with pytest.raises(TensorParallelError, match="TP rank 1"):
        asyncio.run(worker.check_health())


def test_health_check_fails_once_the_loop_ended(
    make_worker: Callable[[EngineLoop | None], SwaWorker],
) -> None:
    launcher = FakeLauncher()
    failed = EngineLoop(IdleEngine(launcher), "me", report_interval_s=0.01)
    launcher.dead = True  # the idle loop's own rank check ends it
    failed.start()
    with pytest.raises(TensorParallelError):
        failed.wait(10)
    launcher.dead = False  # the loop's error, not the launcher's answer now, fails the check
    with pytest.raises(TensorParallelError, match="TP rank 1"):
        asyncio.run(make_worker(failed).check_health())
    stopped = EngineLoop(IdleEngine(None), "me")
    stopped.start()
    stopped.stop()
    assert stopped.wait(10)
    with pytest.raises(RuntimeError, match="engine loop has ended"):
        asyncio.run(make_worker(stopped).check_health())
    with pytest.raises(RuntimeError, match="has stopped"):
        asyncio.run(make_worker(None).check_health())


# ---- ServeCluster --------------------------------------------------------------------------
class FakeStream:
    """A Serve response stream: `items`, then `error` raised (if any); records `cancel()`."""

    def __init__(self, items: list[Any], error: Exception | None = None) -> None:
        self.items, self.error = items, error
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._items()

    async def _items(self) -> AsyncIterator[Any]:
        for item in self.items:
            yield item
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self.cancelled = True


def chunks(request_id: str, token_ids: list[int], params: SamplingParams, n: int) -> list[Any]:
    """What a worker streams: the "taken" chunk, then the first `n` tokens (all: finished)."""
    tokens = counting_tokens(token_ids, params)
    out: list[Any] = [GenerateChunk(request_id)]
    for i, token in enumerate(tokens[:n]):
        last = i == len(tokens) - 1
        out.append(GenerateChunk(request_id, [token], last, "length" if last else None))
    return out


Behaviour = Callable[[str, list[int], SamplingParams], FakeStream]


def serves() -> Behaviour:
    return lambda rid, ids, params: FakeStream(chunks(rid, ids, params, params.max_new_tokens))


def breaks_after(n: int, error: Exception) -> Behaviour:
    return lambda rid, ids, params: FakeStream(chunks(rid, ids, params, n), error)


def answers(item: Any) -> Behaviour:
    return lambda rid, ids, params: FakeStream([item])


class ScriptedWorkers:
    """The SwaWorker deployment's handle: call k on worker w behaves as `scripts[w][k]`."""

    def __init__(self, scripts: dict[str, list[Behaviour]]) -> None:
        self.scripts = scripts
        self.streams: list[tuple[str, FakeStream]] = []

    def generate_on(self, request: EngineRequest, worker_id: str) -> FakeStream:
        stream = self.scripts[worker_id].pop(0)(
            request.request_id, request.token_ids, request.params
        )
        self.streams.append((worker_id, stream))
        return stream

    def abort_on(self, request_id: str, worker_id: str) -> None:
        pass


class RouterReplica:
    """The SwaRouter deployment: `actor()` hands out its router actor, the next of `actors`
    after the one before died (Serve replaced the replica); `fetches` counts the calls."""

    def __init__(self, *actors: Any) -> None:
        self.actors = list(actors)
        self.fetches = 0

    def actor(self) -> Handle:
        self.fetches += 1
        return Handle(self.actors[0])


def router_replica(router: Any) -> Handle:
    return Handle(RouterReplica(router))


class Raises:
    """An awaitable that raises `error` (a Ray call whose actor died)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __await__(self) -> Generator[None, None, Any]:
        raise self.error
        yield


class RouterActorStub:
    """Records each `finish` when it is called; answers its name, or `ActorDiedError` once
    `dead`."""

    def __init__(self, name: str) -> None:
        self.name, self.dead = name, False
        self.finished: list[str] = []

    def finish(self, request_id: str) -> Any:
        self.finished.append(request_id)
        return Raises(ActorDiedError()) if self.dead else Done(self.name)


def test_the_direct_router_fetches_the_actor_once_and_again_after_it_died() -> None:
    first, second = RouterActorStub("first"), RouterActorStub("second")
    replica = RouterReplica(first, second)
    router = DirectRouter(Handle(replica))

    async def run() -> None:
        assert await router.finish.remote("r1") == "first"
        router.finish.remote("r2")  # not awaited: it went out all the same
        assert first.finished == ["r1", "r2"] and replica.fetches == 1
        first.dead = True
        with pytest.raises(RayActorError):
            await router.finish.remote("r3")
        replica.actors.pop(0)  # Serve replaced the replica; the new one has a new actor
        assert await router.finish.remote("r4") == "second"
        assert replica.fetches == 2
        assert (first.finished, second.finished) == (["r1", "r2", "r3"], ["r4"])

    asyncio.run(run())


def test_the_direct_router_called_off_an_event_loop_calls_when_awaited() -> None:
    """A worker's report is sent from the engine loop's thread (no event loop there) and
    its answer awaited on another: before the actor is known, the call goes out there."""
    actor = RouterActorStub("router")
    router = DirectRouter(Handle(RouterReplica(actor)))
    answer = router.finish.remote("report-1")
    assert actor.finished == []

    async def wait() -> Any:
        return await answer

    assert asyncio.run(wait()) == "router"
    router.finish.remote("report-2")  # the actor is known now: the call goes out at once
    assert actor.finished == ["report-1", "report-2"]


class SlowReplica(RouterReplica):
    """Hands out the actor only once `started` is set (a replica Serve is starting); `asked`
    is set once a fetch is waiting for it."""

    def __init__(self, *actors: Any) -> None:
        super().__init__(*actors)
        self.started = asyncio.Event()
        self.asked = asyncio.Event()

    async def actor(self) -> Handle:  # type: ignore[override]
        self.fetches += 1
        self.asked.set()
        await self.started.wait()
        return Handle(self.actors[0])


def test_the_callers_that_wait_for_the_actor_share_one_fetch() -> None:
    actor = RouterActorStub("router")
    replica = SlowReplica(actor)
    router = DirectRouter(Handle(replica))

    async def run() -> list[Any]:
        calls = [router.finish.remote(f"report-{i}") for i in range(5)]
        await replica.asked.wait()  # the fetch began after every call was made: all wait
        replica.started.set()
        return [await call for call in calls]

    assert asyncio.run(run()) == ["router"] * 5
    assert replica.fetches == 1
    assert actor.finished == [f"report-{i}" for i in range(5)]


def serve_cluster(
    model_dir: Path, scripts: dict[str, list[Behaviour]]
) -> tuple[ServeCluster, FakeRouter, ScriptedWorkers]:
    router, workers = FakeRouter(list(scripts)), ScriptedWorkers(scripts)
    cluster = ServeCluster(
        router_replica(router), Handle(workers), ServeAppArgs(model=str(model_dir))
    )
    cluster.model_info = model_info(model_dir)
    return cluster, router, workers


def generated(cluster: ServeCluster) -> list[int]:
    async def run() -> list[int]:
        return [t async for c in cluster.generate("r1", PROMPT, PARAMS) for t in c.token_ids]

    return asyncio.run(run())


EVERY_TOKEN = counting_tokens(PROMPT, PARAMS)


def test_an_unreachable_worker_is_kept_and_its_request_goes_on(model_dir: Path) -> None:
    unreachable = ActorUnavailableError("Actor is unavailable.", None)
    cluster, router, workers = serve_cluster(
        model_dir, {"w0": [breaks_after(2, unreachable), serves()]}
    )
    assert generated(cluster) == EVERY_TOKEN
    assert router.removed == [] and cluster.lost == {}
    assert router.routed == ["w0", "w0"]
    assert workers.streams[0][1].cancelled  # the broken call was cancelled on the replica


def test_a_dead_worker_is_removed_and_its_request_migrates(model_dir: Path) -> None:
    scripts = {"w0": [breaks_after(2, ActorDiedError())], "w1": [serves()]}
    cluster, router, _ = serve_cluster(model_dir, scripts)
    assert generated(cluster) == EVERY_TOKEN
    assert router.removed == ["w0"] and list(cluster.lost) == ["w0"]
    assert router.routed == ["w0", "w1"]
    assert cluster.migrations == 1
    # The lost attempt tells the router nothing of speed; the one that ran to its end, its tokens.
    assert router.finished == [("r1", None), ("r1", len(EVERY_TOKEN) - 2)]


class LateFinishRouter(FakeRouter):
    """A router that refuses to route an id it still holds, as `Router.route` does, and
    takes a `finish` only when its caller awaits it: an async Ray actor may run a call after
    the caller's next one."""

    def __init__(self, worker_ids: list[str]) -> None:
        super().__init__(worker_ids)
        self.held: set[str] = set()

    def route(self, request_id: str, *args: Any, **kwargs: Any) -> RouteAnswer:
        if request_id in self.held:
            return RouteAnswer("invalid", message=f"request {request_id!r} is already routed")
        answer = super().route(request_id, *args, **kwargs)
        if answer.worker_id is not None:
            self.held.add(request_id)
        return answer

    def finish(self, request_id: str, generated_tokens: int | None = None) -> Any:
        def taken() -> None:
            super(LateFinishRouter, self).finish(request_id, generated_tokens)
            self.held.discard(request_id)

        return LateCall(taken)


class LateCall:
    """What `.remote(...)` returns for a call the actor takes when it is awaited."""

    def __init__(self, call: Callable[[], None]) -> None:
        self.call = call

    def __await__(self) -> Generator[None, None, None]:
        self.call()
        return
        yield  # a generator: `await` takes the call at once


def test_a_caller_that_stops_at_the_last_chunk_still_tells_the_router_the_tokens(
    model_dir: Path,
) -> None:
    """The OpenAI API and the gRPC service return at the chunk that carries the finish reason
    and close the stream there. The router's finish still says the request ran to its end,
    with its tokens (the worker's speed; the in-flight view keeps it as likely cached), and
    the stream ends once the router took it: its id is free at once."""
    router = LateFinishRouter(["w0"])
    workers = ScriptedWorkers({"w0": [serves(), serves()]})
    cluster = ServeCluster(
        router_replica(router), Handle(workers), ServeAppArgs(model=str(model_dir))
    )
    cluster.model_info = model_info(model_dir)

    async def until_the_last_chunk() -> list[int]:
        tokens = []
        async with contextlib.aclosing(cluster.generate("r1", PROMPT, PARAMS)) as stream:
            async for chunk in stream:
                tokens += chunk.token_ids
                if chunk.finished:
                    break
        return tokens

    assert asyncio.run(until_the_last_chunk()) == EVERY_TOKEN
    assert router.held == set()
    assert router.finished == [("r1", len(EVERY_TOKEN))]
    assert asyncio.run(until_the_last_chunk()) == EVERY_TOKEN


def test_a_migrating_request_is_routed_again_after_the_router_took_its_finish(
    model_dir: Path,
) -> None:
    """The lost attempt's finish reaches the router before the request is routed again
    (else the router, still holding the id, refuses it: a 400 for a request that was fine)."""
    router = LateFinishRouter(["w0", "w1"])
    workers = ScriptedWorkers({"w0": [breaks_after(2, ActorDiedError())], "w1": [serves()]})
    cluster = ServeCluster(
        router_replica(router), Handle(workers), ServeAppArgs(model=str(model_dir))
    )
    cluster.model_info = model_info(model_dir)
    assert generated(cluster) == EVERY_TOKEN
    assert router.routed == ["w0", "w1"] and cluster.migrations == 1
    assert router.finished[0] == ("r1", None)


def test_a_stream_ends_after_the_router_took_its_finish_so_its_id_is_free_at_once(
    model_dir: Path,
) -> None:
    """A caller may send a new request with the id of one whose stream just ended, whether
    that one ran to its end or failed: the router has let go of it by then."""
    router = LateFinishRouter(["w0"])
    refused = RequestError("the prompt does not fit the SWA pool")
    workers = ScriptedWorkers({"w0": [serves(), answers(refused), serves()]})
    cluster = ServeCluster(
        router_replica(router), Handle(workers), ServeAppArgs(model=str(model_dir))
    )
    cluster.model_info = model_info(model_dir)
    assert generated(cluster) == EVERY_TOKEN
    assert router.held == set()
    with pytest.raises(InvalidRequest, match="SWA pool"):
        generated(cluster)
    assert router.held == set()
    assert generated(cluster) == EVERY_TOKEN
    assert router.routed == ["w0", "w0", "w0"]


class HungFinishRouter(FakeRouter):
    """A router that never answers a `finish`."""

    def finish(self, request_id: str, generated_tokens: int | None = None) -> Any:
        return asyncio.Event().wait()


def test_a_router_that_takes_no_finish_does_not_hold_the_stream(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(routed, "FINISH_TIMEOUT_S", 0.01)
    router = HungFinishRouter(["w0"])
    workers = ScriptedWorkers({"w0": [serves()]})
    cluster = ServeCluster(
        router_replica(router), Handle(workers), ServeAppArgs(model=str(model_dir))
    )
    cluster.model_info = model_info(model_dir)
    assert generated(cluster) == EVERY_TOKEN


def test_a_misrouted_call_loses_nobody(model_dir: Path) -> None:
    misrouted = GenerateChunk(
        "r1", finished=True, finish_reason=FinishReason.MISROUTED, error="elsewhere"
    )
    cluster, router, _ = serve_cluster(model_dir, {"w0": [answers(misrouted), serves()]})
    assert generated(cluster) == EVERY_TOKEN
    assert router.removed == [] and router.routed == ["w0", "w0"]


def test_a_stopped_worker_is_lost_and_the_last_one_makes_it_a_503_not_a_400(
    model_dir: Path,
) -> None:
    def stopped(worker_id: str) -> Behaviour:
        return answers(RuntimeError(f"worker {worker_id} has stopped"))

    cluster, router, _ = serve_cluster(model_dir, {"w0": [stopped("w0")], "w1": [serves()]})
    assert generated(cluster) == EVERY_TOKEN  # served by the other
    assert router.removed == ["w0"]
    cluster, router, _ = serve_cluster(model_dir, {"w0": [stopped("w0")], "w1": [stopped("w1")]})
    with pytest.raises(Unavailable) as err:
        generated(cluster)
    assert router.removed == ["w0", "w1"]
    assert api_error(err.value).status == 503


def test_a_request_the_engine_refuses_is_a_400_and_loses_nobody(model_dir: Path) -> None:
    refused = RequestError("the prompt does not fit the SWA pool")
    cluster, router, _ = serve_cluster(model_dir, {"w0": [answers(refused)]})
    with pytest.raises(InvalidRequest, match="SWA pool") as err:
        generated(cluster)
    assert router.removed == []
    assert api_error(err.value).status == 400


# ---- SwaIngress: the API key on the gRPC path ---------------------------------------------
class RawContext:
    """What Serve's gRPC proxy wraps into a `RayServegRPCContext`: the call's metadata."""

    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self.metadata = metadata

    def auth_context(self) -> dict[str, Any]:
        return {}

    def code(self) -> None:
        return None

    def details(self) -> None:
        return None

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def trailing_metadata(self) -> list[tuple[str, str]]:
        return []


def ingress(model_dir: Path, api_key: str | None) -> SwaIngress:
    router, workers = FakeRouter(["w0"]), ScriptedWorkers({"w0": [serves(), serves()]})
    made = SwaIngress.__new__(SwaIngress)
    args = ServeAppArgs(model=str(model_dir), api_key=api_key)
    responses = Handle(ResponseStore())
    asyncio.run(SwaIngress.__init__(made, router_replica(router), Handle(workers), responses, args))
    made.cluster.model_info = model_info(model_dir)
    return made


def call_all(made: SwaIngress, metadata: list[tuple[str, str]]) -> tuple[list[Any], list[Any]]:
    """Generate, GetModelInfo, GetLoad and Abort with `metadata`: what each returned (or the
    `RpcFailure` it raised, as Serve's replica sees it) and their contexts."""
    contexts = [RayServegRPCContext(RawContext(metadata)) for _ in range(4)]
    request = pb.GenerateRequest(
        token_ids=PROMPT, sampling_params=pb.SamplingParams(max_new_tokens=3)
    )

    async def generate() -> list[pb.GenerateResponse]:
        return [item async for item in made.Generate(request, grpc_context=contexts[0])]

    calls = [
        generate(),
        made.GetModelInfo(pb.GetModelInfoRequest(), grpc_context=contexts[1]),
        made.GetLoad(pb.GetLoadRequest(), grpc_context=contexts[2]),
        made.Abort(pb.AbortRequest(request_id="none"), grpc_context=contexts[3]),
    ]

    async def run() -> list[Any]:
        return await asyncio.gather(*calls, return_exceptions=True)

    return asyncio.run(run()), contexts


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_grpc_through_serve_needs_the_api_key_when_one_is_set(model_dir: Path) -> None:
    keyed = ingress(model_dir, TOKEN)
    for metadata in ([("application", "swaserve")], [("authorization", "Bearer wrong")]):
        replies, contexts = call_all(keyed, metadata)
        # Serve's proxy answers with the code set on the context when the method raises
        assert [c.code() for c in contexts] == [grpc.StatusCode.UNAUTHENTICATED] * 4
        assert {c.details() for c in contexts} == {UNAUTHENTICATED_DETAILS}
        assert all(isinstance(r, RpcFailure) for r in replies)
    replies, contexts = call_all(keyed, [("authorization", f"Bearer {TOKEN}")])
    assert [c.code() for c in contexts] == [None] * 4
    assert [t for item in replies[0] for t in item.token_ids] == [8, 9, 10]
    assert replies[1].model_name == model_dir.name
    open_ = ingress(model_dir, None)
    replies, contexts = call_all(open_, [])
    assert [c.code() for c in contexts] == [None] * 4
    assert [t for item in replies[0] for t in item.token_ids] == [8, 9, 10]


def test_an_rpc_failure_survives_pickling() -> None:
    """Serve pickles what a replica raises; the proxy reads code and details from it."""
    failure = RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("retry-after-s", "1"),))
    copy = pickle.loads(pickle.dumps(failure))
    assert (copy.code, copy.details, copy.trailing) == (failure.code, "busy", failure.trailing)


def test_ingress_replicas_share_one_response_store() -> None:
    """Two ingress replicas' `SharedResponseStore`s over one store (the SwaResponses
    deployment): what one saves the other finds, a delete is seen by both, and a missing id is
    the 404 a local store gives."""
    store = ResponseStore(capacity=2)
    one, two = SharedResponseStore(Handle(store)), SharedResponseStore(Handle(store))

    async def scenario() -> None:
        await one.save("resp-a", Stored({"id": "resp-a"}, [], "conv-a"))
        assert (await two.get("resp-a")).session == "conv-a"
        await two.delete("resp-a")
        for missing in (one.get("resp-a"), two.delete("resp-a"), ResponseStore().get("x")):
            try:
                await missing
            except APIError as exc:
                assert exc.status == 404 and exc.param == "previous_response_id"
            else:
                raise AssertionError("a missing response was found")
        for i in range(3):  # bounded: the oldest goes
            await one.save(f"r{i}", Stored({}, [], "c"))
        assert store.lookup("r0") is None and store.lookup("r2") is not None

    asyncio.run(scenario())
