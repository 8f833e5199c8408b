"""In-process stand-ins for what a `RoutedCluster` calls (router and worker handles), so that
the ingresses (OpenAI app, gRPC service, Serve transport) run in unit tests without Ray. The
routing and retry logic under test is the real `RoutedCluster`'s."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from swaserve.cluster.ingress_limits import IngressLimits
from swaserve.cluster.routed import ModelInfo, RoutedCluster
from swaserve.cluster.router_actor import RouteAnswer, WorkerStatus
from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.request_limits import RequestLimits
from swaserve.proto.sampling_params import SamplingParams
from swaserve.proto.stream import GenerateChunk
from swaserve.proto.text.tokenizer import TextTokenizer, encode_text

T = TypeVar("T")

VOCAB_SIZE = 262  # the tiny models' byte-level vocabulary


class LoopThread:
    """An asyncio loop in a daemon thread, for servers that the tests' blocking clients call;
    `run(coro)` runs a coroutine there and waits for it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Done:
    """An awaitable that already holds its value (what `.remote(...)` returns here). The call
    took effect when it was made, as a fire-and-forget Ray call would, awaited or not."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Generator[None, None, Any]:
        return self.value
        yield  # a generator: `await` returns `value` at once


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        result = self.fn(*args, **kwargs)
        return (
            result if hasattr(result, "__aiter__") or hasattr(result, "__await__") else Done(result)
        )


class Handle:
    """`handle.method.remote(...)` over a plain object's `method(...)`; `options(...)` is
    accepted and ignored (a stream is whatever the method returns)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def options(self, **_: Any) -> Handle:
        return self

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.target, name))


class FakeRouter:
    """Routes every request to the first worker not removed; records what it was asked."""

    def __init__(self, worker_ids: list[str]) -> None:
        self.worker_ids = list(worker_ids)
        self.removed: list[str] = []
        self.route_timeouts: list[float | None] = []
        self.routed: list[str] = []
        self.sessions: list[str | None] = []  # each route's session key
        self.finished: list[tuple[str, int | None]] = []

    def route(
        self,
        request_id: str,
        token_ids: list[int],
        max_new_tokens: int,
        session_key: str | None = None,
        timeout_s: float | None = None,
    ) -> RouteAnswer:
        self.route_timeouts.append(timeout_s)
        self.sessions.append(session_key)
        live = [w for w in self.worker_ids if w not in self.removed]
        if not live:
            return RouteAnswer("no_workers")
        self.routed.append(live[0])
        return RouteAnswer("routed", live[0])

    def finish(self, request_id: str, generated_tokens: int | None = None) -> None:
        self.finished.append((request_id, generated_tokens))

    def remove_worker(self, worker_id: str) -> None:
        self.removed.append(worker_id)

    def workers(self) -> list[WorkerStatus]:
        return [WorkerStatus(w, None, 0.0, 0) for w in self.worker_ids if w not in self.removed]

    def stats(self) -> dict[str, Any]:
        return {}  # no routing decisions to report


def model_info(model_dir: Path, *, max_model_len: int = 4096) -> ModelInfo:
    return ModelInfo(
        model_name=model_dir.name,
        model_path=str(model_dir),
        architecture="GptOssForCausalLM",
        vocab_size=VOCAB_SIZE,
        tp_size=1,
        eos_token_ids=(257,),
        has_tokenizer=True,
        limits=RequestLimits(
            max_model_len=max_model_len,
            full_pool_tokens=1 << 24,
            page_size=1,
            sliding_window_size=4,
        ),
    )


def counting_tokens(token_ids: list[int], params: SamplingParams) -> list[int]:
    """What a fake worker generates: the prompt's last id + 1, + 2, ... (mod the vocabulary)."""
    return [(token_ids[-1] + i) % VOCAB_SIZE for i in range(1, params.max_new_tokens + 1)]


class FakeCluster(RoutedCluster):
    """A `RoutedCluster` whose workers stream `counting_tokens` in-process."""

    def __init__(
        self,
        model_dir: Path,
        tokenizer: TextTokenizer | None,
        worker_ids: list[str],
        limits: IngressLimits | None = None,
    ) -> None:
        super().__init__(retry_after_s=1.0, limits=limits)
        self.fake_router = FakeRouter(worker_ids)
        self.router = Handle(self.fake_router)
        self.model_info = model_info(model_dir)
        self.tokenizer = tokenizer
        self.aborted: list[tuple[str, str]] = []
        self.params: list[SamplingParams] = []  # of each request streamed, in order

    async def _stream(
        self, worker_id: str, request: EngineRequest
    ) -> AsyncIterator[GenerateChunk | Exception]:
        request_id = request.request_id
        self.params.append(request.params)
        yield GenerateChunk(request_id)  # taken
        tokens = counting_tokens(request.token_ids, request.params)
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            yield GenerateChunk(
                request_id,
                [token],
                finished=last,
                finish_reason="length" if last else None,
                worker_id=worker_id,
            )

    def _abort_on(self, worker_id: str, request_id: str) -> None:
        self.aborted.append((worker_id, request_id))

    def _worker_alive(self, worker_id: str) -> bool:
        return worker_id not in self.lost

    def _lose(self, worker_id: str, why: str) -> None:
        self.lost[worker_id] = why
        self.fake_router.remove_worker(worker_id)

    @property
    def live_workers(self) -> list[str]:
        return [w for w in self.fake_router.worker_ids if w not in self.lost]


class ScriptedCluster(FakeCluster):
    """Streams `script` (text in the model's format, encoded) two tokens per chunk; keeps
    each request."""

    def __init__(self, model_dir: Path, tokenizer: TextTokenizer, script: str) -> None:
        super().__init__(model_dir, tokenizer, ["w0"])
        assert self.model_info is not None
        self.model_info = replace(self.model_info, vocab_size=288)
        self.script = script
        self.requests: list[EngineRequest] = []

    async def _stream(
        self, worker_id: str, request: EngineRequest
    ) -> AsyncIterator[GenerateChunk | Exception]:
        self.requests.append(request)
        yield GenerateChunk(request.request_id)
        assert self.tokenizer is not None
        ids = encode_text(self.tokenizer.tokenizer, self.script)
        for i in range(0, len(ids), 2):
            last = i + 2 >= len(ids)
            yield GenerateChunk(
                request.request_id,
                ids[i : i + 2],
                finished=last,
                finish_reason="stop" if last else None,
                worker_id=worker_id,
            )

    def prompt(self, index: int = -1) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.tokenizer.decode(
            self.requests[index].token_ids, skip_special_tokens=False
        )


@contextlib.contextmanager
def serve_over_http(cluster: RoutedCluster) -> Iterator[str]:
    """The OpenAI HTTP server over `cluster` on its own loop thread: its base URL (`.../v1`);
    both are stopped on exit."""
    from swaserve.cluster.http_server import HttpServer

    loop = LoopThread()
    server = HttpServer(cluster, port=0)
    loop.run(server.start())
    try:
        yield f"http://127.0.0.1:{server.port}/v1"
    finally:
        loop.run(server.stop())
        loop.close()
