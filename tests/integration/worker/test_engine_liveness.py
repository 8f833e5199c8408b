"""Liveness (architecture §6): the engine never idles with work. Every step runs a batch or ends a
request, and every request finishes, aborts or fails within a bounded number of steps, also
with SWA pools just above W + P + chunk, where a cached prefix's locked window takes a large
share of the pool."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.proto import StructuredOutputs
from swaserve.worker import Engine, EngineConfig, SamplingParams


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)


GRAMMAR = StructuredOutputs(regex="[a-z]{2,30}( [a-z]{1,5})*")


def sampling(kind: int, max_new_tokens: int, seed: int) -> SamplingParams:
    """The options a fuzzed request samples with: 0 plain greedy; 1 penalties, bias, logprobs;
    2 a grammar; 3 stop strings and min_tokens; 4 all of them."""
    if kind == 0:
        return greedy(max_new_tokens)
    options: dict[str, object] = {}
    if kind in (1, 4):
        options |= {"presence_penalty": 1.0, "repetition_penalty": 1.3, "logit_bias": {97: 2.0}}
        options["logprobs"] = 2
    if kind in (2, 4):
        options["structured_outputs"] = GRAMMAR
    if kind in (3, 4):
        options |= {"stop": ("q", "zz"), "min_tokens": min(3, max_new_tokens)}
    return SamplingParams(
        temperature=1.0, seed=seed, max_new_tokens=max_new_tokens, ignore_eos=True, **options
    )


def make_engine(model: Path, *, swa_tokens: int, **options: object) -> Engine:
    """An engine whose SWA pool holds exactly `swa_tokens` (a multiple of the page size)."""
    full_tokens = int(options.pop("max_total_tokens", 96))  # type: ignore[call-overload]
    engine = Engine(
        EngineConfig(
            model=str(model),
            max_total_tokens=full_tokens,
            swa_full_tokens_ratio=(swa_tokens + 0.5) / full_tokens,
            **options,  # type: ignore[arg-type]
        )
    )
    assert engine.plan.swa_tokens == swa_tokens
    return engine


Output = tuple[str, list[int], bool, str | None]  # id, new tokens, finished, finish reason


def run_to_end(engine: Engine, max_steps: int) -> list[list[Output]]:
    """Step until nothing is left (at most `max_steps`, counted, not timed); the outputs of
    each step. `check()` after every step."""
    steps = []
    while engine.has_unfinished_requests():
        assert len(steps) < max_steps, f"stalled: {engine.headroom()}"
        outs = engine.step()
        engine.check()
        steps.append([(o.request_id, o.new_token_ids, o.finished, o.finish_reason) for o in outs])
    return steps


def assert_pools_whole(engine: Engine) -> None:
    if engine.tree is not None:
        engine.flush_cache()
    head = engine.headroom()
    assert (head.full_free_tokens, head.swa_free_tokens) == (
        head.full_total_tokens,
        head.swa_total_tokens,
    )


@pytest.fixture(scope="module")
def w8(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("gpt-oss", num_layers=4, sliding_window_size=8, seed=1)


@pytest.fixture(scope="module")
def w4(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("gpt-oss", num_layers=4, sliding_window_size=4, seed=1)


def test_head_request_behind_a_locked_window_is_admitted(w8: Path) -> None:
    """The reported stall: nothing runs, one request waits, the SWA pool is all free or
    evictable. Its cached prefix locks the 8-token window before its chunk; admission charged
    that window again (8 locked + chunk 8 + W 8 + P 4 > 24) and `step()` returned nothing
    forever. The window counts once: 8 + 4 + 8 locked fit."""
    engine = make_engine(w8, swa_tokens=24, page_size=4, chunked_prefill_size=8)
    stem = list(range(1, 25))
    engine.generate([stem], greedy(1))
    head = engine.headroom()
    assert (head.num_running, head.swa_free_tokens, head.swa_evictable_tokens) == (0, 0, 24)
    prompt = stem[:16] + list(range(100, 116))
    engine.add_request(prompt, greedy(3), request_id="b")

    first = engine.step()
    head = engine.headroom()
    assert (first, head.num_running, head.num_waiting) == ([], 1, 0)
    cold = make_engine(
        w8, swa_tokens=24, page_size=4, chunked_prefill_size=8, enable_prefix_cache=False
    )
    tokens = cold.generate([prompt], greedy(3))[0].token_ids
    assert (
        run_to_end(engine, 10)
        == [
            [("b", tokens[:1], False, None)],  # the second chunk ends the prompt
            [("b", tokens[1:2], False, None)],
            [("b", tokens[2:], True, "length")],
        ]
    )
    assert engine.stats.cached_tokens == 16 and engine.stats.retractions == 0
    assert_pools_whole(engine)


def test_a_lone_prefill_shrinks_its_chunk_to_the_room_its_lock_leaves(w4: Path) -> None:
    """After a chunk, the tree locks the whole chunk's SWA (its last node), not only W: with
    W=4, P=1 and a 23-token SWA pool, the next 16-token chunk finds 7 tokens of room. That
    chunk used to wait for room nothing would free (the engine idled with a running request);
    it now takes 7, and the chunk after it 16 again."""
    engine = make_engine(w4, swa_tokens=23, page_size=1, chunked_prefill_size=16)
    engine.add_request(list(range(1, 41)), greedy(2), request_id="a")
    computed = []
    for _ in range(5):
        engine.step()
        engine.check()
        computed.append([r.num_computed for r in engine.scheduler.running])
    assert computed == [[16], [23], [39], [40], []]
    assert engine.stats.retractions == 0 and not engine.has_unfinished_requests()
    assert_pools_whole(engine)


def test_a_request_that_cannot_move_even_alone_ends_with_an_error(w8: Path) -> None:
    """Every free SWA slot is taken outside the engine after a's first chunk: the prefill
    cannot get a page, so a is retracted; alone, with its cached chunk locked, still no page
    fits, so it ends with finish reason `error` and a message with its need and the pools."""
    engine = make_engine(
        w8, swa_tokens=24, page_size=4, chunked_prefill_size=8, check_on_idle=False
    )
    engine.add_request(list(range(1, 21)), greedy(2), request_id="a")
    assert engine.step() == []
    stolen = engine.allocator.alloc(16)  # the 16 SWA slots a's locked chunk leaves free
    assert stolen is not None and engine.allocator.swa_available_size() == 0

    (out,) = engine.step()
    assert (out.request_id, out.new_token_ids, out.finished, out.finish_reason) == (
        "a",
        [],
        True,
        "error",
    )
    assert out.error == (
        "request 'a' cannot run even alone: its next 8 tokens (after 8 cached) need 8 new slots "
        "in each pool, a shorter chunk at least 4; the pools have 72 full and 0 SWA tokens free "
        "or evictable, besides the 8 full and 8 SWA its cached prefix locks"
    )
    assert engine.stats.retractions == 1 and not engine.has_unfinished_requests()
    assert engine.abort("a") is False  # it is gone
    engine.allocator.free(stolen)
    engine.check()
    assert_pools_whole(engine)


# ---- the property ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrival:
    step: int  # the step before which it is added
    stem: int
    num_tokens: int  # 1-51: a prefix of its stem, then its own tokens
    own_from: int  # where its own tokens start (a shared prefix of any length)
    max_new_tokens: int
    abort_after: int | None  # steps after its arrival; None: never aborted
    sampling: int = 0  # `sampling(kind, ...)`


arrivals = st.lists(
    st.builds(
        Arrival,
        step=st.integers(0, 40),
        stem=st.integers(0, 2),
        num_tokens=st.integers(1, 51),
        own_from=st.integers(0, 51),
        max_new_tokens=st.integers(1, 40),
        abort_after=st.one_of(st.none(), st.none(), st.none(), st.integers(0, 30)),
        sampling=st.sampled_from([0, 0, 1, 2, 3, 4]),
    ),
    min_size=1,
    max_size=14,
)

engine_configs = st.fixed_dictionaries(
    {
        "page_size": st.sampled_from([1, 4]),
        "chunk": st.sampled_from([8, 16]),
        "extra_swa_pages": st.sampled_from([0, 0, 1, 3]),
        "max_total_tokens": st.sampled_from([96, 140]),
        "enable_prefix_cache": st.booleans(),
        "schedule_policy": st.sampled_from(["lpm", "fcfs"]),
        "schedule_conservativeness": st.sampled_from([0.3, 1.0]),
        "swa_eviction_interval": st.sampled_from([1, 4, 128]),
        "max_running_requests": st.sampled_from([2, 6]),
        "window": st.sampled_from([4, 8]),
    }
)


def check_liveness(models: dict[int, Path], config: dict, plan: list[Arrival]) -> None:
    """Drive `plan` through an engine built from `config` and assert the liveness property."""
    p, chunk, w = config["page_size"], config["chunk"], config["window"]
    engine = make_engine(
        models[w],
        swa_tokens=w + 2 * p + chunk + config["extra_swa_pages"] * p,  # just above W + P + chunk
        page_size=p,
        chunked_prefill_size=chunk,
        max_total_tokens=config["max_total_tokens"],
        enable_prefix_cache=config["enable_prefix_cache"],
        schedule_policy=config["schedule_policy"],
        schedule_conservativeness=config["schedule_conservativeness"],
        swa_eviction_interval=config["swa_eviction_interval"],
        max_running_requests=config["max_running_requests"],
    )
    assert engine.scheduler.limits.chunked_prefill_size == chunk
    engine.grammar.submit(GRAMMAR).result()  # compiled: a request with it is queued at once
    stems = [[(31 * s + 7 * i) % 200 + 1 for i in range(51)] for s in range(3)]
    plan = sorted(plan, key=lambda a: a.step)
    # Each step moves at least one request by a token or a page; a retraction costs its
    # request at most its computed tokens again. Generous, but finite: a stall fails it.
    work = sum(a.num_tokens + a.max_new_tokens for a in plan)
    max_lifetime = 3 * work + 50  # steps from a request's arrival to its end
    added: dict[str, int] = {}  # request id -> the step it was added before
    aborts: dict[int, list[str]] = {}
    ended: dict[str, str] = {}  # request id -> finish reason
    step = 0
    while step <= plan[-1].step or engine.has_unfinished_requests():
        late = [rid for rid, at in added.items() if rid not in ended and step - at > max_lifetime]
        assert not late, f"{late} not done after {max_lifetime} steps: {engine.headroom()}"
        for i, a in enumerate(plan):
            if a.step == step:
                stem = stems[a.stem]
                prompt = stem[: min(a.own_from, a.num_tokens)]
                prompt += [(i * 13 + j) % 199 + 1 for j in range(a.num_tokens - len(prompt))]
                rid = f"r{i}"
                params = sampling(a.sampling, a.max_new_tokens, seed=i)
                engine.add_request(prompt, params, request_id=rid)
                added[rid] = step
                if a.abort_after is not None:
                    aborts.setdefault(step + a.abort_after, []).append(rid)
        for rid in aborts.pop(step, []):
            if rid not in ended and engine.abort(rid):
                ended[rid] = "abort"
        had_work = engine.has_unfinished_requests()
        runs_before = engine.stats.steps
        outs = engine.step()
        engine.check()
        # Never idle with work: a batch ran or a request ended.
        assert not had_work or engine.stats.steps == runs_before + 1 or outs
        for out in outs:
            if out.finished:
                assert out.request_id not in ended
                ended[out.request_id] = out.finish_reason or ""
        step += 1
    assert set(ended) == set(added)
    assert "error" not in ended.values()  # every request fits alone: none is unservable
    assert engine.stats.failed_steps == 0
    assert_pools_whole(engine)


@pytest.fixture(scope="module")
def models(tiny_model_factory: Callable[..., Path]) -> dict[int, Path]:
    return {
        w: tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=w, seed=3)
        for w in (4, 8)
    }


FAMILIES = {"gemma3": 6, "gemma4": 6, "llama4": 4}  # arch -> layers


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_models(
    request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]
) -> dict[int, Path]:
    """At the same windows: Gemma 3 (5:1 local / global, sandwich norms), Gemma 4 (KV-shared
    layers, per-layer inputs) and Llama 4 (chunks of C = the window)."""
    arch = request.param
    return {
        w: tiny_model_factory(arch, num_layers=FAMILIES[arch], sliding_window_size=w, seed=3)
        for w in (4, 8)
    }


FUZZ_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@settings(max_examples=12, **FUZZ_SETTINGS)  # type: ignore[arg-type]
@given(config=engine_configs, plan=arrivals)
def test_every_request_ends_within_bounded_steps(
    models: dict[int, Path], config: dict, plan: list[Arrival]
) -> None:
    check_liveness(models, config, plan)


@settings(max_examples=12, **FUZZ_SETTINGS)  # type: ignore[arg-type]
@given(config=engine_configs, plan=arrivals)
def test_every_request_ends_within_bounded_steps_on_each_family(
    family_models: dict[int, Path], config: dict, plan: list[Arrival]
) -> None:
    check_liveness(family_models, config, plan)


@pytest.mark.slow
@settings(max_examples=80, **FUZZ_SETTINGS)  # type: ignore[arg-type]
@given(config=engine_configs, plan=arrivals)
def test_every_request_ends_within_bounded_steps_many_configs(
    models: dict[int, Path], config: dict, plan: list[Arrival]
) -> None:
    check_liveness(models, config, plan)
