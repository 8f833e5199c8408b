"""Tensor parallelism: process groups, collectives and the sharding rules.

A TP group is `world_size` processes, one per device, each holding a shard of the weights and of
both KV pools (same slot ids everywhere). Rank 0 schedules; every rank runs the forward.

Process groups are built from (rank, world size, rendezvous) with no fixed port or name and no
process-global state: rank 0 opens a `TCPStore` on port 0 (the OS picks it) and hands its
address to the others; each rank then builds two groups over that store, each behind a
`Collectives` that knows how this rank waits for it:

- `device_comm`: NCCL on CUDA, gloo on CPU — the model's all-reduces and the logits' gather;
- `control_comm`: always gloo — rank 0's broadcast of each step's `ModelInput` and control
  messages.

How a rank waits is the backend's (`Collectives.for_backend`):

- gloo runs a collective on CPU threads, so the caller has nothing to overlap: it waits for at
  most `timeout_s` (default 60 s, not torch's 30 minutes) and a dead or hung rank becomes a
  `TensorParallelError`;
- NCCL runs it on the GPU: `work.wait()` only makes the current CUDA stream wait for it and
  returns at once, so the CPU goes on queueing the next layer (and a CUDA graph can capture the
  step). A timed wait would block the CPU until each collective ends, twice per layer. A hang is
  bounded instead by the NCCL group's own timeout (`timeout_s`), which torch's NCCL watchdog
  enforces (by default it then takes the process down); `nccl_env_problems` names the
  environment settings that undo this.

Ranks 1.. wait for rank 0's next step without a timeout (`broadcast_control(...,
wait_forever=True)`): an engine may idle for hours; a rank 0 that dies closes its sockets, which
ends the wait at once. `TPGroup.single()` is the trivial group of a TP = 1 engine: every
collective is the identity.

Sharding rules (one place; the model layers and the KV sizing both call them):

    # query heads   H / tp per rank (H must divide)
    # KV heads      Hkv / tp per rank when tp <= Hkv (Hkv must divide);
    #               1 per rank, replicated tp / Hkv times, when tp > Hkv (tp must divide)
    # a dimension   size / tp per rank, rank r holds [r · size / tp, (r + 1) · size / tp)
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from swaserve.proto import environment

logger = logging.getLogger(__name__)

DEFAULT_TP_TIMEOUT_S = 60.0
IDLE_WAIT_S = 30 * 24 * 3600.0
"""A gloo wait with no timeout of ours: gloo bounds every operation by some timeout, so
"untimed" is this long (a rank waiting for rank 0's next step; the control group's default)."""


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


# ---- collectives -----------------------------------------------------------------------------
CPU_WAITS = {"gloo": True, "nccl": False}
"""Backend → whether the calling thread waits for each collective (with a timeout)."""


@dataclass(slots=True)
class Collectives:
    """The collectives of one process group on one rank, and how this rank waits for them.

    `timed` (gloo): each call returns once the collective is done, or raises
    `TensorParallelError` after `timeout_s`. Not `timed` (NCCL): each call queues the
    collective on the current CUDA stream and returns; `work.wait()` (no timeout) orders the
    stream after it without blocking the CPU thread.

    `time_s` is the wall time spent in the calls (on NCCL: queueing only). `sent_bytes` /
    `received_bytes` count payload, not wire traffic: what this rank's tensor gives the other
    ranks' results and what theirs give this rank's (n ranks, a tensor of `size` bytes):

        all-reduce               (n - 1) · size out and in
        gather to rank 0         rank 0: (n - 1) · size in; the others: size out
        broadcast from rank 0    rank 0: (n - 1) · size out; the others: size in
    """

    group: Any  # a torch ProcessGroup: allreduce / gather / broadcast → Work
    rank: int
    world_size: int
    timeout_s: float
    timed: bool
    time_s: float = 0.0
    sent_bytes: int = 0
    received_bytes: int = 0

    @staticmethod
    def for_backend(
        backend: str, group: Any, rank: int, world_size: int, timeout_s: float
    ) -> Collectives:
        if backend not in CPU_WAITS:
            raise ValueError(f"unknown TP backend {backend!r}; known: {sorted(CPU_WAITS)}")
        return Collectives(group, rank, world_size, timeout_s, timed=CPU_WAITS[backend])

    def _options(self, options: Any, wait_forever: bool = False) -> Any:
        """`options` with the operation's own timeout: gloo's operation then ends when our wait
        does (where the torch version honours it; else the group's timeout ends it), so that
        nothing keeps running after a `TensorParallelError`. NCCL's keep the group's."""
        if wait_forever:
            options.timeout = datetime.timedelta(seconds=IDLE_WAIT_S)
        elif self.timed:
            options.timeout = datetime.timedelta(seconds=self.timeout_s)
        return options

    def _finish(self, work: Any, start: float, timeout_s: float | None) -> None:
        """Wait for `work` as the policy says (`timeout_s` None: no timeout of ours)."""
        try:
            if self.timed and timeout_s is not None:
                work.wait(datetime.timedelta(seconds=timeout_s))
            else:
                work.wait()
        except RuntimeError as exc:  # gloo appends its C++ stack: the first line says it
            what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TensorParallelError(f"TP rank {self.rank}: a collective failed: {what}") from exc
        finally:
            self.time_s += time.perf_counter() - start

    def _count(self, sent_bytes: int, received_bytes: int) -> None:
        self.sent_bytes += sent_bytes
        self.received_bytes += received_bytes

    @torch.compiler.disable  # a compiled step calls it eagerly, between graphs
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group, in place; returns it."""
        start = time.perf_counter()
        others = (self.world_size - 1) * tensor.nbytes
        self._count(others, others)
        work = self.group.allreduce([tensor], self._options(dist.AllreduceOptions()))
        self._finish(work, start, self.timeout_s)
        return tensor

    @torch.compiler.disable  # a compiled step calls it eagerly, between graphs
    def gather_to_first(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `tensor`, concatenated along `dim` in rank order, on rank 0 only; None
        on the other ranks, which only send theirs."""
        start = time.perf_counter()
        tensor = tensor.contiguous()
        options = self._options(dist.GatherOptions())
        options.rootRank = 0
        first = self.rank == 0
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if first else []
        others = (self.world_size - 1) * tensor.nbytes
        self._count(0 if first else tensor.nbytes, others if first else 0)
        work = self.group.gather([parts] if first else [], [tensor], options)
        self._finish(work, start, self.timeout_s)
        return torch.cat(parts, dim=dim) if first else None

    def broadcast(self, tensor: torch.Tensor, *, wait_forever: bool = False) -> torch.Tensor:
        """Rank 0's `tensor` on every rank, in place. `wait_forever`: no timeout of ours (a
        rank waiting for rank 0's next step; it ends when rank 0's connection does)."""
        start = time.perf_counter()
        options = self._options(dist.BroadcastOptions(), wait_forever)
        options.rootRank = 0
        root = self.rank == 0
        others = (self.world_size - 1) * tensor.nbytes
        self._count(others if root else 0, 0 if root else tensor.nbytes)
        work = self.group.broadcast([tensor], options)
        self._finish(work, start, None if wait_forever else self.timeout_s)
        return tensor


def nccl_env_problems(env: Mapping[str, str]) -> list[str]:
    """What in `env` would make NCCL collectives stall the CPU or never time out."""
    problems = []
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        if env.get(name, "0").strip() not in ("", "0"):
            problems.append(
                f"{name}={env[name]}: every NCCL collective blocks the CPU thread until it ends "
                "(twice per layer: no CPU/GPU overlap, no CUDA graphs); unset it"
            )
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        if env.get(name, "").strip() == "0":
            problems.append(
                f"{name}=0: torch's NCCL watchdog does not end a collective past the group's "
                "timeout, and nothing else does; unset it"
            )
    return problems


# ---- groups ----------------------------------------------------------------------------------
@dataclass
class TPGroup:
    """One rank's view of its TP group. `device_comm` / `control_comm` are None at TP = 1."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float = DEFAULT_TP_TIMEOUT_S
    device_comm: Collectives | None = None  # the model's collectives (NCCL or gloo)
    control_comm: Collectives | None = None  # rank 0's broadcasts (gloo)

    @staticmethod
    def single(device: torch.device | str = "cpu") -> TPGroup:
        return TPGroup(device=torch.device(device))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def comm_time_s(self) -> float:
        """Wall time in the model's collectives (on NCCL: queueing them)."""
        return 0.0 if self.device_comm is None else self.device_comm.time_s

    @property
    def control_time_s(self) -> float:
        """Wall time in control broadcasts (`ModelInput`), waits for the next step included."""
        return 0.0 if self.control_comm is None else self.control_comm.time_s

    def _device(self) -> Collectives:
        if self.device_comm is None:
            raise TensorParallelError(f"TP rank {self.rank} of {self.world_size} has no group")
        return self.device_comm

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group, in place; returns it."""
        return tensor if self.world_size == 1 else self._device().all_reduce(tensor)

    def gather_to_first(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's `tensor` along `dim` on rank 0 (None on the others)."""
        return tensor if self.world_size == 1 else self._device().gather_to_first(tensor, dim)

    def broadcast_control(
        self, tensor: torch.Tensor, *, wait_forever: bool = False
    ) -> torch.Tensor:
        """Broadcast a CPU tensor from rank 0 over the gloo control group, in place: within
        `timeout_s`, or, with `wait_forever`, for as long as rank 0 lives."""
        if self.world_size == 1:
            return tensor
        if self.control_comm is None:
            raise TensorParallelError(f"TP rank {self.rank} of {self.world_size} has no group")
        return self.control_comm.broadcast(tensor, wait_forever=wait_forever)


RENDEZVOUS_TIMEOUT_S = 120.0  # ranks start (a process or an actor, import torch) before they join


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
    form_timeout_s: float | None = None,
) -> TPGroup:
    """Build this rank's device and control groups over `store` (every rank calls it). The
    groups form within `form_timeout_s` (default `rendezvous_timeout_s(timeout_s)`: ranks may
    still be starting); each collective then waits as `Collectives.for_backend` says, bounded by
    `timeout_s`: the NCCL group gets it as its own timeout (its watchdog's)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    form_s = rendezvous_timeout_s(timeout_s) if form_timeout_s is None else form_timeout_s
    form = datetime.timedelta(seconds=form_s)
    # Ranks 1.. wait for rank 0's next step for as long as rank 0 lives. gloo bounds that wait
    # by the operation's timeout where the torch version honours one (BroadcastOptions.timeout)
    # and by the group's otherwise, so their control group's is IDLE_WAIT_S. Their formation
    # then waits as long too, but no longer than rank 0 lives: its store's connection ends it.
    control_s = form_s if rank == 0 else max(form_s, IDLE_WAIT_S)
    control = dist.ProcessGroupGloo(
        dist.PrefixStore(f"{name}/control", store),
        rank,
        world_size,
        datetime.timedelta(seconds=control_s),
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        for problem in nccl_env_problems(environment.nccl_variables()):
            logger.warning("TP rank %d: %s", rank, problem)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        device_group: Any = dist.ProcessGroupNCCL(
            dist.PrefixStore(f"{name}/nccl", store), rank, world_size, options
        )
    else:
        device_group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"{name}/gloo", store), rank, world_size, form
        )
    return TPGroup(
        rank,
        world_size,
        device,
        timeout_s,
        device_comm=Collectives.for_backend(backend, device_group, rank, world_size, timeout_s),
        control_comm=Collectives.for_backend("gloo", control, rank, world_size, timeout_s),
    )
