"""The MTP draft step (`runner/draft_step.py`) as CUDA graphs, with a CPU stand-in that refuses
host reads while it records: the drafts after every step equal the extend path's (page sizes 1
and 4: chain steps at the page tail and on the scratch page; prefix hits; SWA freeing), every
depth forward of a decode step is a replayed graph, and what it cannot take (rows past its
buckets) runs the extend path with the same drafts."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_decode_step import ReplayGraph, reset_graphs  # noqa: F401  (a fixture)

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.runner.draft_step import DraftRows, DraftStep, padding_rows

W = 8
K = 3
GREEDY = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(24)]
    return [
        (system if i % 2 else []) + [rng.randrange(1, 250) for _ in range(rng.randint(3, 30))]
        for i in range(5)
    ]


def mtp_engine(model: Path, page_size: int) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model),
            max_total_tokens=1024,
            page_size=page_size,
            chunked_prefill_size=32,
            swa_eviction_interval=8,
            speculative_method="mtp",
            num_speculative_tokens=K,
            max_running_requests=5,
            compile=False,
        )
    )


def record_draft_logits(engine: Engine) -> list[torch.Tensor]:
    """Every draft logits the engine computes, in order: the extend path's (`draft_forward`
    with logits) or the draft step's (`draft_logits`); both give the drafting rows in the same
    order (depth 0's anchors, then each chain step's requests)."""
    seen: list[torch.Tensor] = []
    executor = engine.executor
    forward, logits_of = executor.draft_forward, executor.draft_logits

    def spy_forward(*args, **options):  # type: ignore[no-untyped-def]
        out = forward(*args, **options)
        if out is not None:
            seen.append(out.clone())
        return out

    def spy_logits(out: torch.Tensor) -> torch.Tensor:
        logits = logits_of(out)
        seen.append(logits.clone())
        return logits

    executor.draft_forward = spy_forward  # type: ignore[method-assign]
    executor.draft_logits = spy_logits  # type: ignore[method-assign]
    return seen


def drafts_per_step(engine: Engine, batch: list[list[int]]) -> list[dict[int, list[int]]]:
    """Generate `batch` twice (the second time with prefix hits), recording every running
    request's drafts after each step."""
    steps = []
    for _ in range(2):
        ids = {engine.add_request(p, GREEDY): i for i, p in enumerate(batch)}
        while engine.has_unfinished_requests():
            engine.step()
            engine.check()
            steps.append(
                {
                    ids[r.request_id]: list(r.mtp_drafts)
                    for r in engine.scheduler.running
                    if r.mtp_drafts is not None
                }
            )
    return steps


@pytest.mark.parametrize("page_size", [1, 4])
def test_replayed_draft_graphs_make_the_extend_paths_drafts(
    page_size: int,
    tiny_model_factory: Callable[..., Path],
    reset_graphs: None,  # noqa: F811
) -> None:
    model = tiny_model_factory("mimo-v2-flash", num_layers=4, sliding_window_size=W, seed=5)
    batch = prompts(page_size)
    eager = mtp_engine(model, page_size)
    try:
        want_logits = record_draft_logits(eager)
        want = drafts_per_step(eager, batch)
    finally:
        eager.shutdown()
    engine = mtp_engine(model, page_size)
    try:
        runner = engine.runner
        step = runner.draft_step = runner.make_draft_step("graphs", ReplayGraph)
        assert isinstance(step, DraftStep) and not step.background
        got_logits = record_draft_logits(engine)
        assert drafts_per_step(engine, batch) == want
        assert len(got_logits) == len(want_logits) > 0
        for got, expected in zip(got_logits, want_logits, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert engine.stats.cached_tokens > 0 and engine.stats.swa_freed_tokens > 0
        assert sum(len(d) for d in want) > 0
        # a decode step's three depth forwards ran as graphs: captured once per (depth, bucket)
        assert step.stats.steps >= 3 * (GREEDY.max_new_tokens // 2)
        assert len(ReplayGraph.captured) == step.stats.captures == len(step._graphs)
        assert {depth for depth, _, _ in step._graphs} == {0, 1, 2}
        assert (
            sum(g.replays for g in ReplayGraph.captured) == step.stats.steps - step.stats.captures
        )
    finally:
        engine.shutdown()


def test_draft_rows_and_holds(tiny_model_factory: Callable[..., Path]) -> None:
    """Rows: host tokens first, then the device's; `hold` refuses what the buckets cannot
    take and, compiling in the background, graphs not ready yet."""
    with pytest.raises(ValueError, match="2 host and 0 device tokens for 3 rows"):
        DraftRows(
            input_ids=torch.zeros(2, dtype=torch.int64),
            chain_ids=None,
            positions=torch.zeros(3, dtype=torch.int64),
            rope_positions=torch.zeros(3, dtype=torch.int64),
            req_rows=torch.zeros(3, dtype=torch.int64),
            full_slots=torch.zeros(3, dtype=torch.int64),
            swa_slots=None,
            hidden_rows=torch.zeros(3, dtype=torch.int64),
        )
    assert padding_rows(4, 9, two_pools=True).req_rows.tolist() == [9] * 4
    model = tiny_model_factory("mimo-v2-flash", num_layers=4, sliding_window_size=W, seed=5)
    engine = mtp_engine(model, 1)
    try:
        step = engine.runner.make_draft_step("graphs", ReplayGraph)
        assert step is not None
        largest = step.buckets[-1]
        with step.hold([(0, 1), (1, largest)]) as held:
            assert held
        with step.hold([(0, largest + 1)]) as held:
            assert not held
        with step.hold([(0, 0)]) as held:
            assert not held
        step.background = True  # as `auto` on CPU makes it: only graphs that are ready
        with step.hold([(0, 1)]) as held:
            assert not held
        assert step.buckets[0] == 2  # one row runs in the bucket of two
        step.ready.add((0, 2))
        with step.hold([(0, 1)]) as held:
            assert held
            with step.hold([(0, 1)]) as again:  # the thread holds it: no wait
                assert not again
    finally:
        engine.shutdown()
