"""Tensor-parallel models on real 2-process gloo groups: TP = 2 prefill + decode logits equal
TP = 1 (float32, within 1e-4) for GPT-OSS and MiMo-V2-Flash tiny models, in every checkpoint
layout, with KV heads split and replicated (tp > KV heads), on the paged two-pool KV memory of
each rank's shard (`kv_spec(tp)`), and an uneven vocabulary (padded vocab-parallel head).

Rank 0 is the test process; rank 1 a spawned child that runs the same steps and sends its logits
back (the logits are gathered to rank 0 only: rank 1's forward returns [0, vocab])."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from swaserve.worker.attention.base import ForwardBatch
from swaserve.worker.attention.torch_backend import TorchAttentionBackend
from swaserve.worker.kv.memory import KVMemoryConfig, build_kv_memory
from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.loader import load_model
from swaserve.worker.runner.parallel import TPGroup, connect_store, create_store, init_tp_group

TIMEOUT_S = 30.0
TOLERANCE = 1e-4
PROMPTS = ([5, 17, 99, 3, 250, 41, 7, 12, 64], [200, 1, 33, 8, 90, 144])  # longer than W = 4
DECODE_TOKENS = ([11, 77, 42, 9], [6, 140, 2, 31])  # four one-token steps per request


def run_steps(tp: TPGroup, model_dir: str) -> list[np.ndarray]:
    """Prefill both prompts in one batch (logits of every position), then decode four fixed
    tokens per request, one batch per step; each step's logits [N, vocab] float32."""
    config = load_model_config(model_dir)
    memory = build_kv_memory(
        config.kv_spec(tp.world_size),
        KVMemoryConfig(max_total_tokens=64, swa_full_tokens_ratio=0.5),
    )
    backend = TorchAttentionBackend(memory.kv_pool, config.sliding_window_size)
    model = load_model(model_dir, backend, tp=tp)
    tokens = [list(p) for p in PROMPTS]
    slots: list[torch.Tensor] = []
    out: list[np.ndarray] = []
    cached = [0, 0]
    steps: list[list[list[int]]] = [tokens]
    steps += [[[a], [b]] for a, b in zip(*DECODE_TOKENS, strict=True)]
    for i, new in enumerate(steps):
        new_slots = [memory.allocator.alloc(len(t)) for t in new]
        assert all(s is not None for s in new_slots), "test pool too small"
        slots = new_slots if i == 0 else [torch.cat(p) for p in zip(slots, new_slots, strict=True)]  # type: ignore[arg-type]
        prefix = torch.tensor(cached)  # [B] int64
        seq_lens = prefix + torch.tensor([len(t) for t in new])  # [B] int64
        batch = ForwardBatch.from_slots(
            input_ids=torch.tensor([t for ts in new for t in ts]),  # [T] int64
            positions=torch.cat(
                [torch.arange(c, c + len(ts)) for c, ts in zip(cached, new, strict=True)]
            ),  # [T] int64
            prefix_lens=prefix,
            seq_lens=seq_lens,
            req_token_slots=slots,
            out_full_loc=torch.cat(new_slots),  # type: ignore[arg-type]
            allocator=memory.allocator if memory.two_pools else None,  # type: ignore[arg-type]
            logits_positions="all" if i == 0 else "last",
        )
        out.append(model(batch).numpy())
        cached = seq_lens.tolist()
    return out


def _child(port: int, fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    torch.set_num_threads(1)
    try:
        store = connect_store("127.0.0.1", port, 2, TIMEOUT_S)
        tp = init_tp_group(store, 1, 2, torch.device("cpu"), TIMEOUT_S)
        results.put(("ok", fn(tp, *args)))
    except BaseException:  # the parent reports it
        results.put(("error", traceback.format_exc()))


def run_on_two_ranks(fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """`fn(tp, *args)` on rank 0 (this process) and rank 1 (a spawned child) of a gloo group;
    (rank 0's result, rank 1's). The child is joined, or terminated, whatever happens."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = create_store(2, TIMEOUT_S)
    child = ctx.Process(target=_child, args=(store.port, fn, args, results), daemon=True)
    child.start()
    try:
        tp = init_tp_group(store, 0, 2, torch.device("cpu"), TIMEOUT_S)
        mine = fn(tp, *args)
        try:
            status, theirs = results.get(timeout=TIMEOUT_S)
        except queue.Empty:
            pytest.fail(f"rank 1 sent no result within {TIMEOUT_S} s")
        if status != "ok":
            pytest.fail(f"rank 1 failed:\n{theirs}")
        return mine, theirs
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.terminate()
            child.join(timeout=10)


def assert_tp2_matches_tp1(model_dir: Path) -> float:
    """TP = 2 logits on rank 0 equal TP = 1's within TOLERANCE, rank 1 holds none; returns the
    largest difference."""
    single = run_steps(TPGroup.single(), str(model_dir))
    rank0, rank1 = run_on_two_ranks(run_steps, str(model_dir))
    worst = 0.0
    for step, (want, got0, got1) in enumerate(zip(single, rank0, rank1, strict=True)):
        assert got0.shape == want.shape, f"step {step}"
        assert got1.shape == (0, want.shape[1]), f"step {step}"  # gathered to rank 0 only
        worst = max(worst, float(np.abs(got0 - want).max()))
    assert worst <= TOLERANCE
    return worst


CASES = {
    # 4 heads, 2 KV heads: one KV head per rank.
    "gpt-oss-kv2": dict(arch="gpt-oss"),
    # One KV head: tp = 2 exceeds it, both ranks hold a replica. Vocabulary 287: uneven, padded.
    "gpt-oss-kv1-vocab287": dict(arch="gpt-oss", num_kv_heads=1, vocab_size=287),
    "gpt-oss-mxfp4": dict(arch="gpt-oss", quantization="mxfp4"),
    # Full layers 1 KV head (replicated over the ranks), SWA layers 2 (split): per kind.
    "mimo-kv1x2": dict(arch="mimo-v2-flash", num_layers=3, num_kv_heads=1),
    "mimo-kv2x4-original": dict(arch="mimo-v2-flash", num_layers=3, checkpoint_format="original"),
    "mimo-fp8": dict(
        arch="mimo-v2-flash", num_layers=3, quantization="fp8", fp8_block_size=(16, 16)
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_logits_equal_tp1(name: str, tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory(**CASES[name])
    assert_tp2_matches_tp1(model_dir)
