from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swaserve.cluster.cli import main as cli_main
from swaserve.cluster.kv_capacity import MODEL_SHAPES, capacity_row, capacity_table

REPO = Path(__file__).resolve().parents[3]


def test_shapes_are_the_real_models() -> None:
    mimo = MODEL_SHAPES["mimo-v2-flash"]
    assert (mimo.num_full_layers, mimo.num_swa_layers) == (9, 39)
    assert mimo.swa_token_bytes == 2 * mimo.full_token_bytes == 2 * 4 * (192 + 128) * 2
    oss = MODEL_SHAPES["gpt-oss-120b"]
    assert (oss.num_full_layers, oss.num_swa_layers, oss.full_token_bytes) == (18, 18, 8 * 128 * 2)


@pytest.mark.parametrize("model", sorted(MODEL_SHAPES))
@pytest.mark.parametrize("seq_len", [32_768, 131_072])
def test_auto_ratio_reaches_95_percent_of_the_bound(model: str, seq_len: int) -> None:
    shape = MODEL_SHAPES[model]
    row = capacity_row(model, shape, seq_len, 80 * 10**9)
    # The auto ratio gives the SWA pool 1.25x a request's W + I + P (windows kept for the
    # prefix cache): with W >= 1023 (Gemma 3; 4095 and Llama 4's C - 1 = 8191 too) that margin
    # is a few percent of a request's KV.
    assert row.auto >= (0.85 if shape.sliding_window_size >= 1023 else 0.95) * row.bound
    assert row.single_pool <= row.ratio_0_8 <= row.auto <= row.bound


def test_gemma3_27b_holds_5x_the_requests_of_one_pool_at_32k() -> None:
    gemma = MODEL_SHAPES["gemma-3-27b"]
    assert (gemma.num_full_layers, gemma.num_swa_layers) == (10, 52)
    row = capacity_row("gemma-3-27b", gemma, 32_768, 80 * 10**9)
    assert row.auto / row.single_pool >= 5


def test_the_sglang_column_follows_its_treatment_of_each_family() -> None:
    """One pool where SGLang forces one (Gemma 3, Command A, EXAONE 4): the single-pool count;
    Llama 4's chunks read as a window of C at r = 0.8; swaserve's auto ratio beats both."""
    for model in ("gemma-3-27b", "command-a", "exaone-4-32b"):
        row = capacity_row(model, MODEL_SHAPES[model], 32_768, 80 * 10**9)
        assert row.sglang == row.single_pool
        assert row.auto / row.sglang >= 2.5
    llama = capacity_row("llama-4-scout", MODEL_SHAPES["llama-4-scout"], 131_072, 80 * 10**9)
    assert (llama.single_pool, llama.sglang, llama.auto) == (3, 3, 9)


def test_mimo_32k_figures() -> None:
    row = capacity_row("mimo-v2-flash", MODEL_SHAPES["mimo-v2-flash"], 32_768, 80 * 10**9)
    # r = 0.8 fits only ~1.2-1.3x the single pool; the bound is ~9x.
    assert 1.1 <= row.ratio_0_8 / row.single_pool <= 1.4
    assert row.bound / row.single_pool >= 9
    assert row.auto / row.single_pool >= 9


def test_bench_json_last_line() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "kv_capacity.py"), "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    data = json.loads(out.strip().splitlines()[-1])
    assert len(data["results"]) == 3 * len(MODEL_SHAPES)
    for row in data["results"]:
        assert set(row) >= {"model", "seq_len", "single_pool", "ratio_0.8", "auto", "bound"}


def test_cli_kv_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["kv-capacity", "--seq-lens", "4096", "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["seq_len"] for r in data["results"]] == [4096] * len(MODEL_SHAPES)


def test_tp_divides_the_kv_heads_so_a_rank_budget_holds_the_groups_tokens() -> None:
    from swaserve.cluster.kv_capacity import model_shapes

    one, eight = model_shapes(1)["mimo-v2-flash"], model_shapes(8)["mimo-v2-flash"]
    # MiMo-V2-Flash: 4 full KV heads (replicated at tp = 8: 1 per rank), 8 SWA KV heads (1 each).
    assert eight.full_token_bytes * 4 == one.full_token_bytes
    assert eight.swa_token_bytes * 8 == one.swa_token_bytes
    budget = int(80e9)
    single = capacity_table(budget, [32768])[1]
    sharded = capacity_table(budget, [32768], tp_size=8)[1]
    assert single.model == sharded.model == "mimo-v2-flash"
    assert (single.bound, sharded.bound) == (99, 409)
