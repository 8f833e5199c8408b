"""RoutedCluster: what an ingress calls — route by the router, stream from the chosen worker,
retry where that is safe — whatever runs the workers (Ray actor groups for `swaserve serve`,
the replicas of a Ray Serve deployment for the Serve app).

    generate(request)  →  router: route (prefix, SWA window, headroom)  →  worker id
                       →  that worker: stream chunks  →  caller
                       worker lost: drop it, route prompt + tokens streamed so far again
                       (migration; the caller sees one stream); after `max_attempts`
                       workers or past the client's deadline: Unavailable

Subclasses say how to reach a worker (`_stream`, `_abort_on`), whether it lives
(`_worker_alive`) and what to do when one is lost (`_lose`). `self.router` is a handle whose
methods are called as `await handle.method.remote(...)`: a Ray actor or a Serve deployment.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from swaserve.cluster.ingress_limits import ClientLimiter, IngressLimits, Lease, Refusal
from swaserve.cluster.model_info import ModelInfo
from swaserve.cluster.router_actor import RouteAnswer, WorkerStatus
from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.grammar import check_grammar
from swaserve.proto.sampling_params import SamplingParams
from swaserve.proto.stream import FinishReason, GenerateChunk, RequestTimings
from swaserve.proto.text.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)


BREAKDOWNS_KEPT = 10_000
FINISH_TIMEOUT_S = 10.0
"""How long a stream's end, or a request's next route, waits for the router to take a finish
(it takes one in milliseconds; a router that hangs must not hold the caller)."""


@dataclass(frozen=True, slots=True)
class TTFTBreakdown:
    """One request's time to first token, in parts: `route_s` from asking the router to its
    answer (its decision and its queue), then the worker's part (`RequestTimings`: queued in
    the engine, then prefill steps; None from a worker that sends none). `first_token_s`:
    from asking the router to the first tokens here; beyond the parts' sum, that is the way
    to the engine and back, with the wait for the engine loop to take the request
    (`transport_s`, of which `RequestTimings.loop_wait_s`). What the client saw beyond it is
    its ingress."""

    request_id: str
    worker_id: str
    route_s: float
    cached_tokens: int
    worker: RequestTimings | None
    first_token_s: float = 0.0

    @property
    def transport_s(self) -> float | None:
        """The first token's time not spent routing or in the engine's queue and prefill: the
        way there and back and the wait for the loop (`loop_wait_s`); None without the
        worker's timings."""
        if self.worker is None:
            return None
        return self.first_token_s - self.route_s - self.worker.queued_s - self.worker.prefill_s


class ClusterError(Exception):
    """Base of the errors the cluster gives its ingresses (each maps to one status code)."""


class InvalidRequest(ClusterError):
    """The request can never be served as it is (INVALID_ARGUMENT / HTTP 400). `field`: the
    request field at fault when known (`prompt`, the max-tokens field, `stop`,
    `structured_outputs`)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ClusterBusy(ClusterError):
    """No worker has room and the router's queue is full or the wait ran out
    (RESOURCE_EXHAUSTED / HTTP 429). `retry_after_s`: a hint for the client."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RateLimited(ClusterBusy):
    """The client is over its own budget (`IngressLimits`: rate or open requests), whatever
    the fleet's room (RESOURCE_EXHAUSTED / HTTP 429 with a retry hint)."""


class Unavailable(ClusterError):
    """Draining, no worker left (and none coming back in time), or the request was lost on
    `max_attempts` workers or past its deadline (UNAVAILABLE / HTTP 503)."""


class GenerationFailed(ClusterError):
    """The worker's step failed for this request (INTERNAL / HTTP 500)."""


class WorkerLost(Exception):
    """Raised by `_stream` when the worker went away (its process, or its TP group)."""


class _Misrouted(Exception):
    """The call reached a worker other than the one chosen: route again, lose nobody."""


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def check_request(info: ModelInfo, token_ids: list[int], params: SamplingParams) -> None:
    """Raise `InvalidRequest` for what no worker can serve (the engine checks again)."""
    if not token_ids:
        raise InvalidRequest("the prompt is empty")
    bad = next((t for t in token_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
    refused = info.limits.check(len(token_ids), params.max_new_tokens)
    if refused is not None:
        raise InvalidRequest(refused.message)
    try:
        params.check_vocab(info.vocab_size)
        if params.structured_outputs is not None:
            check_grammar(params.structured_outputs)  # syntax and keywords; workers compile
    except ValueError as exc:  # GrammarError too
        raise InvalidRequest(str(exc)) from None


class RoutedCluster:
    """See the module docstring."""

    model_info: ModelInfo | None
    router_errors: tuple[type[BaseException], ...] = ()  # a call that met the router's death

    def __init__(
        self, retry_after_s: float, max_attempts: int = 3, limits: IngressLimits | None = None
    ) -> None:
        self.retry_after_s = retry_after_s
        self.limits = limits or IngressLimits()
        self.clients = ClientLimiter(self.limits)  # every ingress of this process shares it
        self.max_attempts = max_attempts  # workers a request may try before it fails
        self.migrations = 0  # requests moved to another worker after streaming tokens
        self.router: Any = None
        self.model_info: ModelInfo | None = None
        self.tokenizer: TextTokenizer | None = None
        self.draining = False
        self.lost: dict[str, str] = {}  # worker id -> why it was dropped
        self._closing = False
        self._open: dict[str, str] = {}  # request id -> the worker serving it
        # Where the time to first token of the latest requests went (`TTFTBreakdown`).
        self.breakdowns: collections.deque[TTFTBreakdown] = collections.deque(
            maxlen=BREAKDOWNS_KEPT
        )
        # Called with each breakdown as it is taken (`ServingMetrics.watch`).
        self.on_ttft_breakdown: Callable[[TTFTBreakdown], None] | None = None
        self._ids = itertools.count()

    # ---- what a subclass provides ----------------------------------------------------------
    def _stream(
        self, worker_id: str, request: EngineRequest
    ) -> AsyncIterator[GenerateChunk | Exception]:
        """The worker's items: a first empty chunk once it took the request (or the
        `RequestError` that refused it), then chunks. Raises `WorkerLost`."""
        raise NotImplementedError

    def _abort_on(self, worker_id: str, request_id: str) -> None:
        """Tell the worker to abort the request (fire and forget)."""
        raise NotImplementedError

    def _worker_alive(self, worker_id: str) -> bool:
        raise NotImplementedError

    def _lose(self, worker_id: str, why: str) -> None:
        """Take a lost worker out of service (and out of the router)."""
        raise NotImplementedError

    @property
    def live_workers(self) -> list[str]:
        raise NotImplementedError

    async def _await_worker(self, deadline: float | None) -> bool:
        """No worker is registered: wait for one that is coming back (until `deadline`);
        True if one joined. By default none is coming."""
        return False

    async def ready(self) -> None:
        """Wait until `model_info` is known (a Serve ingress learns it from a worker)."""

    # ---- requests ------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{time.time_ns():x}-{next(self._ids)}"

    def check_request(
        self, token_ids: list[int], params: SamplingParams, *, max_new_name: str = "max_new_tokens"
    ) -> None:
        """Raise `InvalidRequest` for what no worker can serve or this server's caps refuse
        (`IngressLimits`; the message names `max_new_name` for max_new_tokens)."""
        assert self.model_info is not None
        refused = self.limits.refusal(len(token_ids), params, max_new_name=max_new_name)
        if refused is not None:
            raise InvalidRequest(refused[1], refused[0])
        check_request(self.model_info, token_ids, params)

    def admit(self, client: str) -> Lease:
        """The client's place for one request (`IngressLimits`' rate and open requests);
        release it when the request ends. Raises `RateLimited` when the client is over its
        budget."""
        lease = self.clients.acquire(client)
        if isinstance(lease, Refusal):
            raise RateLimited(lease.message, lease.retry_after_s)
        return lease

    async def generate(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        *,
        session_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[GenerateChunk]:
        """Stream the request's chunks (`worker_id` set on each). Raises a `ClusterError`.
        `timeout_s`: what is left of the client's deadline; it bounds the router's queue wait
        and the migrations. Closing the iterator early aborts the request on its worker and
        frees its KV."""
        if self.draining or self._closing:
            raise Unavailable("the server is draining; retry on another replica")
        await self.ready()
        self.check_request(token_ids, params)
        if timeout_s is not None and timeout_s <= 0:
            raise ClusterBusy(f"request {request_id}: its deadline has passed", self.retry_after_s)
        if request_id in self._open:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        self._open[request_id] = ""  # held from here: a duplicate is refused, not mixed in
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            # aclosing: a caller that leaves early closes the attempt at once (abort, KV freed)
            attempts = self._attempts(request_id, token_ids, params, session_id, deadline)
            async with contextlib.aclosing(attempts) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._open.pop(request_id, None)

    async def _attempts(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        session_id: str | None,
        deadline: float | None,
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Route and stream. A worker lost mid-request is dropped and the request migrates:
        it is routed again with the tokens streamed so far appended to its prompt (the new
        worker's prefix cache may hold part of them) and asks for the tokens still to come,
        so the caller sees one stream. Greedy and seeded requests continue exactly
        (`seed_for_position`); usage keeps the first attempt's cached tokens."""
        sent: list[int] = []  # tokens streamed to the caller so far
        cached: int | None = None  # the first attempt's cached_tokens
        failures = 0
        finishing: Any = None  # the router's finish of the last attempt, still to be awaited
        try:
            while True:
                if finishing is not None:
                    # The router actor is async: Ray does not keep its calls in submission order, so
                    # a finish not awaited could be taken after the next route (which then finds
                    # the id still routed, "already routed or queued"), or after it, undoing it.
                    await self._await_finish(finishing)
                    finishing = None
                prompt = token_ids + sent if sent else token_ids
                left = params.max_new_tokens - len(sent)
                if left <= 0:  # the lost chunk was only the finish: the request is complete
                    yield GenerateChunk(
                        request_id,
                        finished=True,
                        finish_reason=FinishReason.LENGTH,
                        cached_tokens=cached or 0,
                    )
                    return
                attempt = params if not sent else params.model_copy(update={"max_new_tokens": left})
                worker: str | None = None
                finished = False
                generated: int | None = None  # tokens of an attempt that ran to its end
                try:
                    asked_s = time.monotonic()
                    worker = await self._route(request_id, prompt, attempt, session_id, deadline)
                    route_s = time.monotonic() - asked_s
                    self._open[request_id] = worker
                    request = EngineRequest(request_id, prompt, attempt, len(sent))
                    async for item in self._stream(worker, request):
                        if isinstance(item, ValueError):  # the engine refused it (RequestError)
                            finished = True
                            if sent:
                                raise Unavailable(
                                    f"request {request_id} could not move to {worker}: {item}"
                                )
                            raise InvalidRequest(str(item))
                        if isinstance(item, Exception):  # e.g. "worker has stopped"
                            raise WorkerLost(str(item))
                        if item.finish_reason == FinishReason.MISROUTED:
                            finished = True
                            raise _Misrouted(item.error or "")
                        if item.finish_reason == FinishReason.WORKER_LOST:
                            raise WorkerLost(item.error)
                        if item.finish_reason == FinishReason.ERROR:
                            finished = True
                            raise GenerationFailed(item.error or "the worker's step failed")
                        item.worker_id = item.worker_id or worker
                        finished = item.finished
                        if item.token_ids or item.finished:  # not the "taken" chunk
                            if cached is None:
                                cached = item.cached_tokens
                                first_s = time.monotonic() - asked_s
                                breakdown = TTFTBreakdown(  # the worker that served it
                                    request_id,
                                    item.worker_id,
                                    route_s,
                                    cached,
                                    item.timings,
                                    first_s,
                                )
                                self.breakdowns.append(breakdown)
                                if self.on_ttft_breakdown is not None:
                                    try:  # metrics must never fail a request
                                        self.on_ttft_breakdown(breakdown)
                                    except Exception:
                                        logger.exception("recording %s's first token", request_id)
                            item.cached_tokens = cached
                            sent.extend(item.token_ids)
                            if finished:  # before the yield: a caller may stop at this chunk
                                generated = left - (params.max_new_tokens - len(sent))
                            yield item
                        if finished:
                            break
                    else:
                        raise WorkerLost("the stream ended early")
                except (WorkerLost, _Misrouted) as exc:
                    assert worker is not None  # routing itself does not lose workers
                    finished = True  # nothing left to abort on a lost worker
                    if isinstance(exc, WorkerLost):
                        self._lose(worker, f"lost during request {request_id}: {exc}")
                    failures += 1
                    self.migrations += bool(sent)
                    if failures >= self.max_attempts or _past(deadline):
                        raise Unavailable(
                            f"request {request_id}: gave up after {failures} attempts; the last "
                            f"worker ({worker}) was lost: {exc}"
                        ) from exc
                    logger.warning(
                        "request %s: %s after losing %s (%d tokens streamed)",
                        request_id,
                        "migrating" if sent else "retrying",
                        worker,
                        len(sent),
                    )
                finally:
                    # Also when the caller left while the request was queued in the router. A run
                    # to its end tells the router how many tokens it took (the worker's speed).
                    finishing = self.router.finish.remote(request_id, generated)
                    if worker is not None and not finished and self._worker_alive(worker):
                        self._abort_on(worker, request_id)
                if generated is not None:
                    # The stream ends once the router let go of the id: a caller may reuse it at
                    # once (the router refuses an id it still holds). Its last tokens are out.
                    await self._await_finish(finishing)
                    return
        except (Exception, GeneratorExit):
            # An error ends the stream too, and so does a caller that closes it (at the chunk
            # with the finish reason, or early): either may use the same id again at once.
            if finishing is not None:
                await self._await_finish(finishing)
            raise

    async def _await_finish(self, finishing: Any) -> None:
        """Wait for the router to have taken a finish (a router that died with it forgot the
        request anyway), at most `FINISH_TIMEOUT_S`."""
        try:
            await asyncio.wait_for(finishing, FINISH_TIMEOUT_S)
        except self.router_errors as exc:
            logger.warning("the router died before it took a finish: %s", exc)
        except TimeoutError:
            logger.warning("the router took no finish within %g s", FINISH_TIMEOUT_S)

    async def _route(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        session_id: str | None,
        deadline: float | None = None,
    ) -> str:
        router_failures = 0
        while True:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                answer: RouteAnswer = await self.router.route.remote(
                    request_id, token_ids, params.max_new_tokens, session_id, timeout
                )
            except self.router_errors as exc:  # the router died; its supervisor restarts it
                router_failures += 1
                if router_failures >= self.max_attempts or _past(deadline):
                    raise Unavailable(f"the router is unavailable: {exc}") from exc
                logger.warning("request %s: the router died; routing again", request_id)
                await asyncio.sleep(0.1 * router_failures)
                continue
            if answer.outcome in ("overloaded", "expired"):
                raise ClusterBusy(
                    f"request {request_id}: no worker has KV headroom ({answer.outcome}, "
                    f"{answer.queue_len} queued); retry later",
                    self.retry_after_s,
                )
            if answer.outcome == "no_workers":
                if await self._await_worker(deadline):
                    continue  # a recreated worker joined
                raise Unavailable("no worker is serving")
            if answer.outcome == "invalid":
                raise InvalidRequest(answer.message)
            assert answer.worker_id is not None
            if self._worker_alive(answer.worker_id):
                return answer.worker_id
            await self.router.finish.remote(request_id)  # raced with its removal: route again

    async def abort(self, request_id: str) -> bool:
        """Abort an open request (its stream ends with "abort"); False if none is open."""
        worker = self._open.get(request_id)
        if worker is None or not self._worker_alive(worker):
            return False
        self._abort_on(worker, request_id)
        return True

    # ---- queries -------------------------------------------------------------------------
    async def load(self) -> list[WorkerStatus]:
        """The router's view of every live worker: last headroom, report age, load."""
        statuses = await self._ask_router("workers")
        return [s for s in statuses if self._worker_alive(s.worker_id)]

    async def router_stats(self) -> dict[str, Any]:
        return await self._ask_router("stats")

    async def _ask_router(self, method: str, *args: Any) -> Any:
        """A query to the router, asked again when the call met the router's death (its
        supervisor restarts it; calls made meanwhile wait for the new one)."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return await getattr(self.router, method).remote(*args)
            except self.router_errors as exc:
                if attempt >= self.max_attempts:
                    raise Unavailable(f"the router is unavailable: {exc}") from exc
                await asyncio.sleep(0.1 * attempt)

    @property
    def num_open(self) -> int:
        return len(self._open)

    def open_on(self, worker_id: str) -> int:
        """Requests open on `worker_id` (streaming from it)."""
        return sum(w == worker_id for w in self._open.values())

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, then wait up to `timeout_s` for the open ones; True if all
        ended."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._open
