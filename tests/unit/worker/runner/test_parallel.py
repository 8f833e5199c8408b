"""How a rank waits for its collectives, chosen by backend (`Collectives.for_backend`): on NCCL
no collective of a whole model forward is waited for with a timeout (a fake NCCL-like group
records every `wait`), on gloo each is, and a rank that never joins one makes the others raise
`TensorParallelError` within the timeout; rank 0 alone gets the gathered logits; ranks wait for
rank 0's next step for longer than the timeout. Gloo groups here are two threads of this
process (gloo's collectives release the GIL)."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from swaserve.worker.attention.base import ForwardBatch
from swaserve.worker.attention.torch_backend import TorchAttentionBackend
from swaserve.worker.kv.memory import KVMemoryConfig, build_kv_memory
from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.loader import load_model
from swaserve.worker.models.tp_layers import ParallelLMHead
from swaserve.worker.runner.parallel import (
    Collectives,
    TensorParallelError,
    TPGroup,
    connect_store,
    create_store,
    init_tp_group,
    nccl_env_problems,
)


# ---- a fake NCCL-like group ------------------------------------------------------------------
class FakeWork:
    def __init__(self, waits: list[tuple[Any, ...]]) -> None:
        self._waits = waits

    def wait(self, *args: Any) -> bool:
        self._waits.append(args)
        return True


class FakeGroup:
    """Rank 0 of 2 whose peer holds zeros: sums and gathers complete at once; every `wait` is
    recorded with its arguments."""

    def __init__(self) -> None:
        self.waits: list[tuple[Any, ...]] = []
        self.calls: list[str] = []

    def _work(self, name: str) -> FakeWork:
        self.calls.append(name)
        return FakeWork(self.waits)

    def allreduce(self, tensors: list[torch.Tensor], _: Any) -> FakeWork:
        return self._work("allreduce")

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], _: Any) -> Any:
        outputs[0][0].copy_(inputs[0])
        outputs[0][1].zero_()
        return self._work("gather")

    def broadcast(self, tensors: list[torch.Tensor], _: Any) -> FakeWork:
        return self._work("broadcast")


def _prefill(model: Any, memory: Any, tokens: list[int]) -> torch.Tensor:
    slots = memory.allocator.alloc(len(tokens))
    batch = ForwardBatch.from_slots(
        input_ids=torch.tensor(tokens),  # [T] int64
        positions=torch.arange(len(tokens)),  # [T] int64
        prefix_lens=torch.tensor([0]),
        seq_lens=torch.tensor([len(tokens)]),
        req_token_slots=[slots],
        out_full_loc=slots,
        allocator=memory.allocator if memory.two_pools else None,
    )
    return model(batch)


@pytest.mark.parametrize(
    ("backend", "timed"), [("nccl", False), ("gloo", True)], ids=["nccl", "gloo"]
)
def test_a_model_forward_waits_with_a_timeout_only_on_gloo(
    backend: str, timed: bool, tiny_model_factory: Callable[..., Path]
) -> None:
    """Rank 0 of a TP = 2 GPT-OSS forward: the embedding's all-reduce, two per layer (attention,
    MoE) and the logits' gather. NCCL: every one waited for with no timeout (the stream is
    ordered after it; the CPU goes on). Gloo: every one with `timeout_s`."""
    num_layers = 3
    model_dir = tiny_model_factory(
        "gpt-oss", sliding_window_size=4, hidden_size=32, seed=5, num_layers=num_layers
    )
    group = FakeGroup()
    tp = TPGroup(
        rank=0,
        world_size=2,
        timeout_s=7.0,
        device_comm=Collectives.for_backend(backend, group, 0, 2, 7.0),
    )
    config = load_model_config(str(model_dir))
    memory = build_kv_memory(
        config.kv_spec(2), KVMemoryConfig(max_total_tokens=64, swa_full_tokens_ratio=0.5)
    )
    backend_ = TorchAttentionBackend(memory.kv_pool, config.sliding_window_size)
    model = load_model(str(model_dir), backend_, tp=tp)

    logits = _prefill(model, memory, [5, 17, 99, 3, 250])

    assert logits.shape == (1, config.vocab_size)
    assert group.calls == ["allreduce"] * (1 + 2 * num_layers) + ["gather"]
    expected = (datetime.timedelta(seconds=7.0),) if timed else ()
    assert group.waits == [expected] * len(group.calls)


def test_collectives_pick_the_wait_by_backend() -> None:
    assert Collectives.for_backend("gloo", None, 0, 2, 1.0).timed
    assert not Collectives.for_backend("nccl", None, 0, 2, 1.0).timed
    with pytest.raises(ValueError, match="unknown TP backend 'mpi'"):
        Collectives.for_backend("mpi", None, 0, 2, 1.0)


def test_nccl_env_problems_name_what_would_block_or_never_time_out() -> None:
    assert nccl_env_problems({}) == []
    assert nccl_env_problems({"TORCH_NCCL_BLOCKING_WAIT": "0"}) == []
    assert nccl_env_problems({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}) == []
    blocking = nccl_env_problems({"TORCH_NCCL_BLOCKING_WAIT": "1"})
    assert len(blocking) == 1 and blocking[0].startswith("TORCH_NCCL_BLOCKING_WAIT=1: every")
    silent = nccl_env_problems({"NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert len(silent) == 1 and silent[0].startswith("NCCL_ASYNC_ERROR_HANDLING=0: torch's")


# ---- real gloo groups of two threads ---------------------------------------------------------
def two_ranks(timeout_s: float) -> tuple[TPGroup, TPGroup]:
    store = create_store(2, 10.0)
    groups: dict[int, TPGroup] = {}

    def join(rank: int, store: Any) -> None:
        groups[rank] = init_tp_group(store, rank, 2, torch.device("cpu"), timeout_s)

    peer = threading.Thread(target=join, args=(1, connect_store("127.0.0.1", store.port, 2, 10)))
    peer.start()
    join(0, store)
    peer.join()
    return groups[0], groups[1]


def on_both(tp: tuple[TPGroup, TPGroup], fn: Callable[[TPGroup], Any]) -> tuple[Any, Any]:
    """`fn(rank 0's group)` here and `fn(rank 1's)` in a thread; both results."""
    results: dict[int, Any] = {}
    peer = threading.Thread(target=lambda: results.__setitem__(1, fn(tp[1])))
    peer.start()
    results[0] = fn(tp[0])
    peer.join()
    return results[0], results[1]


def test_gloo_groups_wait_on_the_cpu() -> None:
    tp = two_ranks(5.0)
    for group in tp:
        assert group.device_comm is not None and group.device_comm.timed
        assert group.control_comm is not None and group.control_comm.timed


def test_the_lm_head_gathers_the_logits_to_rank_0_only() -> None:
    """Vocabulary 7 over 2 ranks: 4 rows each, the last padded. Rank 0: the full [N, 7] logits;
    rank 1: [0, 7], having sent its [N, 4] and received nothing."""
    tp = two_ranks(5.0)
    weight = torch.linspace(-1, 1, 7 * 6).view(7, 6)  # [V, D]
    hidden = torch.linspace(-2, 2, 3 * 6).view(3, 6)  # [N, D]

    def run(group: TPGroup) -> torch.Tensor:
        head = ParallelLMHead(6, 7, dtype=torch.float32, tp=group)
        start = head.shard.start
        rows = weight[start : start + head.shard.rows]
        with torch.no_grad():
            head.weight.zero_()
            head.weight[: rows.shape[0]] = rows
            return head(hidden)

    logits_0, logits_1 = on_both(tp, run)
    torch.testing.assert_close(logits_0, F.linear(hidden, weight), rtol=0, atol=1e-6)
    assert logits_1.shape == (0, 7)
    shard_bytes = 3 * 4 * 4  # [N, V_r] float32
    comm_0, comm_1 = tp[0].device_comm, tp[1].device_comm
    assert comm_0 is not None and comm_1 is not None
    assert (comm_0.sent_bytes, comm_0.received_bytes) == (0, shard_bytes)
    assert (comm_1.sent_bytes, comm_1.received_bytes) == (shard_bytes, 0)


def test_all_reduce_sums_and_counts_the_other_ranks_bytes() -> None:
    tp = two_ranks(5.0)
    out_0, out_1 = on_both(tp, lambda g: g.all_reduce(torch.full((4,), float(g.rank + 1))))
    assert out_0.tolist() == out_1.tolist() == [3.0] * 4
    for group in tp:
        assert group.device_comm is not None
        assert (group.device_comm.sent_bytes, group.device_comm.received_bytes) == (16, 16)


def test_on_gloo_a_rank_that_never_joins_makes_the_other_raise_within_the_timeout() -> None:
    tp = two_ranks(1.0)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="TP rank 0: a collective failed"):
        tp[0].all_reduce(torch.ones(4))
    assert (
        time.monotonic() - start >= 0.9
    )  # it waited for the timeout (a timeout never fires early)


def test_a_rank_waits_for_the_next_step_longer_than_the_timeout() -> None:
    """Rank 1 waits with `wait_forever`; rank 0 broadcasts after three timeouts."""
    tp = two_ranks(0.5)

    def rank_0() -> None:
        time.sleep(1.5)
        tp[0].broadcast_control(torch.arange(3))

    sender = threading.Thread(target=rank_0)
    sender.start()
    got = tp[1].broadcast_control(torch.zeros(3, dtype=torch.int64), wait_forever=True)
    sender.join()
    assert got.tolist() == [0, 1, 2]
