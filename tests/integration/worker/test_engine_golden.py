"""End to end against transformers: greedy tokens of 16 prompts through small pools where SWA
freeing, tombstones, retraction and chunked prefill all happen — every request equals its solo
run — on a windowed, a chunked and a KV-sharing model."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams

W = 8
INTERVAL = 16
MAX_NEW = 40
SPEC_K = 3


def workload(seed: int) -> list[list[int]]:
    """16 prompts of 1..300 tokens; half share a 48-token system prefix."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(48)]
    prompts = []
    for i in range(16):
        n = rng.randint(1, 300) if i % 4 else rng.randint(1, 5)
        body = [rng.randrange(1, 250) for _ in range(n)]
        prompts.append((system + body)[:n] if i % 2 else body)
    return prompts


@pytest.fixture(scope="module", params=["gpt-oss", "llama4", "gemma4"])
def hf_reference(
    request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]
) -> tuple[Path, list[list[int]], list[list[int]]]:
    """GPT-OSS (window W), Llama 4 (chunks of C = W) and Gemma 4 (KV-shared layers)."""
    transformers = pytest.importorskip("transformers")
    path = tiny_model_factory(
        request.param,
        num_layers=6 if request.param == "gemma4" else 4,
        sliding_window_size=W,
        hidden_size=32,
        seed=3,
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = workload(0)
    expected = []
    for prompt in prompts:
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
        )
        expected.append(out[0, len(prompt) :].tolist())
    return path, prompts, expected


def own_swa_slots(engine: Engine) -> list[int]:
    """SWA slots each decoding request holds itself (the tree's part excluded)."""
    held = []
    for req in engine.scheduler.running:
        if req.is_decoding and req.num_computed > W:
            own = req.slots[req.swa.cache_protected_len : req.num_computed]
            held.append(int((engine.allocator.translate(own) > 0).sum()))
    return held


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [None, "ngram"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_tokens_equal_transformers_under_memory_pressure(
    hf_reference: tuple[Path, list[list[int]], list[list[int]]],
    page_size: int,
    speculative: str | None,
) -> None:
    """With n-gram drafts too: verify steps among retractions, SWA freeing and chunks, every
    token still equal to transformers' greedy one."""
    path, prompts, expected = hf_reference
    engine = Engine(
        EngineConfig(
            model=str(path),
            max_total_tokens=400,
            schedule_conservativeness=0.2,  # admit optimistically: retraction must happen
            swa_full_tokens_ratio=0.3,
            chunked_prefill_size=32,
            page_size=page_size,
            swa_eviction_interval=INTERVAL,
            max_running_requests=8,
            speculative_method=speculative,
            num_speculative_tokens=SPEC_K,
        )
    )
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)
    # A decode keeps at most W + I + P SWA slots after freeing; a verify step adds its kept
    # drafts (up to k) before the next freeing.
    bound = W + INTERVAL + page_size + (SPEC_K if speculative else 0)
    ids = [engine.add_request(p, params) for p in prompts]
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        assert all(n <= bound for n in own_swa_slots(engine))
        engine.check()
    for rid, want in zip(ids, expected, strict=True):
        assert got[rid] == want
    stats = engine.stats
    assert stats.swa_freed_tokens > 0
    assert stats.tombstoned_pages > 0
    assert stats.retractions > 0
    assert stats.prefill_chunks > 0
    assert (stats.spec_accepted_tokens > 0) == (speculative is not None)
    engine.flush_cache()
    head = engine.headroom()
    assert head.full_free_tokens == head.full_total_tokens
    assert head.swa_free_tokens == head.swa_total_tokens
    engine.check()
