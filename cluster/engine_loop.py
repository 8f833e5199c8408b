"""EngineLoop: one engine driven by its own thread, fed by commands, feeding per-request sinks.

The engine is not thread-safe, so exactly one thread touches it: this loop's. Other threads
(an asyncio actor's event loop, the gRPC ingress) talk to it through `submit` / `abort`, which
only queue a command and wake the loop. Each step's outputs go to the sink of their request
(a callable; the worker actor's sink puts them on the request's asyncio queue). Every
`report_interval_s`, and right after a step that changed the cache or the queues, the loop
hands a `WorkerReport` (headroom + the KV events since the last one) to `on_report`.

    loop:  commands (add / abort)  →  step() if there is work, else wait  →  sinks  →  report

A `TensorParallelError` (a dead or hung TP rank) ends the loop: every open request gets a
`WorkerLost` chunk, and `wait()` raises the error, so the caller takes the group down.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from swaserve.proto.messages import WorkerReport
from swaserve.worker import Engine, SamplingParams
from swaserve.worker.engine import RequestOutput

logger = logging.getLogger(__name__)

DEFAULT_REPORT_INTERVAL_S = 0.1


@dataclass(slots=True)
class GenerateChunk:
    """What a worker streams for one request: its new tokens since the previous chunk.

    `finish_reason` is set on the last chunk: "stop" | "length" | "abort" | "error" |
    "worker_lost" | "misrouted"; `error` says why for the last three."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: str | None = None
    worker_id: str = ""  # set by the cluster: the group that served it


WORKER_LOST = "worker_lost"
MISROUTED = "misrouted"  # a replica that was not the one chosen got the call: route again

Sink = Callable[[GenerateChunk], None]


@dataclass(slots=True)
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    sink: Sink
    accepted: Future[None]


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[Engine], Any]
    done: Future[Any]


class EngineLoop:
    """Runs `engine` in a daemon thread (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        worker_id: str,
        *,
        on_report: Callable[[WorkerReport], None] | None = None,
        report_interval_s: float = DEFAULT_REPORT_INTERVAL_S,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.instance_id = uuid.uuid4().hex
        self.on_report = on_report
        self.report_interval_s = report_interval_s
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # open requests; touched by the loop thread only
        self._seq = 0
        self._last_report_s = 0.0
        self._last_counts = (-1, -1)
        self.latest_report: WorkerReport | None = None
        self._failure: BaseException | None = None
        self._stopping = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-{worker_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ---- commands (any thread) ------------------------------------------------------------
    def submit(
        self, request_id: str, token_ids: list[int], params: SamplingParams, sink: Sink
    ) -> Future[None]:
        """Queue a request. The future resolves once the engine took it, or raises its
        `RequestError` (then nothing reaches the sink)."""
        accepted: Future[None] = Future()
        if self._done.is_set():
            accepted.set_exception(RuntimeError(f"worker {self.worker_id} has stopped"))
            return accepted
        self._commands.put(_Add(request_id, token_ids, params, sink, accepted))
        return accepted

    def abort(self, request_id: str) -> None:
        """Stop a request: its sink gets a last chunk with finish reason "abort" (nothing if
        it already ended). Its KV is released at once."""
        self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[Engine], Any]) -> Future[Any]:
        """Run `fn(engine)` on the loop thread between steps (e.g. `Engine.check`); the future
        gets its result or its exception."""
        done: Future[Any] = Future()
        if self._done.is_set():
            done.set_exception(RuntimeError(f"worker {self.worker_id} has stopped"))
            return done
        self._commands.put(_Call(fn, done))
        return done

    def stop(self) -> None:
        """End the loop after the current step; open requests end with "abort"."""
        self._stopping = True
        self._commands.put(None)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the loop ended (True) or `timeout_s` passed (False); re-raises the
        error that ended it."""
        ended = self._done.wait(timeout_s)
        if self._failure is not None:
            raise self._failure
        return ended

    @property
    def num_open(self) -> int:
        return len(self._sinks)

    # ---- the loop thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._report(force=True)
            while not self._stopping:
                self._take_commands(block=not self.engine.has_unfinished_requests())
                if self._stopping:
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    # Report first: a client that sees its turn end and sends the next one
                    # must find that turn's cache in the router already.
                    self._report(force=False)
                    self._dispatch(outputs)
                else:
                    self._check_ranks()
                    self._report(force=False)
        except BaseException as exc:
            self._failure = exc
            logger.error("worker %s: engine loop ended: %s", self.worker_id, exc)
            self._end_all(WORKER_LOST, f"worker {self.worker_id} lost: {exc}")
        else:
            self._end_all("abort", "the worker is shutting down")
        finally:
            self._done.set()
            self._fail_pending_adds()

    def _take_commands(self, *, block: bool) -> None:
        timeout = self._time_to_report() if block else None
        while True:
            try:
                if timeout is not None:
                    command = self._commands.get(timeout=max(timeout, 0.0))
                    timeout = None
                else:
                    command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is None:
                return
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Call):
                try:
                    command.done.set_result(command.fn(self.engine))
                except Exception as exc:
                    command.done.set_exception(exc)
            else:
                self._abort(command.request_id)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.token_ids, command.params, command.request_id)
        except Exception as exc:
            command.accepted.set_exception(exc)
            return
        self._sinks[command.request_id] = command.sink
        command.accepted.set_result(None)

    def _abort(self, request_id: str) -> None:
        sink = self._sinks.pop(request_id, None)
        self.engine.abort(request_id)
        if sink is not None:
            sink(GenerateChunk(request_id, finished=True, finish_reason="abort"))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink(
                GenerateChunk(
                    out.request_id,
                    list(out.new_token_ids),
                    out.finished,
                    out.finish_reason,
                    out.cached_tokens,
                    out.error,
                )
            )

    def _check_ranks(self) -> None:
        launcher = self.engine.launcher
        if launcher is not None:
            launcher.check_alive()  # TensorParallelError ends the loop

    def _time_to_report(self) -> float:
        return self._last_report_s + self.report_interval_s - time.time()

    def _report(self, *, force: bool) -> None:
        """Report when forced, when the interval passed, or after a step that changed the
        cache (KV events) or the running / waiting counts."""
        events = self.engine.take_kv_events()
        scheduler = self.engine.scheduler
        counts = (len(scheduler.running), len(scheduler.waiting))
        due = force or events or counts != self._last_counts or self._time_to_report() <= 0
        if not due:
            return
        headroom = self.engine.headroom()
        self._seq += 1
        now = time.time()
        report = WorkerReport(self.worker_id, self.instance_id, self._seq, now, headroom, events)
        self._last_report_s, self._last_counts = now, counts
        self.latest_report = report
        if self.on_report is not None:
            self.on_report(report)

    def _end_all(self, reason: str, message: str) -> None:
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine may be broken; the chunk still goes out
                logger.debug("abort of %s failed", request_id, exc_info=True)
            sink(GenerateChunk(request_id, finished=True, finish_reason=reason, error=message))
        self._sinks.clear()

    def _fail_pending_adds(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            stopped = RuntimeError(f"worker {self.worker_id} has stopped")
            if isinstance(command, _Add):
                command.accepted.set_exception(stopped)
            elif isinstance(command, _Call):
                command.done.set_exception(stopped)
