"""Engine API, errors and bookkeeping on a tiny GPT-OSS model (CPU)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from swaserve.worker import Engine, EngineConfig, RequestError, SamplingParams
from swaserve.worker.engine.engine import CALIBRATION_TOKENS

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(
        "gpt-oss", num_layers=4, sliding_window_size=8, hidden_size=32, seed=1
    )


def make_engine(model_dir: Path, **overrides: object) -> Engine:
    options: dict[str, object] = dict(
        model=str(model_dir),
        max_total_tokens=512,
        swa_full_tokens_ratio=0.5,
        chunked_prefill_size=32,
    )
    options.update(overrides)
    return Engine(EngineConfig(**options))  # type: ignore[arg-type]


def test_generate_returns_one_output_per_prompt(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    outs = engine.generate([[5, 6, 7], "hi", [5, 6, 7, 8]], GREEDY)
    assert [len(o.token_ids) for o in outs] == [8, 8, 8]
    assert all(o.finish_reason == "length" for o in outs)
    assert isinstance(outs[1].text, str)
    engine.check()


def test_streaming_add_step_abort(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    a = engine.add_request([1, 2, 3], GREEDY, request_id="a")
    b = engine.add_request(
        [4, 5, 6], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    )
    seen: dict[str, list[int]] = {a: [], b: []}
    finished = set()
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
        steps += 1
        if steps == 1:
            head = engine.headroom()
            assert (
                head.num_running == 2
                and head.full_reserved_tokens > 0
                and head.swa_reserved_tokens > 0
            )
        if steps == 2:
            assert engine.abort(a)
            assert not engine.abort(a)
    assert finished == {b}
    assert len(seen[b]) == 3 and 1 <= len(seen[a]) <= 2
    engine.check()
    head = engine.headroom()
    assert head.num_running == head.num_waiting == 0
    assert head.full_free_tokens + head.full_evictable_tokens == head.full_total_tokens


@pytest.mark.parametrize("single_pool", [False, True])
def test_headroom_counts_the_cached_prefix_as_evictable(model_dir: Path, single_pool: bool) -> None:
    """After the requests end, every token is free or evictable in each view; one pool reports
    its SWA view as the pool itself (what eviction frees serves SWA layers too)."""
    engine = make_engine(model_dir, disable_hybrid_swa_memory=single_pool)
    engine.generate([[5, 6, 7, 8] * 10, [9] * 30], GREEDY)
    head = engine.headroom()
    assert head.hybrid is not single_pool
    assert head.full_evictable_tokens > 0 and head.swa_evictable_tokens > 0
    assert head.full_free_tokens + head.full_evictable_tokens == head.full_total_tokens
    assert head.swa_free_tokens + head.swa_evictable_tokens <= head.swa_total_tokens
    if single_pool:
        assert head.swa_total_tokens == head.full_total_tokens
        assert head.swa_evictable_tokens == head.full_evictable_tokens
        assert head.swa_free_tokens + head.swa_evictable_tokens == head.swa_total_tokens
    engine.check()


def test_stop_token_finishes_with_stop(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    first = engine.generate([[9, 9, 9]], GREEDY)[0].token_ids
    out = engine.generate(
        [[9, 9, 9]], SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(first[2],))
    )[0]
    assert out.token_ids == first[: first.index(first[2]) + 1]
    assert out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_new_tokens=8, ignore_eos=True)
    alone = engine.generate([[3, 1, 4]], params)[0].token_ids
    mixed = engine.generate([[2, 7], [3, 1, 4], [1]], [GREEDY, params, GREEDY])[1].token_ids
    assert alone == mixed


def test_prefix_is_reused(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    prompt = list(range(1, 41))
    engine.generate([prompt], GREEDY)
    out = engine.generate([[*prompt, 50]], GREEDY)[0]
    assert out.cached_tokens == 40
    assert engine.headroom().cached_tokens_total == 40


def test_requests_that_can_never_fit_are_refused(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    with pytest.raises(RequestError, match="full pool holds 512"):
        engine.add_request([7] * 450, SamplingParams(max_new_tokens=100))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestError, match=r"ints in \[0, "):
        engine.add_request([1, -2], GREEDY)
    with pytest.raises(RequestError, match=r"ints in \[0, "):
        engine.add_request([10**6], GREEDY)
    engine.add_request([1], GREEDY, request_id="x")
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([1], GREEDY, request_id="x")
    with pytest.raises(RequestError, match="2 prompts but 1"):
        engine.generate([[1], [2]], [GREEDY])
    no_chunk = make_engine(
        model_dir, chunked_prefill_size=None, max_total_tokens=256, swa_full_tokens_ratio=0.25
    )
    with pytest.raises(RequestError, match="enable chunked_prefill_size"):
        no_chunk.add_request([5] * 100, GREEDY)


def test_a_tp_size_the_model_cannot_split_is_refused_before_any_rank_starts(
    model_dir: Path,
) -> None:
    from swaserve.worker.runner.parallel import ShardingError

    with pytest.raises(ShardingError, match="4 attention heads do not split over tp_size=3"):
        make_engine(model_dir, tp_size=3)


def test_swa_pool_too_small_is_refused_at_start(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="SWA pool is too small"):
        make_engine(model_dir, max_total_tokens=64, swa_full_tokens_ratio=0.1)


def test_bad_sampling_params_are_refused() -> None:
    with pytest.raises(ValidationError):
        SamplingParams(top_p=0)
    with pytest.raises(ValidationError):
        SamplingParams(max_new_tokens=0)


def test_flush_cache_returns_both_pools(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    engine.generate([list(range(1, 60)), list(range(1, 30))], GREEDY)
    assert engine.headroom().full_free_tokens < 512
    engine.flush_cache()
    head = engine.headroom()
    assert head.full_free_tokens == head.full_total_tokens == 512
    assert head.swa_free_tokens == head.swa_total_tokens == 256
    engine.check()


def test_headroom_reports_the_prefill_under_way_and_the_measured_prefill(model_dir: Path) -> None:
    engine = make_engine(model_dir)  # chunks of 32 tokens
    head = engine.headroom()  # the start measured a prefill of padding tokens
    assert head.prefill_tokens_total == CALIBRATION_TOKENS and head.prefill_s_total > 0
    calibration_s = head.prefill_s_total
    engine.add_request(list(range(1, 101)), GREEDY, request_id="long")
    engine.step()  # the first chunk: the request is admitted, 68 prompt tokens to go
    head = engine.headroom()
    assert (head.num_running, head.num_waiting) == (1, 0)
    assert head.prefilling_tokens == 68 and head.queued_prefill_tokens == 0
    assert head.prefill_tokens_total == CALIBRATION_TOKENS + 32
    first_s = head.prefill_s_total
    assert first_s > calibration_s
    engine.add_request([7, 8, 9], GREEDY, request_id="short")
    assert engine.headroom().queued_prefill_tokens == 3
    while engine.has_unfinished_requests():
        engine.step()
    head = engine.headroom()
    assert head.prefilling_tokens == 0
    # Every prompt token once; decode steps add none.
    assert head.prefill_tokens_total == CALIBRATION_TOKENS + 103
    assert head.prefill_s_total > first_s
    engine.check()


def test_the_step_log_and_the_decode_counters_record_each_step(model_dir: Path) -> None:
    """`Engine.step_log` keeps each step's mix and wall time (what bench/cluster_sim.py fits
    its step cost to); decode-only steps also count in the report (`decode_steps_total`)."""
    engine = make_engine(model_dir)  # chunks of 32 tokens
    engine.step_log.take()
    engine.add_request(list(range(1, 71)), GREEDY)  # 70 tokens: chunks 32, 32, 6, then decodes
    while engine.has_unfinished_requests():
        engine.step()
    log = engine.step_log.take()
    assert engine.step_log.take() == []
    prefills = [(r.decode_rows, r.prefill_requests, r.prefill_tokens) for r in log[:3]]
    assert prefills == [(0, 1, 32), (0, 1, 32), (0, 1, 6)]
    assert [r.prefill_context_tokens for r in log[:3]] == [0, 32, 64]
    decodes = log[3:]
    assert decodes and all((r.decode_rows, r.prefill_tokens) == (1, 0) for r in decodes)
    assert all(r.seconds > 0 for r in log)
    assert all(a.started_s + a.seconds <= b.started_s for a, b in itertools.pairwise(log))
    head = engine.headroom()
    assert head.decode_steps_total == len(decodes) and head.decode_s_total > 0
    assert head.decode_s_total <= sum(r.seconds for r in decodes)
    engine.check()


def test_the_first_token_carries_where_its_time_went(model_dir: Path) -> None:
    """`RequestOutput.timings` comes with a request's first token only: how it was held at
    admission, the steps its prefill took (chunks of 32) and what shared them."""
    engine = make_engine(model_dir, max_running_requests=1)
    first = engine.add_request(list(range(1, 71)), GREEDY)  # 70 tokens: chunks 32, 32, 6
    second = engine.add_request([7, 8, 9], GREEDY)  # waits: one request runs at a time
    timings: dict[str, list] = {first: [], second: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            timings[out.request_id].append(out.timings)
    head, *rest = timings[first]
    assert head is not None and all(t is None for t in rest) and len(rest) == 7
    assert (head.held_by, head.prefill_steps, head.step_prefill_tokens) == ("", 3, 70)
    assert head.step_decodes == 0 and head.queued_s >= 0 and head.prefill_s > 0
    late, *rest = timings[second]
    assert late is not None and all(t is None for t in rest)
    # It waited for `first` to finish: 3 prefill steps and 7 decodes, held by the row limit.
    assert (late.held_by, late.prefill_steps, late.step_decodes) == ("running", 1, 0)
    assert late.queued_s > head.prefill_s
    engine.check()
