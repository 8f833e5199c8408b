"""bench/speculative.py end to end (--quick: batches 1 and 8, in a subprocess): with n-gram and
MTP drafts the greedy tokens are plain decoding's, the model that repeats its text accepts
nearly every n-gram draft and the random one almost none, and every figure is there. No timing
asserts."""

from __future__ import annotations

import pytest
from bench_subprocess import run_bench_script


@pytest.mark.slow
def test_speculative_bench_keeps_the_tokens_and_reports_acceptance() -> None:
    data = run_bench_script("speculative", ["--quick"])
    assert data["k"] == 3 and data["compile"] is False
    assert set(data["models"]) == {"repeating", "random", "mtp"}
    for kind, rows in data["models"].items():
        assert set(rows) == {"1", "8"}
        for row in rows.values():
            assert row["same_tokens"] is True and row["differing_requests"] == 0
            assert row["plain_decode_tok_s"] > 0 and row["spec_decode_tok_s"] > 0
            assert row["verify_step_ratio"] > 0 and row["position_cost"] > 0
            if kind == "repeating":
                assert row["acceptance_len"] > 3.0 and row["draft_accept"] > 0.8
            else:
                assert row["draft_accept"] < 0.2
            if kind == "mtp":
                assert row["acceptance_len"] >= 1.0 and row["draft_share"] > 0
            else:
                assert row["draft_share"] == 0
