"""EngineLoop without Ray: one engine thread, commands in, chunks and reports out."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from swaserve.cluster.engine_loop import EngineLoop, GenerateChunk
from swaserve.proto.messages import WorkerReport
from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.engine import RequestError


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
            loop.submit(f"r{i}", prompt, params, sinks[i]).result(10)
        for i, sink in enumerate(sinks):
            chunks = sink.until_finished()
            assert [t for c in chunks for t in c.token_ids] == expected[i]
            assert chunks[-1].finish_reason == ("length" if len(expected[i]) == 6 else "stop")
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
            loop.submit("bad", [10_000], SamplingParams(), Collector()).result(10)
        sink = Collector()
        long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
        loop.submit("long", [1, 2, 3], long, sink).result(10)
        first = sink.chunks.get(timeout=30)
        assert first.token_ids
        loop.abort("long")
        last = sink.until_finished()[-1]
        assert last.finish_reason == "abort"
        assert loop.num_open == 0
    finally:
        loop.stop()
        loop.wait(10)
    engine.check()
    head = engine.headroom()
    assert head.full_free_tokens + head.full_evictable_tokens == head.full_total_tokens


def test_stop_ends_open_requests_and_refuses_new_ones(engine: Engine) -> None:
    loop = EngineLoop(engine, "w0")
    loop.start()
    sink = Collector()
    long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    loop.submit("long", [4, 5, 6], long, sink).result(10)
    loop.stop()
    assert loop.wait(10)
    assert sink.until_finished()[-1].finish_reason == "abort"
    with pytest.raises(RuntimeError, match="stopped"):
        loop.submit("late", [1], long, Collector()).result(1)
    engine.check()
