"""Running one engine over a TP group: rank 0 is the engine's own process; ranks 1..tp-1 each
run `run_worker_rank` wherever the `RankHandles` put them: spawned processes (`ProcessRanks`,
multiprocessing "spawn", the default) or Ray actors (the cluster's worker groups).

Per step rank 0 broadcasts the `ModelInput` over the gloo control group as two flat int64
tensors (a header, then the payload; no model, pool, request or tree is ever pickled), every
rank applies it to its own device slot tables and runs the forward on its shard, and rank 0
samples. `run_worker_rank` needs nothing but its arguments, so a Ray actor runs it unchanged.

Failure: rank 0 checks its children before every broadcast and every collective waits at most
`tp_timeout_s`; a dead or hung rank makes rank 0 raise `TensorParallelError`. `shutdown()` tells
the ranks to stop, joins them, and kills any that do not stop in time; the processes are daemons
and are also ended when rank 0 exits (including after Ctrl-C).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import traceback
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from swaserve.worker.model_input import (
    COMMAND_FIELD,
    HEADER_LEN,
    ModelInput,
    pack_model_input,
    payload_len,
    unpack_model_input,
)
from swaserve.worker.parallel import (
    TensorParallelError,
    TPGroup,
    connect_store,
    create_store,
    init_tp_group,
    rendezvous_timeout_s,
)

if TYPE_CHECKING:
    from swaserve.worker.config import EngineConfig
    from swaserve.worker.kv.pool_plan import PoolPlan

logger = logging.getLogger(__name__)

STEP, SHUTDOWN = 0, 1
JOIN_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a worker rank needs to build its runner: all plain, picklable data."""

    config: EngineConfig
    plan: PoolPlan
    slot_table_shape: tuple[int, int]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r uses the r-th visible GPU: cuda:r when one process sees the host's GPUs, cuda:0
    in a Ray actor that sees only its own. CPU ranks share the CPU."""
    if device.type == "cuda":
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return device


def broadcast_model_input(tp: TPGroup, inp: ModelInput) -> None:
    """Rank 0: send one step's input to every other rank."""
    header, payload = pack_model_input(inp)
    header[COMMAND_FIELD] = STEP
    tp.broadcast_control(header)
    tp.broadcast_control(payload)


def broadcast_shutdown(tp: TPGroup) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)  # [HEADER_LEN] int64
    header[COMMAND_FIELD] = SHUTDOWN
    tp.broadcast_control(header)


def receive_model_input(tp: TPGroup) -> ModelInput | None:
    """Ranks 1..: the next step's input, or None when rank 0 shuts the group down."""
    header = tp.broadcast_control(torch.zeros(HEADER_LEN, dtype=torch.int64))
    if int(header[COMMAND_FIELD]) == SHUTDOWN:
        return None
    payload = tp.broadcast_control(torch.empty(payload_len(header), dtype=torch.int64))
    return unpack_model_input(header, payload)


def run_worker_rank(
    rank: int,
    world_size: int,
    store_host: str,
    store_port: int,
    spec: RankSpec,
    errors: Any = None,  # a queue for a startup / step failure message to rank 0, or None
) -> None:
    """The loop of TP rank `rank` >= 1: join the group, load the shard, then run every forward
    rank 0 broadcasts until it says stop."""
    from swaserve.worker.model_runner import ModelRunner, resolve_device, resolve_dtype
    from swaserve.worker.models.config import load_model_config

    config = spec.config
    timeout_s = config.tp_timeout_s
    try:
        base = resolve_device(config.device)
        device = rank_device(base, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dtype = resolve_dtype(config.dtype, base)
        store = connect_store(store_host, store_port, world_size, rendezvous_timeout_s(timeout_s))
        tp = init_tp_group(store, rank, world_size, device, timeout_s)
        model_config = load_model_config(config.model)
        runner = ModelRunner(
            config,
            model_config,
            spec.plan,
            device=device,
            dtype=dtype,
            slot_table_shape=spec.slot_table_shape,
            tp=tp,
        )
        tp.broadcast_control(torch.zeros(1, dtype=torch.int64))  # ready
        while (inp := receive_model_input(tp)) is not None:
            runner.forward(inp)
    except KeyboardInterrupt:
        return
    except TensorParallelError as exc:  # rank 0 or a peer went away: nothing left to serve
        if errors is not None:
            errors.put(f"TP rank {rank}: {exc}")
        logger.error("TP rank %d stops: %s", rank, exc)
        raise SystemExit(1) from exc
    except Exception as exc:
        if errors is not None:
            errors.put(f"TP rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise


class RankHandles(Protocol):
    """How rank 0 starts, watches and stops ranks 1..tp-1 (processes here; Ray actors in the
    cluster). Each rank runs `run_worker_rank` with the store address it is given."""

    def start(self, store_host: str, store_port: int, spec: RankSpec) -> None: ...

    def dead(self) -> list[str]:
        """One line per rank whose loop has ended (a live group has none)."""
        ...

    def errors(self) -> list[str]:
        """The failure messages ranks sent since the last call."""
        ...

    def stop(self, join_timeout_s: float) -> None:
        """Wait up to `join_timeout_s` for the ranks to end, then end them by force."""
        ...


class ProcessRanks:
    """Ranks 1..tp-1 as spawned daemon processes of rank 0's process."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._ctx = mp.get_context("spawn")
        self._errors = self._ctx.Queue()
        self._procs: list[Any] = []
        self._finalizer: Any = None

    def start(self, store_host: str, store_port: int, spec: RankSpec) -> None:
        self._procs = [
            self._ctx.Process(
                target=run_worker_rank,
                args=(rank, self.world_size, store_host, store_port, spec, self._errors),
                name=f"swaserve-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, self.world_size)
        ]
        for proc in self._procs:
            proc.start()
        # At interpreter exit without stop(): the ranks wait on a broadcast that never comes.
        self._finalizer = weakref.finalize(self, _stop_processes, list(self._procs), 0.0)

    def dead(self) -> list[str]:
        return [f"{p.name} (exit code {p.exitcode})" for p in self._procs if not p.is_alive()]

    def errors(self) -> list[str]:
        messages = []
        while True:
            try:
                messages.append(self._errors.get_nowait())
            except (queue.Empty, OSError, ValueError):
                return messages

    def stop(self, join_timeout_s: float) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        _stop_processes(self._procs, join_timeout_s)


class TPLauncher:
    """Rank 0's side of a TP group: the store, the other ranks (`RankHandles`; spawned
    processes by default) and their health."""

    def __init__(
        self, spec: RankSpec, device: torch.device, ranks: RankHandles | None = None
    ) -> None:
        config = spec.config
        self.world_size = config.tp_size
        self.timeout_s = config.tp_timeout_s
        self.ranks: RankHandles = ranks or ProcessRanks(self.world_size)
        self._store = create_store(self.world_size, rendezvous_timeout_s(self.timeout_s))
        self.closed = False
        self._in_step = False  # rank 0 is inside a step's collectives
        try:
            self.ranks.start("127.0.0.1", self._store.port, spec)
            self.tp = init_tp_group(self._store, 0, self.world_size, device, self.timeout_s)
        except Exception as exc:
            failure = self._failure(f"the TP group did not form: {exc}")
            self.close()
            raise TensorParallelError(failure) from exc

    def wait_ready(self) -> None:
        """After rank 0 loaded its own shard: wait until every rank loaded its shard."""
        self.guard(lambda: self.tp.broadcast_control(torch.zeros(1, dtype=torch.int64)))

    def check_alive(self) -> None:
        dead = self.ranks.dead()
        if dead:
            raise TensorParallelError(self._failure(f"TP rank ended: {', '.join(dead)}"))

    def guard(self, fn: Any) -> Any:
        """Run a collective; turn any failure into `TensorParallelError` with the ranks' story."""
        self.check_alive()
        try:
            return fn()
        except TensorParallelError as exc:
            raise TensorParallelError(self._failure(str(exc))) from exc

    def run_step(self, inp: ModelInput, forward: Any) -> Any:
        """Broadcast `inp`, then run rank 0's own `forward(inp)`. A step cut short (an error,
        Ctrl-C) leaves the other ranks inside a collective: `close()` then stops them hard."""
        self._in_step = True
        self.guard(lambda: broadcast_model_input(self.tp, inp))
        try:
            out = self.guard(lambda: forward(inp))
        except TensorParallelError:
            raise
        except Exception as exc:  # the other ranks wait in a collective rank 0 never reaches
            raise TensorParallelError(
                f"rank 0's forward failed, so the group is out of step: {type(exc).__name__}: {exc}"
            ) from exc
        self._in_step = False
        return out

    def _failure(self, what: str) -> str:
        messages = self.ranks.errors()
        return (
            what if not messages else f"{what}; {' | '.join(m.splitlines()[0] for m in messages)}"
        )

    def close(self) -> None:
        """Stop every rank: a shutdown message if the group still works, then join, then kill."""
        if self.closed:
            return
        self.closed = True
        graceful = not self._in_step and not self.ranks.dead() and hasattr(self, "tp")
        if graceful:
            try:
                broadcast_shutdown(self.tp)
            except TensorParallelError:  # a rank already gone: the kill below ends the rest
                logger.warning("TP shutdown message failed; stopping the ranks", exc_info=True)
                graceful = False
        self.ranks.stop(JOIN_TIMEOUT_S if graceful else 0.0)


def _stop_processes(procs: list[Any], join_timeout_s: float) -> None:
    """Join each rank for up to `join_timeout_s`, then terminate, then kill what is left."""
    for proc in procs:
        proc.join(join_timeout_s)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
