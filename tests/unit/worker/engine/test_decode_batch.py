"""The scheduler's kept `DecodeBatch`: finish checks by arrays (stop ids per request, lengths),
mirrors that stay equal to the requests through joins, finishes, aborts, retractions and SWA
freeing, and `check()` calls that catch a stale mirror or split."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.engine.decode_batch import DecodeBatch

W = 8
P = 4
INTERVAL = 4
PROMPTS = [[(5 * i + 11 * k) % 240 + 1 for i in range(6 + 3 * k)] for k in range(6)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(
        "gpt-oss", num_layers=2, sliding_window_size=W, hidden_size=32, seed=5
    )


def make_engine(model_dir: Path, **overrides: object) -> Engine:
    options: dict[str, object] = dict(
        model=str(model_dir),
        max_total_tokens=2048,
        swa_full_tokens_ratio=0.5,
        chunked_prefill_size=16,
        page_size=P,
        swa_eviction_interval=INTERVAL,
    )
    options.update(overrides)
    return Engine(EngineConfig(**options))  # type: ignore[arg-type]


def free_run(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return make_engine(model_dir).generate([prompt], params)[0].token_ids


def expected_cut(tokens: list[int], stops: set[int], max_new_tokens: int) -> tuple[list[int], str]:
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stops:
            return tokens[: i + 1], "stop"
    return tokens[:max_new_tokens], "length"


def step_checked(engine: Engine) -> list:
    outputs = engine.step()
    engine.check()
    return outputs


def test_each_request_finishes_at_its_own_stop_ids_and_length(model_dir: Path) -> None:
    full = [free_run(model_dir, p, 40) for p in PROMPTS]
    # Stop sets shared by some requests, distinct for others; ids past every sampled token
    # (and past the vocabulary) never match; max_new_tokens differ.
    stop_sets = [
        {full[0][5]},
        {full[1][9], 100_000},
        {full[0][5]},
        set(),
        {full[4][2], full[4][7]},
        {99_999},
    ]
    max_new = [40, 30, 12, 17, 40, 25]
    # Requests with stop sets of their own that never match, ending one after another: the
    # batch's groups of stop ids are compacted once most of them are unused.
    for k in range(10):
        full.append(full[k % len(PROMPTS)])
        stop_sets.append({70_000 + k})
        max_new.append(3 + 2 * k)
    engine = make_engine(model_dir)
    for k, prompt in enumerate(PROMPTS + [PROMPTS[k % len(PROMPTS)] for k in range(10)]):
        params = SamplingParams(
            temperature=0,
            max_new_tokens=max_new[k],
            ignore_eos=True,
            stop_token_ids=tuple(sorted(stop_sets[k])),
        )
        engine.add_request(prompt, params, request_id=str(k))
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    group_counts = []
    while engine.has_unfinished_requests():
        for out in step_checked(engine):
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        group_counts.append(len(engine.scheduler._decode._groups))
    assert max(group_counts) >= 12 and group_counts[-1] < 8  # compacted on the way
    for k in range(len(full)):
        tokens, reason = expected_cut(full[k], stop_sets[k], max_new[k])
        assert got[str(k)] == tokens
        assert reasons[str(k)] == reason


def test_mirrors_hold_through_joins_aborts_and_swa_freeing(model_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    engine = make_engine(model_dir)
    for k, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(prompt, params, request_id=str(k))
    for step in range(40):
        if step == 5:
            engine.add_request(PROMPTS[3], params, request_id="late")
        if step == 9:
            assert engine.abort("1")
        step_checked(engine)
        sched = engine.scheduler
        full_reserve = sum(
            int(min(r.remaining_new_tokens, 4096) * sched.new_token_ratio) for r in sched.running
        )
        swa_reserve = sum(  # a decode: up to the W + I + P it may hold; a prefill: I + P
            min(
                r.remaining_new_tokens,
                max(W + INTERVAL + P - r.num_computed + r.swa.own_start, 0)
                if r.is_decoding
                else INTERVAL + P,
            )
            for r in sched.running
        )
        assert sched.reserved_tokens() == (full_reserve, swa_reserve)
        for r in engine.scheduler.running:
            # Out-of-window SWA is given back once the interval I piled up: a decode holds
            # at most the window, two partial pages and I - 1 more.
            held = r.num_computed - r.swa.own_start
            assert not r.is_decoding or held <= W + 2 * P + INTERVAL
    assert engine.stats.swa_freed_tokens > 0


def test_retraction_keeps_the_decode_batch_consistent(model_dir: Path) -> None:
    # A full pool that cannot hold every decode: the newest requests are retracted and the
    # rebuilt decode batch must match the requests left running.
    engine = make_engine(model_dir, max_total_tokens=96, swa_full_tokens_ratio=1.0)
    params = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    for k, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(prompt, params, request_id=str(k))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in step_checked(engine):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.stats.retractions > 0
    for k, prompt in enumerate(PROMPTS[:4]):
        assert tokens[str(k)] == free_run(model_dir, prompt, 60)


def test_check_catches_a_stale_mirror(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    engine.add_request(PROMPTS[0], params, request_id="a")
    engine.add_request(PROMPTS[1], params, request_id="b")
    while not engine.scheduler.running or not all(r.is_decoding for r in engine.scheduler.running):
        engine.step()
    engine.step()
    engine.check()
    batch = engine.scheduler._decode
    assert isinstance(batch, DecodeBatch) and len(batch) == 2
    batch.seq_lens[1] += 1
    with pytest.raises(RuntimeError, match="seq_lens disagrees"):
        engine.check()
    batch.seq_lens[1] -= 1
    batch.last_tokens[0] += 1
    with pytest.raises(RuntimeError, match="last_tokens disagrees"):
        engine.check()
    batch.last_tokens[0] -= 1
    engine.check()


def test_check_catches_a_stale_split(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    engine.add_request(PROMPTS[0], params, request_id="a")
    for _ in range(4):
        engine.step()
    engine.check()
    sched = engine.scheduler
    decoding = sched._decode.reqs[0]
    sched._prefilling.append(decoding)  # in both parts
    with pytest.raises(RuntimeError, match="split is stale"):
        engine.check()
    sched._prefilling.remove(decoding)
    sched._decode.remove([0])  # in neither
    with pytest.raises(RuntimeError, match="split is stale"):
        engine.check()
