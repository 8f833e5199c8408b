"""bench/structured_output.py end to end (--quick: batch 8): the constrained and the free runs
both decode every token, and every figure is there. No timing asserts."""

from __future__ import annotations

import pytest
from bench_subprocess import run_bench_script


@pytest.mark.slow
def test_structured_output_bench_prints_its_ratio() -> None:
    data = run_bench_script("structured_output", ["--quick"])
    assert set(data["batches"]) == {"8"}
    batch = data["batches"]["8"]
    for side in ("free", "half_constrained"):
        assert set(batch[side]) == {"decode_step_ms", "decode_tok_s"}
        assert all(v > 0 for v in batch[side].values())
    assert batch["ratio"] > 0
    assert data["compile_ms"] > 0 and data["mask_us"] > 0
