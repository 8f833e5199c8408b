"""A report lost between a worker and the router: a real engine loop reports to a real
`Router` through a transport that drops one report while requests run. The router keeps
serving from its old view, asks for a snapshot, and after it predicts exactly what the
worker's cache holds; every request finishes with the tokens of an undisturbed engine, and
both `check()`s pass."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path

from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.messages import WorkerReport
from swaserve.proto.stream import GenerateChunk
from swaserve.router import Router, RouterConfig
from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.engine.engine_loop import EngineLoop


class LossyTransport:
    """Hands the loop's reports to the router (on the loop's thread, one at a time), except
    the first one that lists `drop_when_listing`; the router's answer goes back to the loop."""

    def __init__(self, router: Router, drop_when_listing: str) -> None:
        self.router = router
        self.loop: EngineLoop | None = None
        self.drop_when_listing = drop_when_listing
        self.dropped: WorkerReport | None = None
        self.answers: list[bool] = []
        self.snapshot_applied = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, report: WorkerReport) -> None:
        with self.lock:
            if self.dropped is None and self.drop_when_listing in report.admitted_request_ids:
                self.dropped = report
                return
            answer = self.router.update(report)
            self.answers.append(answer)
            if report.snapshot:
                self.snapshot_applied.set()
        assert self.loop is not None
        self.loop.take_router_answer(report.seq, answer)


def finished_tokens(chunks: queue.SimpleQueue[GenerateChunk], timeout_s: float = 60.0) -> list[int]:
    tokens: list[int] = []
    while True:
        chunk = chunks.get(timeout=timeout_s)
        tokens.extend(chunk.token_ids)
        if chunk.finished:
            assert chunk.finish_reason == "length", chunk
            return tokens


def test_a_lost_report_is_repaired_by_a_snapshot_and_loses_nothing(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model = tiny_model_factory(arch="gpt-oss", num_layers=2, sliding_window_size=4)
    config = EngineConfig(model=str(model), device="cpu", max_total_tokens=1024)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": [(5 * i + j) % 90 + 1 for j in range(20)] for i in range(4)}
    reference = Engine(config)
    expected = {
        rid: out.token_ids
        for rid, out in zip(
            prompts, reference.generate(list(prompts.values()), params), strict=True
        )
    }
    reference.shutdown()

    router = Router(RouterConfig())
    router.add_worker("w0")
    transport = LossyTransport(router, drop_when_listing="r1")
    engine = Engine(config)
    loop = EngineLoop(engine, "w0", on_report=transport, report_interval_s=0.02)
    transport.loop = loop
    loop.start()
    try:
        got = {}
        for rid, prompt in prompts.items():  # one after another: each is cached when it ends
            chunks: queue.SimpleQueue[GenerateChunk] = queue.SimpleQueue()
            loop.submit(EngineRequest(rid, prompt, params), chunks.put).result(30)
            got[rid] = finished_tokens(chunks)
        assert got == expected  # nothing lost, nothing changed by the gap
        assert transport.dropped is not None
        assert transport.snapshot_applied.wait(30)  # the router asked, the worker answered
        assert router.stats.resyncs_requested >= 1 and router.stats.snapshots >= 1

        def match_of(tokens: list[int]) -> int:
            return loop.call(
                lambda e: e.kv.tree.match_prefix(tokens, allow_repair=True).saved_tokens
            ).result(30)

        with transport.lock:  # no report is being applied while we compare
            for prompt in prompts.values():
                follow_up = [*prompt, 7, 7]
                assert router.predict_hits(follow_up) == {"w0": match_of(follow_up)}
            router.check()
        assert transport.answers[-1] is False  # in step again: no more snapshots asked
        loop.call(lambda e: e.check()).result(30)
    finally:
        loop.stop()
        loop.wait(30)
        engine.shutdown()
