"""Window checkpoints and exact window repair through the engine (architecture §6): a cached prefix
whose window lost its SWA KV is resumed by recomputing only its last R = L_swa · W tokens, and
the greedy tokens equal a cold run of the same prompt (float32), at P = 1 and 4, with and
without chunked prefill (chunks smaller than R), on both architectures, and at TP = 2 (gloo)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from swaserve.proto.kv_rules import window_repair_tokens
from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.runner.model_input import ModelInput

W = 8
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
SYSTEM = [random.Random(0).randrange(1, 200) for _ in range(100)]
PROMPTS = [
    [*SYSTEM, 5, 6, 7],
    [*SYSTEM, 9, 9, 9, 9],  # diverges inside the first prompt's tombstoned interior
    [*SYSTEM, 11, 12],
    [*SYSTEM[:60], *[3] * 20],  # a shorter stem: its window was never a checkpoint
    [*SYSTEM, 5, 6, 7, 1],
]


@pytest.fixture(scope="module", params=["gpt-oss", "mimo-v2-flash"])
def model_dir(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(
        request.param, num_layers=4, sliding_window_size=W, hidden_size=32, seed=3
    )


def make_engine(model_dir: Path, **overrides: object) -> Engine:
    """An engine whose checkpoints keep exactly W + P tokens (no slack), so that a resume a
    few tokens before a prompt's end needs a repair, as these scenarios mean."""
    options: dict[str, object] = dict(
        model=str(model_dir),
        max_total_tokens=1024,
        swa_full_tokens_ratio=0.5,
        dtype="float32",
        window_checkpoint_slack_tokens=0,
    )
    options.update(overrides)
    return Engine(EngineConfig(**options))  # type: ignore[arg-type]


def cold_tokens(model_dir: Path, prompts: list[list[int]], **overrides: object) -> list[list[int]]:
    cold = make_engine(model_dir, enable_prefix_cache=False, **overrides)
    try:
        return [out.token_ids for out in cold.generate(prompts, GREEDY)]
    finally:
        cold.shutdown()


def run_one_by_one(engine: Engine, prompts: list[list[int]]) -> list:
    outs = []
    for prompt in prompts:
        outs.append(engine.generate([prompt], GREEDY)[0])
        engine.check()
    return outs


def assert_pools_whole(engine: Engine) -> None:
    engine.flush_cache()
    head = engine.headroom()
    assert (head.full_free_tokens, head.swa_free_tokens) == (
        head.full_total_tokens,
        head.swa_total_tokens,
    )


def repair_len(engine: Engine) -> int:
    mc = engine.model_config
    return window_repair_tokens(len(mc.swa_layer_ids), W, engine.page_size)


@pytest.mark.parametrize(
    "options",
    [
        {"page_size": 1, "chunked_prefill_size": None},
        {"page_size": 4, "chunked_prefill_size": None},
        # A small SWA pool: interiors are tombstoned under pressure, repairs span chunks.
        {"page_size": 1, "chunked_prefill_size": 8, "swa_full_tokens_ratio": 0.08},
        {"page_size": 4, "chunked_prefill_size": 4, "swa_full_tokens_ratio": 0.08},
    ],
    ids=["p1", "p4", "p1-chunk8", "p4-chunk4"],
)
def test_repaired_hits_give_the_cold_tokens(model_dir: Path, options: dict) -> None:
    engine = make_engine(model_dir, **options)
    r = repair_len(engine)
    assert engine.window_repair_tokens == r and r == 8 * len(engine.model_config.swa_layer_ids)
    outs = run_one_by_one(engine, PROMPTS)
    assert [o.token_ids for o in outs] == cold_tokens(model_dir, PROMPTS, **options)
    assert engine.stats.window_repairs >= 1
    assert engine.stats.window_repair_tokens == r * engine.stats.window_repairs
    # The stem of 60 cached tokens lost its window: it is resumed at 60 - R, so 60 - R tokens
    # are not computed (a plain match would have reused nothing).
    assert outs[3].cached_tokens == 60 - r
    assert_pools_whole(engine)
    engine.shutdown()


def test_the_same_prompt_again_reuses_all_but_its_last_token(model_dir: Path) -> None:
    engine = make_engine(model_dir, chunked_prefill_size=None)
    prompt = PROMPTS[0]
    first, second = run_one_by_one(engine, [prompt, prompt])
    # The decode left the window: the prompt's last W + P tokens stayed as a checkpoint.
    assert (first.cached_tokens, second.cached_tokens) == (0, len(prompt) - 1)
    assert engine.stats.window_repairs == 0
    assert second.token_ids == first.token_ids
    engine.shutdown()


def test_a_checkpoints_slack_resumes_a_few_tokens_before_the_prompts_end(
    model_dir: Path,
) -> None:
    """With the default slack (8 tokens), the turn that diverges 3 tokens before the first
    prompt's end (a template that re-renders the generation prompt's end) resumes from the
    checkpoint: everything before the divergence, no repair, the same tokens as a cold run."""
    engine = make_engine(model_dir, chunked_prefill_size=None, window_checkpoint_slack_tokens=8)
    assert engine.tree is not None and engine.tree.checkpoint_tokens == W + 8 + 1
    outs = run_one_by_one(engine, PROMPTS[:2])
    assert outs[1].cached_tokens == len(SYSTEM)
    assert engine.stats.window_repairs == 0
    assert [o.token_ids for o in outs] == cold_tokens(model_dir, PROMPTS[:2])
    assert_pools_whole(engine)
    engine.shutdown()


def test_a_repair_writes_no_full_kv_entry_and_reads_no_swa_before_its_start(
    model_dir: Path,
) -> None:
    engine = make_engine(model_dir, chunked_prefill_size=None)
    seen: list[ModelInput] = []
    forward = engine.runner.forward

    def recording(inp: ModelInput) -> object:
        seen.append(inp)
        return forward(inp)

    engine.runner.forward = recording  # type: ignore[method-assign]
    run_one_by_one(engine, PROMPTS[:2])
    r = repair_len(engine)
    repairs = [inp for inp in seen if inp.window_repair is not None]
    assert len(repairs) == 1
    inp = repairs[0]
    # The second prompt matches 100 tokens (the first one's prompt, diverging at 100) and
    # resumes at 100 - R: its step computes [100 - R, 104), the repair covers [100 - R, 100).
    assert inp.window_repair.tolist() == [[100 - r], [100]]
    assert (inp.prefix_lens.tolist(), inp.seq_lens.tolist()) == ([100 - r], [104])
    assert inp.full_table_tokens().tolist() == [r, r + 1, r + 2, r + 3]
    assert inp.swa_floor().tolist() == [100 - r]
    engine.shutdown()


def test_aborting_a_request_mid_repair_leaves_the_pools_whole(model_dir: Path) -> None:
    engine = make_engine(model_dir, chunked_prefill_size=4, page_size=4)
    run_one_by_one(engine, PROMPTS[:1])
    engine.tree.evict(0, engine.tree.swa_evictable_size() - engine.tree.checkpoint_tokens)
    rid = engine.add_request(PROMPTS[1], GREEDY)
    engine.step()  # the first chunk of the repair
    req = engine._requests[rid]
    repair = engine.kv.repair_of(req)
    assert repair is not None and repair.end == 100 and req.num_computed < repair.end
    engine.check()
    assert engine.abort(rid)
    engine.check()
    assert_pools_whole(engine)
    engine.shutdown()


@pytest.mark.parametrize("page_size", [1, 4])
def test_repaired_hits_with_drafts_give_the_cold_tokens(model_dir: Path, page_size: int) -> None:
    """Speculative decoding over repaired hits (n-gram drafts; MTP drafts on MiMo-V2-Flash,
    whose depths' KV the repair recomputes with the window): the requests that resume by a
    window repair then verify drafts, and every token is the cold engine's without drafts."""
    options = {"page_size": page_size, "chunked_prefill_size": 8, "swa_full_tokens_ratio": 0.08}
    method = "mtp" if "mimo" in model_dir.name else "ngram"
    engine = make_engine(model_dir, speculative_method=method, num_speculative_tokens=3, **options)
    outs = run_one_by_one(engine, PROMPTS)
    assert [o.token_ids for o in outs] == cold_tokens(model_dir, PROMPTS, **options)
    assert engine.stats.window_repairs >= 1 and engine.stats.spec_verifies > 0
    assert_pools_whole(engine)
    engine.shutdown()


def test_window_repair_can_be_turned_off(model_dir: Path) -> None:
    engine = make_engine(model_dir, chunked_prefill_size=None, enable_window_repair=False)
    assert engine.window_repair_tokens == 0
    outs = run_one_by_one(engine, PROMPTS[:2])
    assert outs[1].cached_tokens == 0 and engine.stats.window_repairs == 0
    engine.shutdown()


@pytest.mark.slow
def test_repairs_at_tp2_give_the_tp1_tokens(model_dir: Path) -> None:
    options = {"page_size": 4, "chunked_prefill_size": 4, "swa_full_tokens_ratio": 0.08}
    engine = make_engine(model_dir, tp_size=2, tp_timeout_s=30.0, **options)
    try:
        outs = run_one_by_one(engine, PROMPTS)
        assert engine.stats.window_repairs >= 1
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outs] == cold_tokens(model_dir, PROMPTS, **options)
