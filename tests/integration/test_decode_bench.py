"""bench/decode.py end to end (--quick: GPT-OSS, batches 1 and 8, in a subprocess with its own
inductor cache): the compiled, the eager and the default (compiled in the background) decode
step give the same greedy tokens, every figure is there, and the compile's start-up cost is
measured cold and cached. No timing asserts."""

from __future__ import annotations

import pytest
from bench_subprocess import run_bench_script


@pytest.mark.slow
def test_decode_bench_compiled_equals_eager() -> None:
    data = run_bench_script("decode", ["--quick"])
    result = data["results"]["gpt-oss"]
    assert set(result["batches"]) == {"1", "8"}
    for batch in result["batches"].values():
        assert batch["same_tokens"] is True
        assert batch["default_ratio"] > 0
        for side in ("eager", "compiled", "default"):
            assert set(batch[side]) == {"decode_step_ms", "decode_tok_s", "prefill_tok_s"}
            assert all(v > 0 for v in batch[side].values())
    assert result["compile_cold_s"] > 0 and result["compile_cached_s"] > 0
    assert result["background_s"] > 0
