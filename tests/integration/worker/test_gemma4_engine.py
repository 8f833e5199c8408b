"""Gemma 4 through the real engine: greedy output equals transformers' with KV-shared layers
(which own no KV), per-layer inputs and the MoE block, on two pools at P = 1 and 4 and on one
pool. (The liveness fuzz runs on Gemma 4 in test_engine_liveness.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_checkpoint_formats_golden import hf_greedy, workload

from swaserve.worker import Engine, EngineConfig, SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("page_size", "single_pool"), [(1, False), (4, False), (4, True)], ids=["p1", "p4", "one-pool"]
)
def test_moe_gemma4_greedy_equals_transformers(
    tiny_model_factory: Callable[..., Path], page_size: int, single_pool: bool
) -> None:
    model = tiny_model_factory(
        "gemma4", num_layers=6, sliding_window_size=8, seed=7, enable_moe_block=True
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="eager"
    )
    prompts = workload(1)
    expected = hf_greedy(hf, prompts)
    engine = Engine(
        EngineConfig(
            model=str(model),
            max_total_tokens=320,
            swa_full_tokens_ratio=0.3,
            schedule_conservativeness=0.2,
            chunked_prefill_size=32,
            page_size=page_size,
            swa_eviction_interval=8,
            max_running_requests=4,
            disable_hybrid_swa_memory=single_pool,
        )
    )
    try:
        assert engine.runner.kv_pool.num_layers == 4  # layers 4 and 5 read layers 3 and 2
        outs = engine.generate(
            prompts, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
        )
        engine.check()
        assert [o.token_ids for o in outs] == expected
        if not single_pool:
            assert engine.stats.swa_freed_tokens > 0 and engine.stats.tombstoned_pages > 0
    finally:
        engine.shutdown()
