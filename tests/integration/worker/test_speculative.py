"""Speculative decoding with n-gram drafts: the output with drafts is token-for-token the output
without them (greedy), at page sizes 1 and 4, batch sizes 1 and 16, with prefix hits, on
windowed and chunked models (under pool pressure with retraction, against transformers:
`test_engine_golden.py`; TP = 2: `test_engine_tp.py`); rejected drafts go back to
both pools at once; stop ids, stop strings and the length cut a verified run of tokens where
plain decoding would have stopped; a failed or aborted verify step leaves the pools whole;
seeded sampling with drafts depends on nothing but the request."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.proto import StructuredOutputs
from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.engine.scheduler import ScheduledBatch
from swaserve.worker.runner.model_input import ModelInput

W = 8


def greedy(max_new_tokens: int, **options: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True, **options)


def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat their own phrases (so that n-gram drafts are often proposed),
    some sharing a 24-token system prefix (so that later ones hit the prefix cache)."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(24)]
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(1, 250) for _ in range(rng.randint(2, 6))]
        body = phrase * rng.randint(1, 8) + [rng.randrange(1, 250) for _ in range(i % 5)]
        prompts.append(system + body if i % 2 else body)
    return prompts


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Every prompt at once, `check()` after every step; the tokens of each, in order."""
    ids = [engine.add_request(p, params) for p in prompts]
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        engine.check()
    return [got[rid] for rid in ids]


def assert_pools_whole(engine: Engine) -> None:
    if engine.tree is not None:
        engine.flush_cache()
    head = engine.headroom()
    assert (head.full_free_tokens, head.swa_free_tokens) == (
        head.full_total_tokens,
        head.swa_total_tokens,
    )
    engine.check()


@pytest.fixture(scope="module", params=["gpt-oss", "llama4"])
def model(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Path:
    """A windowed model (W = 8) and a chunked one (C = 8: drafts stop at chunk boundaries)."""
    return tiny_model_factory(request.param, num_layers=4, sliding_window_size=W, seed=3)


@pytest.fixture(scope="module")
def expected(model: Path) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy tokens, alone, without drafts, on roomy pools."""
    engine = Engine(EngineConfig(model=str(model), max_total_tokens=4096))
    try:
        prompts = repetitive_prompts(0, 16)
        return {tuple(p): engine.generate([p], greedy(30))[0].token_ids for p in prompts}
    finally:
        engine.shutdown()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_with_drafts_equals_greedy_without(
    model: Path, expected: dict[tuple[int, ...], list[int]], page_size: int, batch: int
) -> None:
    engine = Engine(
        EngineConfig(
            model=str(model),
            max_total_tokens=4096,
            page_size=page_size,
            speculative_method="ngram",
            num_speculative_tokens=4,
        )
    )
    try:
        prompts = repetitive_prompts(0, 16)
        # One system-prefixed prompt first: the others that share its prefix hit the cache.
        assert run(engine, prompts[1:2], greedy(30)) == [expected[tuple(prompts[1])]]
        got = []
        for start in range(0, len(prompts), batch):
            got += run(engine, prompts[start : start + batch], greedy(30))
        assert got == [expected[tuple(p)] for p in prompts]
        stats = engine.stats
        assert stats.spec_verifies > 0 and stats.spec_accepted_tokens > 0
        assert stats.spec_accepted_tokens < stats.spec_draft_tokens  # some were rejected
        assert stats.cached_tokens > 0
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def gpt_oss(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("gpt-oss", num_layers=4, sliding_window_size=W, seed=3)


def spec_engine(path: Path, **options: object) -> Engine:
    options = {"max_total_tokens": 2048, "speculative_method": "ngram", **options}
    return Engine(EngineConfig(model=str(path), **options))  # type: ignore[arg-type]


def peak_running(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> int:
    """The most requests running at once while `prompts` run together, `check()` after every
    step."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
        peak = max(peak, len(engine.scheduler.running))
    return peak


@pytest.mark.parametrize(("page_size", "k"), [(1, 3), (4, 3), (4, 6)])
def test_the_chunk_capped_pools_run_as_many_requests_with_drafts_as_without(
    tiny_model_factory: Callable[..., Path], page_size: int, k: int
) -> None:
    """Prefix cache off, chunked prefill, `max_running_requests` and a byte budget: the
    chunk-capped SWA pool counts each request's draft pages, so the R requests that run at
    once without drafts run at once with them (sized without the drafts, admission stopped at
    R - 1), and every step's pools stay whole."""
    model = tiny_model_factory(
        "gpt-oss", num_layers=2, sliding_window_size=16, hidden_size=64, vocab_size=512
    )
    R = 6
    prompts = [[5 + i, 6, 7, 8] * 20 for i in range(R)]
    capped = dict(
        max_total_tokens=None,
        kv_cache_bytes=400_000,
        page_size=page_size,
        enable_prefix_cache=False,
        chunked_prefill_size=32,
        max_running_requests=R,
        swa_eviction_interval=16,
    )
    plain = Engine(EngineConfig(model=str(model), **capped))  # type: ignore[arg-type]
    try:
        assert plain.plan.swa_tokens < plain.plan.full_tokens / 3  # the capped plan
        assert peak_running(plain, prompts, greedy(60)) == R
    finally:
        plain.shutdown()
    engine = spec_engine(model, num_speculative_tokens=k, **capped)
    try:
        assert engine.plan.swa_tokens > plain.plan.swa_tokens  # the draft pages
        assert peak_running(engine, prompts, greedy(60)) == R
        assert engine.stats.spec_accepted_tokens > 0
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("page_size", [1, 4])
def test_rejected_drafts_go_back_to_both_pools_in_the_step(gpt_oss: Path, page_size: int) -> None:
    """After every step each decoding request holds slots for exactly its computed tokens:
    `check()` finds every page of both pools free or owned by a request's committed tokens or
    the tree, so a rejected draft's page is free again (one inside the last kept page is that
    page's tail)."""
    engine = spec_engine(gpt_oss, page_size=page_size, num_speculative_tokens=6)
    try:
        engine.add_request([3, 4, 5, 6] * 6, greedy(40))
        engine.add_request([9, 8] * 10, greedy(40))
        rejected = 0
        while engine.has_unfinished_requests():
            before = engine.stats.spec_draft_tokens - engine.stats.spec_accepted_tokens
            engine.step()
            engine.check()
            rejected += engine.stats.spec_draft_tokens - engine.stats.spec_accepted_tokens > before
            for req in engine.scheduler.running:
                if req.is_decoding:
                    assert req.num_slots == req.num_computed
        assert rejected > 3
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


def test_a_stop_token_inside_a_verified_run_ends_the_request_there(
    gpt_oss: Path,
) -> None:
    """A stop id the target emits in the middle of its accepted drafts ends the request after
    it, with the tokens plain decoding gives; so do the length and a stop string."""
    prompt = [7, 8, 9, 10] * 8
    plain = Engine(EngineConfig(model=str(gpt_oss), max_total_tokens=2048))
    engine = spec_engine(gpt_oss, num_speculative_tokens=5)
    try:
        free = plain.generate([prompt], greedy(40))[0].token_ids
        stop = free[len(free) // 2]
        cut = free[: free.index(stop) + 1]
        for params in (
            greedy(40, stop_token_ids=[stop]),
            SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=[stop]),
            greedy(len(free) // 3),
        ):
            want = plain.generate([prompt], params)[0]
            got = engine.generate([prompt], params)[0]
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        assert plain.generate([prompt], greedy(40, stop_token_ids=[stop]))[0].token_ids == cut
        text = plain.generate([prompt], greedy(40))[0].text
        if len(text) > 4:
            stop_text = text[len(text) // 2 : len(text) // 2 + 2]
            params = greedy(40, stop=[stop_text])
            want = plain.generate([prompt], params)[0]
            got = engine.generate([prompt], params)[0]
            assert (got.token_ids, got.text, got.finish_reason) == (
                want.token_ids,
                want.text,
                want.finish_reason,
            )
        assert engine.stats.spec_accepted_tokens > 0
        assert_pools_whole(engine)
    finally:
        plain.shutdown()
        engine.shutdown()


def test_penalties_bias_and_min_tokens_apply_to_each_verified_row(gpt_oss: Path) -> None:
    """Penalties, a bias and min_tokens process each position's logits with the tokens before
    it: a verified row counts the drafts before it as output, so these requests draft too and
    give their plain runs' tokens (greedy, and seeded sampling), in one batch; a request with a
    grammar decodes a token per step beside them."""
    prompt = [7, 8, 9, 10] * 8
    plain = Engine(EngineConfig(model=str(gpt_oss), max_total_tokens=2048))
    engine = spec_engine(gpt_oss, num_speculative_tokens=4)
    try:
        cool = {"temperature": 0.1, "seed": 5}
        kinds = [
            greedy(30),
            greedy(30, repetition_penalty=1.2),
            greedy(30, presence_penalty=0.02, frequency_penalty=0.02),
            greedy(30, logit_bias={5: 1.0, 9: -0.5}),
            greedy(30, min_tokens=12, stop_token_ids=[prompt[0]]),
            SamplingParams(max_new_tokens=30, repetition_penalty=1.1, ignore_eos=True, **cool),
            greedy(30, structured_outputs=StructuredOutputs(regex="[a-z ]{1,40}")),
        ]
        want = [plain.generate([prompt], p)[0] for p in kinds]
        got = engine.generate([prompt] * len(kinds), kinds)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        for i, params in enumerate(kinds[:-1]):  # each drafts, alone
            before = engine.stats.spec_verifies
            assert engine.generate([prompt], params)[0].token_ids == want[i].token_ids
            assert engine.stats.spec_verifies > before, i
        before = engine.stats.spec_verifies
        engine.generate([prompt], kinds[-1])
        assert engine.stats.spec_verifies == before  # the grammar's request: no drafts
        assert_pools_whole(engine)
    finally:
        plain.shutdown()
        engine.shutdown()


@pytest.mark.parametrize(
    "options",
    [
        {"frequency_penalty": 0.1, "presence_penalty": 0.1},
        {"repetition_penalty": 1.1},
        {"min_tokens": 31, "ignore_eos": False},  # EOS masked before 31 tokens
    ],
    ids=["frequency", "repetition", "min-tokens"],
)
def test_each_verified_row_is_processed_as_plain_decoding_processes_its_position(
    gpt_oss: Path, monkeypatch: pytest.MonkeyPatch, options: dict
) -> None:
    """Teacher-forced: every verified row whose drafts before it were kept (so its logits
    are used) equals, after penalties / min_tokens, the processed logits plain decoding had at
    that position. A row that ignored the drafts before it as output fails this."""
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5, 6] * 3
    params = SamplingParams(
        **{"temperature": 0, "max_new_tokens": 60, "ignore_eos": True, **options}
    )
    plain = Engine(EngineConfig(model=str(gpt_oss), max_total_tokens=2048))
    # Penalties keep the output from repeating itself: drafts from single tokens too.
    engine = spec_engine(gpt_oss, num_speculative_tokens=4, speculative_ngram_min=1)
    try:
        want: dict[int, torch.Tensor] = {}  # position → plain decoding's processed logits
        process = plain._process

        def recording(logits: torch.Tensor, reqs: list, masks: object) -> torch.Tensor:
            out = process(logits, reqs, masks)  # type: ignore[arg-type]
            for row, req in zip(out, reqs, strict=True):
                want[req.seq_len] = row.clone()
            return out

        monkeypatch.setattr(plain, "_process", recording)
        tokens = plain.generate([prompt], params)[0].token_ids
        sequence = prompt + tokens
        got: list[tuple[int, list[int], torch.Tensor]] = []  # (position, drafts before, row)
        verify = engine._process_verified

        def seen(logits: torch.Tensor, batch: ScheduledBatch, firsts, verified) -> torch.Tensor:
            out = verify(logits, batch, firsts, verified)
            assert batch.drafts is not None
            for i in verified:
                req, proposed = batch.reqs[i], batch.drafts[i]
                for j in range(len(proposed) + 1):
                    got.append((req.seq_len + j, proposed[:j], out[int(firsts[i]) + j].clone()))
            return out

        monkeypatch.setattr(engine, "_process_verified", seen)
        assert engine.generate([prompt], params)[0].token_ids == tokens
        used = [
            (pos, row)
            for pos, before, row in got
            if sequence[pos - len(before) : pos] == before and pos in want
        ]
        kept = [
            pos for pos, before, _ in got if before and sequence[pos - len(before) : pos] == before
        ]
        assert len(kept) >= 2  # rows after kept drafts were checked
        for pos, row in used:
            torch.testing.assert_close(row, want[pos], rtol=1e-5, atol=1e-5)
        if m := options.get("min_tokens"):  # a kept draft's row is where EOS is let through
            made = [(pos - len(before) - len(prompt), pos - len(prompt)) for pos, before, _ in got]
            assert any(
                start < m <= end and pos in kept
                for (start, end), (pos, _, _) in zip(made, got, strict=True)
            )
    finally:
        plain.shutdown()
        engine.shutdown()


@pytest.mark.parametrize("temperature", [0.0, 0.1])
def test_logprobs_of_verified_tokens_are_plain_decodings(gpt_oss: Path, temperature: float) -> None:
    """A request that asks for log-probabilities drafts too: each emitted token's comes from
    its own verified row, equal to plain decoding's (rounding aside), one per token, also
    where a stop id cuts the run."""
    prompt = [7, 8, 9, 10] * 8
    plain = Engine(EngineConfig(model=str(gpt_oss), max_total_tokens=2048))
    engine = spec_engine(gpt_oss, num_speculative_tokens=4)
    try:
        base = {"temperature": temperature, "seed": 3, "max_new_tokens": 40, "ignore_eos": True}
        free = plain.generate([prompt], SamplingParams(**base))[0].token_ids
        for extra in ({}, {"stop_token_ids": [free[25]]}):
            params = SamplingParams(logprobs=2, **base, **extra)
            want = plain.generate([prompt], params)[0]
            got = engine.generate([prompt], params)[0]
            assert got.token_ids == want.token_ids
            assert got.logprobs is not None and want.logprobs is not None
            assert len(got.logprobs) == len(got.token_ids)
            for g, w in zip(got.logprobs, want.logprobs, strict=True):
                assert (g.token_id, [t for t, _ in g.top]) == (w.token_id, [t for t, _ in w.top])
                assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert engine.stats.spec_accepted_tokens > 0  # it drafted, and kept some
        assert_pools_whole(engine)
    finally:
        plain.shutdown()
        engine.shutdown()


def test_a_request_sets_its_own_drafts_and_a_large_batch_takes_none(gpt_oss: Path) -> None:
    """`SamplingParams.num_speculative_tokens`: 0 turns a request's drafts off, 1 caps them
    at one per step, more than the server's k is k; `speculative_disable_by_batch_size`:
    no drafts in a step where that many requests decode."""
    prompt = [7, 8, 9, 10] * 8
    engine = spec_engine(gpt_oss, num_speculative_tokens=3)
    try:
        want = engine.generate([prompt], greedy(30))[0].token_ids
        per_verify = []
        for asked in (0, 1, 8):
            before = (engine.stats.spec_verifies, engine.stats.spec_draft_tokens)
            out = engine.generate([prompt], greedy(30, num_speculative_tokens=asked))[0]
            assert out.token_ids == want
            verifies = engine.stats.spec_verifies - before[0]
            drafts = engine.stats.spec_draft_tokens - before[1]
            per_verify.append((verifies > 0, drafts / max(verifies, 1)))
        assert per_verify[0] == (False, 0.0)
        assert per_verify[1] == (True, 1.0)
        assert per_verify[2][0] and 1.0 < per_verify[2][1] <= 3.0
    finally:
        engine.shutdown()
    engine = spec_engine(gpt_oss, speculative_disable_by_batch_size=2)
    try:
        assert engine.generate([prompt, prompt], greedy(30))[0].token_ids == want
        assert engine.stats.spec_verifies == 0
        assert engine.generate([prompt], greedy(30))[0].token_ids == want
        assert engine.stats.spec_verifies > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("top", [{"top_k": 20}, {"top_p": 0.9}, {}])
def test_seeded_sampling_with_drafts_gives_the_tokens_of_plain_decoding(
    gpt_oss: Path, top: dict
) -> None:
    """Each verified position draws what plain decoding draws there (the request's generator
    reseeded at that position): a seeded request's tokens are its tokens without drafts,
    alone or among others, whether or not it got drafts in a step."""
    prompt = [7, 8, 9, 10] * 8
    # Cool enough that its output repeats and drafts get accepted, warm enough to draw.
    params = SamplingParams(temperature=0.1, seed=11, max_new_tokens=60, ignore_eos=True, **top)
    plain = Engine(EngineConfig(model=str(gpt_oss), max_total_tokens=2048))
    engine = spec_engine(gpt_oss, speculative_disable_by_batch_size=3)
    try:
        want = plain.generate([prompt], params)[0].token_ids
        assert engine.generate([prompt], params)[0].token_ids == want
        verified = engine.stats.spec_verifies
        assert verified > 0
        others = [[1, 2, 3] * 5, [9, 9, 9, 9, 9], list(range(40, 70))]
        mixed = engine.generate(  # three decode beside it for a while: no drafts then
            [*others, prompt],
            [greedy(25), SamplingParams(temperature=1.0, max_new_tokens=25), greedy(5), params],
        )
        assert mixed[-1].token_ids == want
        assert engine.stats.spec_verifies > verified
        assert engine.stats.spec_accepted_tokens > 0  # some drafts were drawn and kept
        assert_pools_whole(engine)
    finally:
        plain.shutdown()
        engine.shutdown()


def test_a_failed_verify_step_releases_every_draft_slot(
    gpt_oss: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward of a step with drafts raises: its requests end with `error`, the slots of
    their drafts go back with the rest, the engine serves the next request."""
    engine = spec_engine(gpt_oss, page_size=4, num_speculative_tokens=4)
    try:
        rid = engine.add_request([3, 4, 5] * 10, greedy(30))
        forward = engine._forward
        failed = []

        def broken(model_input: ModelInput) -> torch.Tensor:
            rows = model_input.req_rows
            if rows.unique().numel() < rows.numel():  # a request's drafts: rows of its own
                failed.append(rows.numel())
                raise RuntimeError("device lost")
            return forward(model_input)

        monkeypatch.setattr(engine, "_forward", broken)
        outs: list = []
        while not outs or not outs[-1].finished:
            outs = engine.step()
            engine.check()
        assert failed and failed[0] > 1
        assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "error")]
        engine.check()
        monkeypatch.setattr(engine, "_forward", forward)
        assert engine.generate([[3, 4, 5] * 4], greedy(5))[0].finish_reason == "length"
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


def test_aborting_a_request_between_verify_steps_frees_everything(gpt_oss: Path) -> None:
    engine = spec_engine(gpt_oss, page_size=4, num_speculative_tokens=4)
    try:
        a = engine.add_request([3, 4, 5] * 10, greedy(60))
        b = engine.add_request([6, 7] * 12, greedy(60))
        while engine.stats.spec_verifies < 3:
            engine.step()
            engine.check()
        assert engine.abort(a)
        engine.check()
        while engine.has_unfinished_requests():
            engine.step()
            engine.check()
        assert engine.request_status(b) is None
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


# ---- the fuzz ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrival:
    step: int  # the step before which it is added
    phrase: int  # which repeated phrase its prompt is made of
    repeats: int
    tail: int  # own tokens after the phrases
    max_new_tokens: int
    abort_after: int | None  # steps after its arrival; None: never aborted
    kind: int  # 0 greedy, 1 greedy with a stop id, 2 penalized


arrivals = st.lists(
    st.builds(
        Arrival,
        step=st.integers(0, 30),
        phrase=st.integers(0, 3),
        repeats=st.integers(1, 10),
        tail=st.integers(0, 6),
        max_new_tokens=st.integers(1, 40),
        abort_after=st.one_of(st.none(), st.none(), st.none(), st.integers(0, 20)),
        kind=st.sampled_from([0, 0, 1, 2]),
    ),
    min_size=1,
    max_size=12,
)

configs = st.fixed_dictionaries(
    {
        "page_size": st.sampled_from([1, 4]),
        "max_total_tokens": st.sampled_from([160, 400]),
        "swa_full_tokens_ratio": st.sampled_from([0.3, 0.8]),
        "chunked_prefill_size": st.sampled_from([16, 32]),
        "swa_eviction_interval": st.sampled_from([1, 8]),
        "schedule_conservativeness": st.sampled_from([0.3, 1.0]),
        "enable_prefix_cache": st.booleans(),
        "num_speculative_tokens": st.sampled_from([1, 3, 6]),
        "max_running_requests": st.sampled_from([3, 8]),
    }
)

PHRASES = [[11, 12, 13], [40, 41, 42, 43, 44], [7, 7, 8], [90, 91, 92, 93, 94, 95, 96]]


def fuzz_params(a: Arrival, stop: int) -> SamplingParams:
    if a.kind == 1:
        return greedy(a.max_new_tokens, stop_token_ids=[stop])
    if a.kind == 2:
        return greedy(a.max_new_tokens, repetition_penalty=1.3)
    return greedy(a.max_new_tokens)


@settings(
    max_examples=14,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(config=configs, plan=arrivals)
@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_fuzz_every_request_equals_its_solo_run_without_drafts(
    fuzzed: dict[str, tuple[Path, Engine]], method: str, config: dict, plan: list[Arrival]
) -> None:
    """Requests arrive, share prefixes, are aborted, through tight pools with verify steps
    (n-gram drafts on GPT-OSS, MTP drafts on MiMo-V2-Flash): the engine never idles with
    work, every request that ends by itself has its solo run's tokens (an aborted one a prefix
    of them), `check()` holds after every step, and the pools are whole at the end."""
    model, solo = fuzzed[method]
    engine = spec_engine(model, speculative_method=method, **config)
    try:
        prompts = [PHRASES[a.phrase] * a.repeats + list(range(60, 60 + a.tail)) for a in plan]
        params = [fuzz_params(a, stop=PHRASES[a.phrase][0]) for a in plan]
        got: dict[str, list[int]] = {}
        ended: dict[str, str] = {}
        aborts: dict[int, list[str]] = {}
        step = 0
        last = max(a.step for a in plan)
        while step <= last or engine.has_unfinished_requests():
            assert step < 2000, f"stalled: {engine.headroom()}"
            for i, a in enumerate(plan):
                if a.step == step:
                    rid = engine.add_request(prompts[i], params[i], request_id=f"r{i}")
                    got[rid] = []
                    if a.abort_after is not None:
                        aborts.setdefault(step + a.abort_after, []).append(rid)
            for rid in aborts.pop(step, []):
                if rid not in ended and engine.abort(rid):
                    ended[rid] = "abort"
            had_work, runs = engine.has_unfinished_requests(), engine.stats.steps
            outs = engine.step()
            engine.check()
            assert not had_work or engine.stats.steps == runs + 1 or outs
            for out in outs:
                got[out.request_id] += out.new_token_ids
                if out.finished:
                    ended[out.request_id] = out.finish_reason or ""
            step += 1
        assert set(ended) == set(got) and "error" not in ended.values()
        for i in range(len(plan)):
            want = solo.generate([prompts[i]], params[i])[0].token_ids
            tokens = got[f"r{i}"]
            if ended[f"r{i}"] == "abort":
                assert tokens == want[: len(tokens)]
            else:
                assert tokens == want, f"r{i}"
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def fuzzed(
    gpt_oss: Path, tiny_model_factory: Callable[..., Path]
) -> Iterator[dict[str, tuple[Path, Engine]]]:
    """By drafter: its model and plain decoding on it, one request at a time (the reference)."""
    mimo = tiny_model_factory("mimo-v2-flash", num_layers=4, sliding_window_size=W, seed=3)
    models = {"ngram": gpt_oss, "mtp": mimo}
    engines = {
        m: Engine(EngineConfig(model=str(p), max_total_tokens=2048)) for m, p in models.items()
    }
    try:
        yield {m: (models[m], engines[m]) for m in models}
    finally:
        for engine in engines.values():
            engine.shutdown()


def test_generate_cli_with_ngram_drafts(gpt_oss: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`swaserve generate --speculative-method ngram`: the flags reach the engine, the text is
    plain decoding's."""
    from swaserve.cluster.cli import main

    argv = ["generate", "--model", str(gpt_oss), "--prompt", "abcabcabcabc"]
    argv += ["--max-new-tokens", "24", "--max-total-tokens", "512", "--json"]
    assert main(argv) == 0
    plain = capsys.readouterr().out.strip().splitlines()[-1]
    spec = ["--speculative-method", "ngram", "--num-speculative-tokens", "4"]
    assert main([*argv, *spec]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == plain
    with pytest.raises(ValueError, match="speculative_method"):
        main([*argv, "--speculative-method", "eagle"])


def test_check_fails_when_a_decoding_request_keeps_a_draft_slot(gpt_oss: Path) -> None:
    """Between steps a decoding request holds slots for exactly its computed tokens: the
    scheduler's `check()` fails on one that kept a draft's slot."""
    engine = spec_engine(gpt_oss)
    try:
        engine.add_request([3, 4, 5] * 10, greedy(20))
        while not any(r.is_decoding for r in engine.scheduler.running):
            engine.step()
        engine.scheduler.check()
        (req,) = engine.scheduler.running
        req.num_slots += 1
        with pytest.raises(RuntimeError, match="drafts"):
            engine.scheduler.check()
        req.num_slots -= 1
    finally:
        engine.shutdown()
