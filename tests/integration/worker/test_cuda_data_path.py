"""CUDA only (skipped without a GPU): one decode step's input copy, metadata build, forward and
sampling read nothing back from the device and copy to it only from pinned buffers without
waiting (`host_tensors.to_device`); only the sampled tokens are read afterwards. The CPU
stand-in of this check is tests/unit/worker/attention/test_step_traffic.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch", ["gpt-oss", "mimo-v2-flash"])
@pytest.mark.parametrize(
    ("backend", "page_size"), [("torch", 1), ("flash", 1), ("flash", 16)]
)  # flash: gathered, paged
def test_a_decode_step_never_syncs_with_the_host(
    tiny_model_factory: Callable[..., Path], arch: str, backend: str, page_size: int
) -> None:
    if backend == "flash":
        pytest.importorskip("vllm_flash_attn")
    model_dir = tiny_model_factory(arch, num_layers=4, sliding_window_size=8, hidden_size=64)
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            device="cuda",
            dtype="bfloat16",
            max_total_tokens=4096,
            page_size=page_size,
            attention_backend=backend,
        )
    )
    params = SamplingParams(temperature=0.7, top_k=20, max_new_tokens=64, seed=1, ignore_eos=True)
    for i in range(4):
        engine.add_request([(i * 31 + j) % 250 + 1 for j in range(40)], params)
    for _ in range(3):
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch is not None and all(n == 1 for n in batch.extend_lens)
    model_input = engine._model_input(batch)  # host work on rank 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = engine.runner.forward(model_input)
        tokens = engine.sampler.sample(
            logits, [r.params for r in batch.reqs], [r.generator for r in batch.reqs]
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    next_tokens = tokens.tolist()  # the one read-back of the step
    engine.scheduler.process_results(batch, next_tokens)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check()
