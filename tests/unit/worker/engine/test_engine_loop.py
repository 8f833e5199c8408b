"""EngineLoop without Ray: one engine thread, commands in, chunks and reports out."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.kv_events import KVCleared
from swaserve.proto.messages import WorkerReport
from swaserve.proto.stream import GenerateChunk
from swaserve.router.exact_view import ExactCacheView
from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.engine.engine import RequestError
from swaserve.worker.engine.engine_loop import EngineLoop


@pytest.fixture
def engine(tiny_model_factory: Callable[..., Path]) -> Iterator[Engine]:
    model = tiny_model_factory(arch="gpt-oss", num_layers=2, sliding_window_size=4)
    engine = Engine(EngineConfig(model=str(model), device="cpu", max_total_tokens=512))
    yield engine
    engine.shutdown()


class Collector:
    def __init__(self) -> None:
        self.chunks: queue.SimpleQueue[GenerateChunk] = queue.SimpleQueue()

    def __call__(self, chunk: GenerateChunk) -> None:
        self.chunks.put(chunk)

    def until_finished(self, timeout_s: float = 30.0) -> list[GenerateChunk]:
        out = []
        while not out or not out[-1].finished:
            out.append(self.chunks.get(timeout=timeout_s))
        return out


class HeldAtFirstToken(Collector):
    """A sink that keeps the loop's thread inside its first chunk with tokens until `go` is
    set: the request stays open, one token in, whatever the test does meanwhile (the loop
    takes the commands queued by then before its next step)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self._held = False

    def __call__(self, chunk: GenerateChunk) -> None:
        super().__call__(chunk)
        if chunk.token_ids and not self._held:
            self._held = True
            assert self.go.wait(60), "the test never let the loop go on"


def test_streams_the_tokens_of_generate_and_reports(engine: Engine) -> None:
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 9]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    engine.flush_cache()
    reports: list[WorkerReport] = []
    loop = EngineLoop(engine, "w0", on_report=reports.append, report_interval_s=0.01)
    loop.start()
    try:
        sinks = [Collector(), Collector()]
        for i, prompt in enumerate(prompts):
            loop.submit(EngineRequest(f"r{i}", prompt, params), sinks[i]).result(10)
        for i, sink in enumerate(sinks):
            chunks = sink.until_finished()
            assert [t for c in chunks for t in c.token_ids] == expected[i]
            assert chunks[-1].finish_reason == ("length" if len(expected[i]) == 6 else "stop")
            timed = [c for c in chunks if c.timings is not None]
            assert len(timed) == 1 and timed[0].token_ids  # the chunk of the first token
        assert loop.num_open == 0
    finally:
        loop.stop()
        loop.wait(10)
    assert [r.seq for r in reports] == list(range(1, len(reports) + 1))
    assert len({r.instance_id for r in reports}) == 1
    assert any(r.events for r in reports)  # the prompts entered the cache
    assert reports[-1].headroom.num_running == 0


def test_bad_request_fails_its_future_and_abort_ends_the_stream(engine: Engine) -> None:
    loop = EngineLoop(engine, "w0")
    loop.start()
    try:
        with pytest.raises(RequestError):
            loop.submit(EngineRequest("bad", [10_000], SamplingParams()), Collector()).result(10)
        sink = HeldAtFirstToken()
        long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
        loop.submit(EngineRequest("long", [1, 2, 3], long), sink).result(10)
        first = sink.chunks.get(timeout=30)
        assert first.token_ids
        loop.abort("long")
        sink.go.set()
        chunks = sink.until_finished()
        assert [c.finish_reason for c in chunks] == ["abort"]  # no step ran before the abort
        assert loop.num_open == 0
    finally:
        loop.stop()
        loop.wait(10)
    engine.check()
    head = engine.headroom()
    assert head.full_free_tokens + head.full_evictable_tokens == head.full_total_tokens


def test_a_request_that_waits_for_the_step_under_way_says_how_long(engine: Engine) -> None:
    """`RequestTimings.loop_wait_s`: from `submit` to the loop's adding the request, which
    happens between steps; here the loop is held inside a step's dispatch meanwhile."""
    loop = EngineLoop(engine, "w0")
    loop.start()
    try:
        held = HeldAtFirstToken()
        long = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        loop.submit(EngineRequest("long", [1, 2, 3], long), held).result(10)
        assert held.chunks.get(timeout=30).token_ids  # the loop is inside its dispatch now
        sink = Collector()
        taken = loop.submit(EngineRequest("late", [4, 5, 6], long), sink)
        submitted_s = time.monotonic()
        released_s = time.monotonic()  # the loop cannot take it before `go` is set
        held.go.set()
        taken.result(10)
        first = next(c for c in sink.until_finished() if c.timings is not None)
        assert first.timings.loop_wait_s >= released_s - submitted_s >= 0
        held.until_finished()
    finally:
        loop.stop()
        loop.wait(10)
    engine.check()


def test_stop_ends_open_requests_and_refuses_new_ones(engine: Engine) -> None:
    loop = EngineLoop(engine, "w0")
    loop.start()
    sink = HeldAtFirstToken()
    long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    loop.submit(EngineRequest("long", [4, 5, 6], long), sink).result(10)
    assert sink.chunks.get(timeout=30).token_ids
    loop.stop()
    sink.go.set()
    assert loop.wait(10)
    assert sink.until_finished()[-1].finish_reason == "abort"
    with pytest.raises(RuntimeError, match="stopped"):
        loop.submit(EngineRequest("late", [1], long), Collector()).result(1)
    engine.check()


class Reports:
    """The loop's reports, in order; `until(pred)` waits for the first new one that matches."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[WorkerReport] = queue.SimpleQueue()
        self.all: list[WorkerReport] = []

    def __call__(self, report: WorkerReport) -> None:
        self.all.append(report)
        self.queue.put(report)

    def until(
        self, pred: Callable[[WorkerReport], bool], timeout_s: float = 30.0
    ) -> list[WorkerReport]:
        """The reports up to and including the first one that matches `pred`."""
        out = [self.queue.get(timeout=timeout_s)]
        while not pred(out[-1]):
            out.append(self.queue.get(timeout=timeout_s))
        return out


def view_pages(*event_lists: list) -> dict[int, bool]:
    view = ExactCacheView(1)
    for events in event_lists:
        assert view.apply(0, events) == 0
    return view.pages(0)


def test_reports_list_the_requests_taken_and_a_snapshot_replaces_the_stream(
    engine: Engine,
) -> None:
    reports = Reports()
    loop = EngineLoop(engine, "w0", on_report=reports, report_interval_s=3600.0)
    loop.start()
    try:
        params = SamplingParams(max_new_tokens=4, temperature=0.0)
        sink = Collector()
        loop.submit(EngineRequest("r0", [1, 2, 3, 4, 5, 6], params), sink).result(10)
        sink.until_finished()
        loop.submit(EngineRequest("r1", [1, 2, 3, 4, 7, 7], params), sink).result(10)
        sink.until_finished()
        long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
        held = HeldAtFirstToken()
        loop.submit(EngineRequest("long", [9, 8, 7, 6, 5], long), held).result(10)
        assert held.chunks.get(timeout=30).token_ids  # it runs, and stays open until aborted
        before = reports.until(lambda r: "long" in r.admitted_request_ids)
        # Each request is listed once, in the first report after the engine took it.
        listed = [rid for r in before for rid in r.admitted_request_ids]
        assert listed == ["r0", "r1", "long"]
        loop.request_snapshot()
        held.go.set()
        stream = before + reports.until(lambda r: r.snapshot)
        snap = stream[-1]
        assert snap.seq == stream[-2].seq + 1 and snap.admitted_request_ids == ("long",)
        assert isinstance(snap.events[0], KVCleared) and snap.events[1:]
        assert view_pages(*(r.events for r in stream[:-1])) == view_pages(snap.events)
        loop.abort("long")
        held.until_finished()
        loop.submit(EngineRequest("r2", [1, 2, 3, 4, 5, 6, 6, 6], params), sink).result(10)
        sink.until_finished()  # reports go out before the chunks: all of them are in
        after = []
        while not reports.queue.empty():
            after.append(reports.queue.get())
        assert after and not any(r.snapshot for r in after) and any(r.events for r in after)
        full = view_pages(*(r.events for r in stream[:-1] + after))
        assert view_pages(snap.events, *(r.events for r in after)) == full
    finally:
        loop.stop()
        loop.wait(10)
    assert [r.seq for r in reports.all] == list(range(1, len(reports.all) + 1))
    assert full == view_pages(engine.kv_snapshot_events())  # the loop has ended


def test_router_answers_ask_for_a_snapshot_unless_one_was_sent_after(engine: Engine) -> None:
    reports = Reports()
    loop = EngineLoop(engine, "w0", on_report=reports, report_interval_s=3600.0)
    loop.start()
    try:
        first = reports.until(lambda r: True)[0]
        loop.take_router_answer(first.seq, False)
        loop.take_router_answer(first.seq, True)
        snap = reports.until(lambda r: r.snapshot)[-1]

        async def answer() -> bool:  # what awaiting a Ray ObjectRef or a Serve response gives
            return True

        loop.take_router_answer(snap.seq, answer())  # answered on the loop's answers thread
        again = reports.until(lambda r: r.snapshot)[-1]
        assert again.seq > snap.seq
        # An answer to a report sent before the latest snapshot asks for nothing: once the
        # loop took the command, no snapshot is due and none was sent.
        loop.request_snapshot(after_seq=again.seq - 1)
        due = loop.call(lambda _: loop._snapshot_due).result(10)
        assert not due and not any(r.snapshot and r.seq > again.seq for r in reports.all)
    finally:
        loop.stop()
        loop.wait(10)


class Clock:
    """The stream interval's clock, moved by the test (or by a sink) only."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_stream_interval_holds_the_tokens_after_the_first_until_it_passes(
    engine: Engine,
) -> None:
    """The first token goes at once, the end at once with what was held; in between a
    request's tokens leave only once the interval has passed since its last chunk: here
    never (the clock stands still), then at every step (each chunk moves the clock on by
    the interval)."""
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    expected = engine.generate([[1, 2, 3, 4, 5]], params)[0].token_ids
    engine.flush_cache()
    clock = Clock()
    loop = EngineLoop(engine, "w0", stream_interval_s=1.0, clock=clock)
    loop.start()
    try:
        still = Collector()
        loop.submit(EngineRequest("still", [1, 2, 3, 4, 5], params), still).result(10)
        chunks = still.until_finished()
        assert [len(c.token_ids) for c in chunks] == [1, 5]
        assert [t for c in chunks for t in c.token_ids] == expected
        assert chunks[0].timings is not None and chunks[-1].finish_reason == "length"

        class Ticking(Collector):
            def __call__(self, chunk: GenerateChunk) -> None:
                clock.now += 1.0
                super().__call__(chunk)

        ticking = Ticking()
        loop.submit(EngineRequest("ticking", [1, 2, 3, 4, 5], params), ticking).result(10)
        chunks = ticking.until_finished()
        assert [len(c.token_ids) for c in chunks] == [1] * 6  # one per step, as without
        assert [t for c in chunks for t in c.token_ids] == expected
    finally:
        loop.stop()
        loop.wait(10)
    engine.check()


def test_held_tokens_go_with_an_abort_and_once_their_interval_passes(engine: Engine) -> None:
    """An abort's last chunk carries the tokens held for the request; held tokens whose
    interval has passed go out after the next step even if the request has no output in it
    (`_flush_due`)."""
    long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    twelve = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    expected = engine.generate([[1, 2, 3]], twelve)[0].token_ids
    engine.flush_cache()
    loop = EngineLoop(engine, "w0", stream_interval_s=1.0, clock=Clock())
    loop.start()
    try:
        sink = Collector()
        loop.submit(EngineRequest("long", [1, 2, 3], long), sink).result(10)
        first = sink.chunks.get(timeout=30)
        assert len(first.token_ids) == 1

        def generated(e: Engine) -> int:
            return len(e.scheduler.running[0].output_ids)

        while loop.call(generated).result(10) < 12:  # the steps go on; their tokens are held
            pass
        assert sink.chunks.empty()
        loop.abort("long")
        (last,) = sink.until_finished()
        assert last.finish_reason == "abort" and len(last.token_ids) >= 11
        assert [*first.token_ids, *last.token_ids][:12] == expected
    finally:
        loop.stop()
        loop.wait(10)
    engine.check()


def test_held_tokens_leave_once_their_interval_passes_without_a_new_step() -> None:
    clock = Clock()
    loop = EngineLoop(None, "w0", stream_interval_s=1.0, clock=clock)  # type: ignore[arg-type]
    sink = Collector()
    loop._sinks["r"] = sink
    loop._sent_s["r"] = 0.0
    loop._hold("r", GenerateChunk("r", [7, 8]))
    clock.now = 0.5
    loop._flush_due()
    assert sink.chunks.empty() and loop._held
    clock.now = 1.0
    loop._flush_due()
    assert sink.chunks.get_nowait().token_ids == [7, 8]
    assert not loop._held and loop._sent_s["r"] == 1.0
