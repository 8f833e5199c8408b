"""EngineLoop: one engine driven by its own thread, fed by commands, feeding per-request sinks.

The engine is not thread-safe, so exactly one thread touches it: this loop's. Other threads
(an asyncio actor's event loop, the gRPC ingress) talk to it through `submit` / `abort`, which
only queue a command and wake the loop. Each step's outputs go to the sink of their request
(a callable; the worker actor's sink puts them on the request's asyncio queue); with a
`stream_interval_s`, a request's tokens after its first are held and go together at most
that often (its end at once), so that fewer messages cross the process per token. Every
`report_interval_s`, and right after a step that changed the cache or the queues or took
requests, the loop hands a `WorkerReport` (headroom, the KV events since the last one, the ids
of the requests taken since) to `on_report`. When the router answers that it lost track
(`take_router_answer`, or `request_snapshot`), the next report, sent at once, is a snapshot:
the whole cache as events and every open request.

    loop:  commands (add / abort / call / snapshot)  →  step() if there is work, else wait
           →  report  →  sinks

A `TensorParallelError` (a dead or hung TP rank) ends the loop: every open request gets a
`WorkerLost` chunk, and `wait()` raises the error, so the caller takes the group down.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.messages import WorkerReport
from swaserve.proto.stream import FinishReason, GenerateChunk
from swaserve.worker.engine.engine import Engine, RequestOutput

logger = logging.getLogger(__name__)

DEFAULT_REPORT_INTERVAL_S = 0.1


Sink = Callable[[GenerateChunk], None]


@dataclass(slots=True)
class _Add:
    request: EngineRequest
    sink: Sink
    accepted: Future[None]
    submitted_s: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[Engine], Any]
    done: Future[Any]


@dataclass(slots=True)
class _Snapshot:
    after_seq: int | None


class EngineLoop:
    """Runs `engine` in a daemon thread (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        worker_id: str,
        *,
        on_report: Callable[[WorkerReport], None] | None = None,
        report_interval_s: float = DEFAULT_REPORT_INTERVAL_S,
        stream_interval_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.instance_id = uuid.uuid4().hex
        self.on_report = on_report
        self.report_interval_s = report_interval_s
        self.stream_interval_s = stream_interval_s
        self._clock = clock  # of the stream interval
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | _Snapshot | None] = (
            queue.SimpleQueue()
        )
        self._sinks: dict[str, Sink] = {}  # open requests; touched by the loop thread only
        # Stream interval (loop thread only): when each open request's last chunk with tokens
        # went out, and the tokens held back since.
        self._sent_s: dict[str, float] = {}
        self._held: dict[str, GenerateChunk] = {}
        self._flush_at = math.inf  # no held chunk is due before this (it may be earlier)
        self._admitted: list[str] = []  # taken since the last report (loop thread only)
        self._snapshot_due = False  # the next report is a snapshot (loop thread only)
        self._snapshot_seq = 0  # seq of the last snapshot report
        self._answers: asyncio.AbstractEventLoop | None = None  # awaits the router's answers
        self._answers_lock = threading.Lock()
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
    def submit(self, request: EngineRequest, sink: Sink) -> Future[None]:
        """Queue a request. The future resolves once the engine took it, or raises its
        `RequestError` (then nothing reaches the sink)."""
        accepted: Future[None] = Future()
        if self._done.is_set():
            accepted.set_exception(RuntimeError(f"worker {self.worker_id} has stopped"))
            return accepted
        self._commands.put(_Add(request, sink, accepted))
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

    def request_snapshot(self, after_seq: int | None = None) -> None:
        """Make the next report, sent as soon as the loop sees this, a snapshot report
        (`WorkerReport.snapshot`: the whole cache, every open request). `after_seq`: the
        report whose answer asked for it; ignored when a snapshot was sent after that report
        (the answers to the reports sent before a snapshot still ask for one)."""
        self._commands.put(_Snapshot(after_seq))

    def take_router_answer(self, report_seq: int, answer: Any) -> None:
        """The router's answer to report `report_seq`: True (send a snapshot, see
        `request_snapshot`) or False, or an awaitable of one (what `update.remote(report)`
        returns: a Ray ObjectRef, or a Serve DeploymentResponse). Never blocks: an awaitable
        is awaited on an event loop of this object's own (a daemon thread started by the
        first one). A call that fails (the router died) is logged and dropped: a restarted
        router asks again on a later report."""
        if isinstance(answer, bool):
            if answer:
                self.request_snapshot(report_seq)
            return
        loop = self._answers_loop()
        if loop is not None:  # None: this loop has ended, and so has the router's interest
            asyncio.run_coroutine_threadsafe(self._await_answer(report_seq, answer), loop)

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
                    if self._held:
                        self._flush_due()
                else:
                    self._check_ranks()
                    self._report(force=False)
        except BaseException as exc:
            self._failure = exc
            logger.error("worker %s: engine loop ended: %s", self.worker_id, exc)
            self._end_all(FinishReason.WORKER_LOST, f"worker {self.worker_id} lost: {exc}")
        else:
            self._end_all(FinishReason.ABORT, "the worker is shutting down")
        finally:
            self._done.set()
            self._fail_pending_adds()
            self._close_answers()

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
            elif isinstance(command, _Snapshot):
                after = command.after_seq
                self._snapshot_due |= after is None or after >= self._snapshot_seq
            else:
                self._abort(command.request_id)

    def _add(self, command: _Add) -> None:
        try:
            request = command.request
            self.engine.add_request(
                request.token_ids,
                request.params,
                request.request_id,
                command.submitted_s,
                resumed_tokens=request.resumed_tokens,
            )
        except Exception as exc:
            command.accepted.set_exception(exc)
            return
        self._sinks[request.request_id] = command.sink
        self._admitted.append(request.request_id)
        command.accepted.set_result(None)

    def _abort(self, request_id: str) -> None:
        sink = self._sinks.get(request_id)
        self.engine.abort(request_id)
        if sink is not None:
            self._end(request_id, FinishReason.ABORT)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Each output to its request's sink, as a chunk. With a stream interval, a chunk goes
        out at once only when it carries the request's first tokens or its end, or when the
        interval has passed since the request's last chunk; else its tokens are held and go
        with the next one (or `_flush_due`'s)."""
        now = self._clock()
        for out in outputs:
            request_id = out.request_id
            sink = self._sinks.get(request_id)
            if sink is None:
                continue
            chunk = GenerateChunk(
                request_id,
                list(out.new_token_ids),
                out.finished,
                out.finish_reason,
                out.cached_tokens,
                out.error,
                timings=out.timings,
                logprobs=out.logprobs,
            )
            held = self._held.pop(request_id, None)
            if held is not None:
                held.merge(chunk)
                chunk = held
            if out.finished:
                del self._sinks[request_id]
                self._sent_s.pop(request_id, None)
            elif self.stream_interval_s > 0 and chunk.token_ids:
                last = self._sent_s.get(request_id)
                if last is not None and now - last < self.stream_interval_s:
                    self._hold(request_id, chunk)
                    continue
                self._sent_s[request_id] = now
            sink(chunk)

    def _hold(self, request_id: str, chunk: GenerateChunk) -> None:
        """Keep `chunk` for the request's next one; it is due an interval after the last."""
        self._held[request_id] = chunk
        self._flush_at = min(self._flush_at, self._sent_s[request_id] + self.stream_interval_s)

    def _flush_due(self) -> None:
        """Send the held tokens whose request's interval has passed (its next step may be
        long in coming: a long prefill of others, a retraction). Looks at them only once the
        earliest may be due, not at every step (the running requests' tokens, held in turn,
        go out with their own next output)."""
        now = self._clock()
        if now < self._flush_at:
            return
        self._flush_at = math.inf
        for request_id, chunk in list(self._held.items()):
            sent_s = self._sent_s[request_id]
            if now - sent_s >= self.stream_interval_s:
                del self._held[request_id]
                self._sent_s[request_id] = now
                self._sinks[request_id](chunk)
            else:
                self._flush_at = min(self._flush_at, sent_s + self.stream_interval_s)

    def _end(self, request_id: str, reason: FinishReason, error: str | None = None) -> None:
        """The request's last chunk, after the tokens held for it."""
        sink = self._sinks.pop(request_id)
        self._sent_s.pop(request_id, None)
        chunk = self._held.pop(request_id, None) or GenerateChunk(request_id)
        chunk.merge(GenerateChunk(request_id, finished=True, finish_reason=reason, error=error))
        sink(chunk)

    def _check_ranks(self) -> None:
        launcher = self.engine.launcher
        if launcher is not None:
            launcher.check_alive()  # TensorParallelError ends the loop

    def _time_to_report(self) -> float:
        return self._last_report_s + self.report_interval_s - time.time()

    def _report(self, *, force: bool) -> None:
        """Report when forced, when a snapshot is due, when the interval passed, or after a
        step that changed the cache (KV events) or the running / waiting counts, or after
        requests were taken. A snapshot report carries the whole cache instead of the events
        (`Engine.kv_snapshot_events`, which drops those) and lists every open request."""
        snapshot = self._snapshot_due
        events = self.engine.kv_snapshot_events() if snapshot else self.engine.take_kv_events()
        scheduler = self.engine.scheduler
        counts = (len(scheduler.running), len(scheduler.waiting))
        due = force or snapshot or events or self._admitted or counts != self._last_counts
        if not due and self._time_to_report() > 0:
            return
        admitted = [*self._admitted, *self._sinks] if snapshot else self._admitted
        headroom = self.engine.headroom()
        self._seq += 1
        now = time.time()
        report = WorkerReport(
            self.worker_id,
            self.instance_id,
            self._seq,
            now,
            headroom,
            events,
            admitted_request_ids=tuple(dict.fromkeys(admitted)),
            snapshot=snapshot,
        )
        self._last_report_s, self._last_counts = now, counts
        self._admitted = []
        if snapshot:
            self._snapshot_due, self._snapshot_seq = False, self._seq
        self.latest_report = report
        if self.on_report is not None:
            self.on_report(report)

    # ---- the router's answers (their own thread) ------------------------------------------
    def _answers_loop(self) -> asyncio.AbstractEventLoop | None:
        with self._answers_lock:
            if self._done.is_set():
                return None
            if self._answers is None:
                self._answers = asyncio.new_event_loop()
                threading.Thread(
                    target=self._answers.run_forever,
                    name=f"answers-{self.worker_id}",
                    daemon=True,
                ).start()
            return self._answers

    async def _await_answer(self, report_seq: int, answer: Any) -> None:
        try:
            resync = await answer
        except Exception as exc:
            logger.info("worker %s: no answer to report %d: %s", self.worker_id, report_seq, exc)
            return
        if resync:
            self.request_snapshot(report_seq)

    def _close_answers(self) -> None:
        """Stop the answers' event loop (answers still awaited are dropped)."""
        with self._answers_lock:
            loop, self._answers = self._answers, None
        if loop is not None:
            asyncio.run_coroutine_threadsafe(_cancel_all_and_stop(), loop)

    def _end_all(self, reason: FinishReason, message: str) -> None:
        for request_id in list(self._sinks):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine may be broken; the chunk still goes out
                logger.debug("abort of %s failed", request_id, exc_info=True)
            self._end(request_id, reason, message)

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


async def _cancel_all_and_stop() -> None:
    """Cancel every other task of the running loop, let them end, then stop the loop."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.get_running_loop().stop()
