"""bench/forward.py runs in-process on a tiny model and ends with one JSON object holding the
figures and ratios (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
FIGURES = [
    f"{who}_{what}_tok_s"
    for who in ("swaserve", "hf")
    for what in ("prefill", "decode_b1", "decode_b32")
]
RATIOS = ["prefill_ratio", "decode_b1_ratio", "decode_b32_ratio"]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_forward", ROOT / "bench" / "forward.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_quick_bench_prints_a_table_then_one_json_object() -> None:
    bench = load_bench()
    out = io.StringIO()
    with redirect_stdout(out):
        assert bench.main(["--quick", "--json", "--threads", "1"]) == 0
    lines = out.getvalue().strip().splitlines()
    assert lines[0].startswith("gpt-oss: hidden 64, 2 layers, W=16")
    assert [line.split()[0] for line in lines[2:5]] == ["prefill", "decode", "decode"]
    report = json.loads(lines[-1])
    assert set(FIGURES + RATIOS) <= set(report)
    assert all(report[key] > 0 for key in FIGURES + RATIOS)
    for key in RATIOS:
        what = key.removesuffix("_ratio")
        assert report[key] == report[f"swaserve_{what}_tok_s"] / report[f"hf_{what}_tok_s"]
    # Informational (random weights leave near-ties that rounding may flip): only its type.
    assert isinstance(report["greedy_tokens_match"], bool)
    assert 0 <= report["greedy_requests_equal_frac"] <= 1
    assert (report["batch_size"], report["prompt_len"], report["threads"]) == (4, 48, 1)
