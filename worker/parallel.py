"""Tensor parallelism: process groups, collectives and the sharding rules.

A TP group is `world_size` processes, one per device, each holding a shard of the weights and of
both KV pools (same slot ids everywhere). Rank 0 schedules; every rank runs the forward.

Process groups are built from (rank, world size, rendezvous) with no fixed port or name and no
process-global state: rank 0 opens a `TCPStore` on port 0 (the OS picks it) and hands its
address to the others; each rank then builds two groups over that store:

- `device_group`: NCCL on CUDA, gloo on CPU — the model's all-reduce / all-gather;
- `control_group`: always gloo — rank 0's broadcast of each step's `ModelInput` and control
  messages.

Both wait at most `timeout_s` (default 60 s, not torch's 30 minutes). `TPGroup.single()` is the
trivial group of a TP = 1 engine: every collective is the identity.

Sharding rules (one place; the model layers and the KV sizing both call them):

    # query heads   H / tp per rank (H must divide)
    # KV heads      Hkv / tp per rank when tp <= Hkv (Hkv must divide);
    #               1 per rank, replicated tp / Hkv times, when tp > Hkv (tp must divide)
    # a dimension   size / tp per rank, rank r holds [r · size / tp, (r + 1) · size / tp)
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TP_TIMEOUT_S = 60.0


class TensorParallelError(RuntimeError):
    """A TP rank died, hung past the timeout, or reported a failure."""


class ShardingError(ValueError):
    """A model dimension does not split over the TP size (e.g. 12 heads over tp = 8)."""


# ---- sharding rules ------------------------------------------------------------------------
def shard_range(size: int, rank: int, world_size: int, what: str = "dimension") -> tuple[int, int]:
    """[start, end) of rank's even share of a dimension of `size`."""
    if size % world_size:
        raise ShardingError(f"{what} of size {size} does not split over tp_size={world_size}")
    per = size // world_size
    return rank * per, (rank + 1) * per


def num_heads_per_rank(num_heads: int, world_size: int) -> int:
    if num_heads % world_size:
        raise ShardingError(f"{num_heads} attention heads do not split over tp_size={world_size}")
    return num_heads // world_size


def num_kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    """KV heads each rank holds: an even share, or one replicated head when tp > Hkv."""
    if world_size <= num_kv_heads:
        if num_kv_heads % world_size:
            raise ShardingError(f"{num_kv_heads} KV heads do not split over tp_size={world_size}")
        return num_kv_heads // world_size
    if world_size % num_kv_heads:
        raise ShardingError(
            f"tp_size={world_size} is not a multiple of the {num_kv_heads} KV heads, so they "
            "cannot be replicated evenly"
        )
    return 1


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the KV heads rank holds (replicated ranks share a head)."""
    per = num_kv_heads_per_rank(num_kv_heads, world_size)
    if world_size <= num_kv_heads:
        return rank * per, (rank + 1) * per
    head = rank // (world_size // num_kv_heads)
    return head, head + 1


# ---- groups ----------------------------------------------------------------------------------
@dataclass
class TPGroup:
    """One rank's view of its TP group. `device_group` / `control_group` are None at TP = 1."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float = DEFAULT_TP_TIMEOUT_S
    device_group: Any = None
    control_group: Any = None
    comm_time_s: float = 0.0  # wall time in device-group collectives (the model's all-reduces)
    control_time_s: float = 0.0  # wall time in control broadcasts (ModelInput)

    @staticmethod
    def single(device: torch.device | str = "cpu") -> TPGroup:
        return TPGroup(device=torch.device(device))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def _wait(self, work: Any) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise TensorParallelError(f"TP rank {self.rank}: a collective failed: {exc}") from exc

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group, in place; returns it."""
        if self.world_size == 1:
            return tensor
        start = time.perf_counter()
        self._wait(self.device_group.allreduce([tensor]))
        self.comm_time_s += time.perf_counter() - start
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, in rank order."""
        if self.world_size == 1:
            return tensor
        start = time.perf_counter()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._wait(self.device_group.allgather([parts], [tensor]))
        self.comm_time_s += time.perf_counter() - start
        return torch.cat(parts, dim=dim)

    def broadcast_control(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast a CPU tensor from rank 0 over the gloo control group, in place."""
        if self.world_size == 1:
            return tensor
        start = time.perf_counter()
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._wait(self.control_group.broadcast([tensor], options))
        self.control_time_s += time.perf_counter() - start
        return tensor


RENDEZVOUS_TIMEOUT_S = 120.0  # ranks start (spawn or actor, import torch) before they join


def rendezvous_timeout_s(tp_timeout_s: float) -> float:
    """How long a group may take to form: rank processes may take far longer to start than a
    collective may take (`tp_timeout_s` bounds the collectives)."""
    return max(tp_timeout_s, RENDEZVOUS_TIMEOUT_S)


def create_store(world_size: int, timeout_s: float = DEFAULT_TP_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store on 127.0.0.1, port chosen by the OS (`store.port`)."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def connect_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        host, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def init_tp_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float = DEFAULT_TP_TIMEOUT_S,
    name: str = "tp",
) -> TPGroup:
    """Build this rank's device and control groups over `store` (every rank calls it). The
    groups form within `rendezvous_timeout_s(timeout_s)` (ranks may still be starting); each
    collective then waits at most `timeout_s` (`TPGroup`)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    timeout = datetime.timedelta(seconds=rendezvous_timeout_s(timeout_s))
    control = dist.ProcessGroupGloo(
        dist.PrefixStore(f"{name}/control", store), rank, world_size, timeout
    )
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        device_group: Any = dist.ProcessGroupNCCL(
            dist.PrefixStore(f"{name}/nccl", store), rank, world_size, options
        )
    else:
        device_group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"{name}/gloo", store), rank, world_size, timeout
        )
    return TPGroup(rank, world_size, device, timeout_s, device_group, control)
