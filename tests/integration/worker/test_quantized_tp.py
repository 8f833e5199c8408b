"""Quantized checkpoints kept quantized under tensor parallelism: each rank holds its shard of
the stored form (MXFP4 blocks + scales cut along N, or along K by whole 32-value groups; FP8
weights with their expanded scales) and TP = 2 logits equal TP = 1's dequantized-at-load logits
within 1e-4 (float32, real 2-process gloo groups). The engine over such a group:
test_quantized_memory.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import test_tp_model
from test_tp_model import TOLERANCE, run_on_two_ranks, run_steps

from swaserve.worker.models.causal_lm import HybridCausalLM
from swaserve.worker.models.loader import load_model
from swaserve.worker.runner.parallel import TPGroup


def run_steps_kept_quantized(tp: TPGroup, model_dir: str) -> list[np.ndarray]:
    """`test_tp_model.run_steps` (prefill, then four decode steps; each step's logits) on a
    model that keeps the checkpoint quantized, in whichever process (rank) calls it."""

    def kept(*args: Any, **kwargs: Any) -> HybridCausalLM:
        model = load_model(*args, **kwargs, dequantize_weights=False)
        assert any(getattr(m, "quantized", None) for m in model.modules()), "nothing kept"
        return model

    with mock.patch.object(test_tp_model, "load_model", kept):
        return run_steps(tp, model_dir)


CASES = {
    # I = 32 over 2 ranks: each rank's 16 K rows of down_proj lie inside one 32-value group.
    "gpt-oss-mxfp4-k-inside-a-group": dict(arch="gpt-oss", quantization="mxfp4"),
    # I = 96: ranks hold groups [0, 2) and [1, 3) of down_proj's K, group 1 on both.
    "gpt-oss-mxfp4-k-straddles": dict(arch="gpt-oss", quantization="mxfp4", intermediate_size=96),
    "gpt-oss-fp8": dict(arch="gpt-oss", quantization="fp8", fp8_block_size=(16, 16)),
    "mimo-fp8": dict(
        arch="mimo-v2-flash", num_layers=3, quantization="fp8", fp8_block_size=(16, 16)
    ),
    # Blocks that divide nothing, per-expert gate / up tensors (their scale blocks do not line up
    # with a packed [2I, D] tensor's).
    "mimo-fp8-original-uneven-blocks": dict(
        arch="mimo-v2-flash",
        num_layers=3,
        quantization="fp8",
        fp8_block_size=(20, 24),
        checkpoint_format="original",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_quantized_logits_equal_tp1_dequantized(
    name: str, tiny_model_factory: Callable[..., Path]
) -> None:
    model_dir = str(tiny_model_factory(**CASES[name]))
    want = run_steps(TPGroup.single(), model_dir)  # dequantized at load
    single = run_steps_kept_quantized(TPGroup.single(), model_dir)
    rank0, _ = run_on_two_ranks(run_steps_kept_quantized, model_dir)
    for step, (w, s, got) in enumerate(zip(want, single, rank0, strict=True)):
        np.testing.assert_array_equal(s, w, err_msg=f"step {step}: TP = 1 kept quantized")
        assert got.shape == w.shape
        assert float(np.abs(got - w).max()) <= TOLERANCE, f"step {step}"
