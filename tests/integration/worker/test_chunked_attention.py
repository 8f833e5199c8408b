"""Chunked attention (Llama 4) on two pools, through the real engine: greedy output equals
transformers' at P = 1 and 4 with prefix hits; the local-layer KV a decoding request holds stays
within C + I + 2P and drops to the current chunk's share at every chunk boundary; the prefix
cache's chunk rule resumes at a chunk boundary inside a tombstone; freed chunks are never read.
(The liveness fuzz runs on Llama 4 in test_engine_liveness.py.)"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams

transformers = pytest.importorskip("transformers")

C = 8
MAX_NEW = 3 * C


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llama4(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama4", num_layers=4, sliding_window_size=C, seed=5)


def prompts(seed: int) -> list[list[int]]:
    """6 prompts over several chunks; half share a 2.5-chunk system prefix."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(5 * C // 2)]
    out = []
    for i in range(6):
        body = [rng.randrange(1, 250) for _ in range(rng.randint(1, 6 * C))]
        out.append(system + body if i % 2 else body)
    return out


def hf_greedy(model_dir: Path, batch: list[list[int]]) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    outs = []
    with torch.no_grad():
        for prompt in batch:
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=None,
            )
            outs.append(out[0, len(prompt) :].tolist())
    return outs


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_equals_transformers_with_prefix_hits(llama4: Path, page_size: int) -> None:
    batch = prompts(1)
    expected = hf_greedy(llama4, batch)
    engine = Engine(
        EngineConfig(
            model=str(llama4),
            max_total_tokens=400,
            swa_full_tokens_ratio=0.3,
            chunked_prefill_size=12,  # chunks that do not line up with C: the cut is at C
            page_size=page_size,
            swa_eviction_interval=4,
            max_running_requests=3,
        )
    )
    try:
        assert engine.tree is not None and engine.tree.attention_chunk_size == C
        first = engine.generate(batch[:2], greedy(MAX_NEW))
        rest = engine.generate(batch[2:], greedy(MAX_NEW))  # their system prefix is cached
        engine.check()
        assert [o.token_ids for o in first + rest] == expected
        assert engine.stats.cached_tokens >= 2 * (5 * C // 2 // page_size * page_size)
        assert engine.stats.swa_freed_tokens > 0 and engine.stats.tombstoned_pages > 0
        assert engine.stats.window_repairs == 0  # a chunk boundary is always as good
    finally:
        engine.shutdown()


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_decoding_request_holds_at_most_c_plus_i_plus_2p(
    llama4: Path, page_size: int, prefix_cache: bool
) -> None:
    """Local-layer (SWA-pool) slots the request's own positions hold after every step: never
    more than C + I + 2P; once a step crosses a chunk boundary nothing of the chunks before is
    left but the page at the boundary (the tree's end stays matchable by it)."""
    p, interval = page_size, 4
    engine = Engine(
        EngineConfig(
            model=str(llama4),
            max_total_tokens=256,
            swa_full_tokens_ratio=0.5,
            page_size=p,
            swa_eviction_interval=interval,
            enable_prefix_cache=prefix_cache,
        )
    )
    try:
        engine.add_request(list(range(1, 12)), greedy(8 * C), request_id="a")
        held_at: dict[int, int] = {}
        while engine.has_unfinished_requests():
            engine.step()
            engine.check()
            running = engine.scheduler.running
            if not running:
                break
            req = running[0]
            n = req.num_computed
            own = req.slots[req.swa.cache_protected_len : n]
            held_at[n] = int((engine.allocator.translate(own) > 0).sum())
        assert max(held_at.values()) <= C + interval + 2 * p
        crossed = [n for n in held_at if n % C == 1 and n > C]
        assert len(crossed) >= 6
        for n in crossed:  # the step after a boundary: one page of the chunks before is left
            assert held_at[n] <= 1 + p, (n, held_at[n])
        for n, held in held_at.items():  # the current chunk's tokens and that page (I < C)
            if n > C:
                assert held <= (n - 1) % C + 1 + p, (n, held)
    finally:
        engine.shutdown()


def test_a_match_resumes_at_a_chunk_boundary_inside_a_tombstone(llama4: Path) -> None:
    """A long prompt prefilled through a small local pool leaves its first chunks tombstoned
    (SWA eviction takes the oldest first). A new prompt that shares it up to C + 3 resumes at
    the chunk boundary C inside the tombstone (the window rule would resume nowhere: no live
    window before any end there), and its output is the solo run's."""
    engine = Engine(
        EngineConfig(
            model=str(llama4),
            max_total_tokens=256,
            swa_full_tokens_ratio=32.5 / 256,
            swa_eviction_interval=1,
            window_checkpoint_slack_tokens=0,
        )
    )
    fork = [*range(1, C + 4), 250, 251, 252]
    try:
        assert engine.plan.swa_tokens == 32
        engine.generate([list(range(1, 6 * C))], greedy(1))
        assert engine.stats.tombstoned_pages > 0
        (out,) = engine.generate([fork], greedy(6))
        assert out.cached_tokens == C
        engine.check()
    finally:
        engine.shutdown()
    solo = Engine(EngineConfig(model=str(llama4), max_total_tokens=256, enable_prefix_cache=False))
    try:
        (alone,) = solo.generate([fork], greedy(6))
        assert alone.token_ids == out.token_ids
    finally:
        solo.shutdown()


def test_the_start_up_prefill_measurement_stays_within_one_chunk(llama4: Path) -> None:
    """The engine times a prefill at start (the router's first speed estimate): on a chunked
    model it is one chunk long, an extend the kernels can read."""
    engine = Engine(EngineConfig(model=str(llama4), max_total_tokens=2048))
    try:
        assert engine.stats.prefill_tokens == C
        (out,) = engine.generate([list(range(1, 5 * C))], greedy(4))
        assert len(out.token_ids) == 4
    finally:
        engine.shutdown()


def test_nan_in_every_swa_row_no_live_position_maps_to_never_reaches_the_logits(
    llama4: Path,
) -> None:
    """After every step, every SWA pool row that no running request's computed position and no
    cached node maps to — the chunks freed at each boundary among them — is filled with NaN;
    the greedy tokens stay those of a clean run (the kernels read only live chunk keys)."""
    prompts = [list(range(1, 3 * C + 4)), list(range(40, 40 + C + 2))]
    clean = Engine(EngineConfig(model=str(llama4), max_total_tokens=256, swa_eviction_interval=1))
    try:
        want = [o.token_ids for o in clean.generate(prompts, greedy(4 * C))]
    finally:
        clean.shutdown()
    engine = Engine(EngineConfig(model=str(llama4), max_total_tokens=256, swa_eviction_interval=1))
    try:
        pool = engine.runner.kv_pool.swa_pool
        ids = [engine.add_request(p, greedy(4 * C)) for p in prompts]
        got: dict[str, list[int]] = {i: [] for i in ids}
        poisoned = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
            assert engine.tree is not None
            held = [r.slots[: r.num_computed] for r in engine.scheduler.running]
            live = engine.allocator.translate(torch.cat([engine.tree.cached_indices(), *held]))
            unused = torch.ones(pool.size + pool.page_size, dtype=torch.bool)
            unused[live[live > 0]] = False
            for buf in (*pool.k_buffer, *pool.v_buffer):
                buf[unused] = float("nan")
            poisoned = max(poisoned, int(unused.sum()))
        assert [got[i] for i in ids] == want
        assert poisoned > pool.size // 2  # most of the pool was NaN at some point
        assert engine.stats.swa_freed_tokens > 0
    finally:
        engine.shutdown()
