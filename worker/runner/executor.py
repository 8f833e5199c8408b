"""Running one engine over a TP group: rank 0 is the engine's own process; ranks 1..tp-1 each
run `run_worker_rank` wherever the `RankHandles` put them: child processes of rank 0
(`process_ranks.ProcessRanks`, the default: `python -m swaserve.worker.runner.process_ranks --rank r
--world-size n`, which imports nothing of the user's program) or Ray actors (the cluster's
worker groups).

Start-up, on rank 0 (`TPLauncher`), every wait also watching the ranks' liveness, so that a rank
that dies fails the engine at once with its own error:

    ranks start            ─ each joins the store: rank/arrived/r     (≤ 120 s: imports, start)
    groups form            ─ init_tp_group on every rank              (≤ tp_timeout_s)
    every rank loads       ─ each, loaded: rank/ready/r               (≤ 600 s)
    steps                  ─ broadcast ModelInput → forward on every rank → rank 0 samples

Per step rank 0 broadcasts the `ModelInput` over the gloo control group as two flat int64
tensors (a header, then the payload; no model, pool, request or tree is ever pickled), every
rank applies it to its own device slot tables and runs the forward on its shard, and rank 0
samples: the logits are gathered to rank 0 only (`ParallelLMHead`); the other ranks' forward
returns no row and they sample nothing. Between steps ranks wait for the next header for as long
as rank 0 lives. `run_worker_rank` needs nothing but its arguments, so a Ray actor runs it
unchanged.

Failure: rank 0 checks its ranks before every broadcast and every collective on gloo waits at
most `tp_timeout_s` (NCCL: the group's own timeout, see `parallel`); a dead or hung rank makes
rank 0 raise `TensorParallelError` with that rank's own report. `shutdown()` tells the ranks to
stop, waits for them, and kills any that do not stop in time; a rank process also ends when
rank 0's process does, however it ends (`process_ranks`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from swaserve.worker.runner.model_input import (
    COMMAND_FIELD,
    HEADER_LEN,
    ModelInput,
    pack_model_input,
    payload_len,
    unpack_model_input,
)
from swaserve.worker.runner.parallel import (
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

STEP, SHUTDOWN, DRAFT = 0, 1, 2
JOIN_TIMEOUT_S = 10.0
LOAD_TIMEOUT_S = 600.0  # a rank loading its shard, after rank 0 loaded its own
POLL_S = 0.05  # how often rank 0 looks at the store and the ranks while they start
ARRIVED, READY = "arrived", "ready"  # rank/<stage>/<r>: the store keys of start-up


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a worker rank needs to build its runner: all plain data (JSON to a rank process,
    pickled by Ray to an actor)."""

    config: EngineConfig
    plan: PoolPlan
    slot_table_shape: tuple[int, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config.model_dump(mode="json"),
            "plan": dataclasses.asdict(self.plan),
            "slot_table_shape": list(self.slot_table_shape),
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> RankSpec:
        from swaserve.worker.config import EngineConfig
        from swaserve.worker.kv.pool_plan import PoolPlan

        rows, cols = data["slot_table_shape"]
        return RankSpec(
            EngineConfig.model_validate(data["config"]), PoolPlan(**data["plan"]), (rows, cols)
        )


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r uses the r-th visible GPU: cuda:r when one process sees the host's GPUs, cuda:0
    in a Ray actor that sees only its own. CPU ranks share the CPU."""
    if device.type == "cuda":
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return device


def stage_key(stage: str, rank: int) -> str:
    return f"rank/{stage}/{rank}"


def broadcast_model_input(tp: TPGroup, inp: ModelInput) -> None:
    """Rank 0: send one step's input to every other rank."""
    header, payload = pack_model_input(inp)
    header[COMMAND_FIELD] = STEP
    tp.broadcast_control(header)
    tp.broadcast_control(payload)


@dataclass(frozen=True, slots=True)
class DraftArgs:
    """What an MTP draft forward adds to its `ModelInput` (`ModelRunner.draft_forward`)."""

    hidden_rows: torch.Tensor  # [T] int64: the target rows whose hidden states it reads
    depth: int
    chain_entries: int  # its last entries that are chain steps
    with_logits: bool


def broadcast_draft(tp: TPGroup, inp: ModelInput, args: DraftArgs) -> None:
    """Rank 0: send an MTP draft forward: the input's header and payload, the payload
    followed by (depth, chain entries, with_logits) and a hidden-state row per token."""
    header, payload = pack_model_input(dataclasses.replace(inp, input_ids=inp.input_ids.cpu()))
    header[COMMAND_FIELD] = DRAFT
    extra = torch.tensor(
        [args.depth, args.chain_entries, int(args.with_logits)], dtype=torch.int64
    )  # [3] int64
    tp.broadcast_control(header)
    tp.broadcast_control(torch.cat([payload, extra, args.hidden_rows.to(torch.int64)]))


def broadcast_shutdown(tp: TPGroup) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)  # [HEADER_LEN] int64
    header[COMMAND_FIELD] = SHUTDOWN
    tp.broadcast_control(header)


def receive_model_input(tp: TPGroup) -> tuple[ModelInput, DraftArgs | None] | None:
    """Ranks 1..: the next forward's input, with its `DraftArgs` when it is an MTP draft
    forward (waiting as long as rank 0 lives: an engine may idle), or None when rank 0 shuts
    the group down."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)  # [HEADER_LEN] int64
    tp.broadcast_control(header, wait_forever=True)
    command = int(header[COMMAND_FIELD])
    if command == SHUTDOWN:
        return None
    n, t = payload_len(header), int(header[0])
    extra = 3 + t if command == DRAFT else 0
    payload = tp.broadcast_control(torch.empty(n + extra, dtype=torch.int64))
    inp = unpack_model_input(header, payload[:n])
    if command != DRAFT:
        return inp, None
    depth, chain_entries, with_logits = (int(x) for x in payload[n : n + 3])
    return inp, DraftArgs(payload[n + 3 :], depth, chain_entries, bool(with_logits))


def run_worker_rank(
    rank: int,
    world_size: int,
    store_host: str,
    store_port: int,
    spec: RankSpec,
    errors: Any = None,  # has .put(message): a startup / step failure message to rank 0, or None
) -> None:
    """The loop of TP rank `rank` >= 1: join the group, load the shard, then run every forward
    rank 0 broadcasts until it says stop. Its logits stay here: the forward gathers them to
    rank 0 and returns no row on this rank, which samples nothing."""
    from swaserve.worker.runner.model_executor import engine_model_config
    from swaserve.worker.runner.model_runner import ModelRunner, resolve_device, resolve_dtype

    config = spec.config
    timeout_s = config.tp_timeout_s
    try:
        base = resolve_device(config.device)
        device = rank_device(base, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dtype = resolve_dtype(config.dtype, base)
        store = connect_store(store_host, store_port, world_size, rendezvous_timeout_s(timeout_s))
        store.set(stage_key(ARRIVED, rank), "1")
        tp = init_tp_group(store, rank, world_size, device, timeout_s)
        model_config = engine_model_config(config)
        runner = ModelRunner(
            config,
            model_config,
            spec.plan,
            device=device,
            dtype=dtype,
            slot_table_shape=spec.slot_table_shape,
            tp=tp,
        )
        store.set(stage_key(READY, rank), "1")
        while (received := receive_model_input(tp)) is not None:
            inp, draft = received
            if draft is None:
                runner.forward(inp)
            else:
                runner.draft_forward(
                    inp,
                    draft.hidden_rows,
                    draft.depth,
                    chain_entries=draft.chain_entries,
                    with_logits=draft.with_logits,
                )
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


# ---- rank 0 ----------------------------------------------------------------------------------
class TPLauncher:
    """Rank 0's side of a TP group: the store, the other ranks and their health. `ranks` says
    how ranks 1..tp-1 run: child processes (`process_ranks.ProcessRanks`, what the engine builder
    gives by default) or Ray actors (the cluster's worker groups)."""

    def __init__(self, spec: RankSpec, device: torch.device, ranks: RankHandles) -> None:
        config = spec.config
        self.world_size = config.tp_size
        self.timeout_s = config.tp_timeout_s
        self.ranks: RankHandles = ranks
        self._store = create_store(self.world_size, rendezvous_timeout_s(self.timeout_s))
        self.closed = False
        self._ready = False  # every rank loaded its shard and waits for steps
        self._in_step = False  # rank 0 is inside a step's collectives
        try:
            self.ranks.start("127.0.0.1", self._store.port, spec)
            self._wait_for(ARRIVED, rendezvous_timeout_s(self.timeout_s), "start")
            # Every rank is at the store: the groups form at once, or a rank died meanwhile.
            self.tp = init_tp_group(
                self._store,
                0,
                self.world_size,
                device,
                self.timeout_s,
                form_timeout_s=self.timeout_s,
            )
        except TensorParallelError as exc:
            self.close()
            raise TensorParallelError(f"the TP group did not form: {exc}") from exc
        except Exception as exc:
            failure = self._failure(f"the TP group did not form: {exc}")
            self.close()
            raise TensorParallelError(failure) from exc
        except BaseException:  # Ctrl-C while the ranks start
            self.close()
            raise

    def _wait_for(self, stage: str, timeout_s: float, what: str) -> None:
        """Until every rank set its `stage` key; raises as soon as a rank ends, or after
        `timeout_s` naming the ranks that did not `what`."""
        keys = [stage_key(stage, rank) for rank in range(1, self.world_size)]
        deadline = time.monotonic() + timeout_s
        while not self._store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                late = [r for r, key in enumerate(keys, start=1) if not self._store.check([key])]
                raise TensorParallelError(
                    self._failure(f"TP ranks {late} did not {what} within {timeout_s:.0f} s")
                )
            time.sleep(POLL_S)

    def wait_ready(self) -> None:
        """After rank 0 loaded its own shard: wait until every rank loaded its shard."""
        try:
            self._wait_for(READY, LOAD_TIMEOUT_S, "load their shard")
        except TensorParallelError as exc:
            raise TensorParallelError(f"the TP ranks did not load their shards: {exc}") from exc
        self._ready = True

    def check_alive(self) -> None:
        dead = self.ranks.dead()
        if dead:
            raise TensorParallelError(self._failure(f"TP rank ended: {', '.join(dead)}"))

    def guard(self, fn: Callable[[], Any]) -> Any:
        """Run a collective; turn any failure into `TensorParallelError` with the ranks' story."""
        self.check_alive()
        try:
            return fn()
        except TensorParallelError as exc:
            raise TensorParallelError(self._failure(str(exc))) from exc

    def run_step(
        self,
        inp: ModelInput,
        forward: Callable[[ModelInput], Any],
        draft: DraftArgs | None = None,
    ) -> Any:
        """Broadcast `inp` (an MTP draft forward's with its `draft` arguments), then run rank
        0's own `forward(inp)`. A step cut short (an error, Ctrl-C) leaves the other ranks
        inside a collective: `close()` then stops them hard."""
        self._in_step = True
        if draft is None:
            self.guard(lambda: broadcast_model_input(self.tp, inp))
        else:
            self.guard(lambda: broadcast_draft(self.tp, inp, draft))
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
        """Stop every rank: a shutdown message if the group still works (every rank waits for a
        step), then join, then kill."""
        if self.closed:
            return
        self.closed = True
        graceful = self._ready and not self._in_step and not self.ranks.dead()
        if graceful:
            try:
                broadcast_shutdown(self.tp)
            except TensorParallelError:  # a rank already gone: the kill below ends the rest
                logger.warning("TP shutdown message failed; stopping the ranks", exc_info=True)
                graceful = False
        self.ranks.stop(JOIN_TIMEOUT_S if graceful else 0.0)
