"""`ModelExecutor`: the device side of one engine as the engine's host side sees it. It reads
the model's config, resolves device and dtype, loads the weights (rank 0's; under TP the other
ranks load theirs when they start), allocates the KV buffers once the host has planned the
pools, and runs each step's forward on every rank.

    ModelExecutor(config)          model config, device, dtype; weights at TP = 1
      .kv_cache_bytes()            the KV budget when the config gives none (after the weights)
      .start(plan, table_shape)    KV buffers; TP ranks 1.. started (`TPLauncher`) and loaded
      .forward(model_input)        every rank runs the step; rank 0 returns the sampled rows' logits
      .close()                     stops the ranks, drops the weights and the KV buffers

The engine decides what runs (scheduler, KV manager, prefix cache) and never touches a model,
an attention backend or a device API itself (architecture §4).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import torch

from swaserve.worker.config import EngineConfig
from swaserve.worker.kv.pool_plan import PoolPlan
from swaserve.worker.models.config import MIMO_V2_FLASH, ModelConfig, load_model_config
from swaserve.worker.models.mtp import checkpoint_mtp_layers
from swaserve.worker.runner.decode_step import DecodeStep, close_steps
from swaserve.worker.runner.draft_step import DraftRows
from swaserve.worker.runner.executor import (
    DraftArgs,
    RankHandles,
    RankSpec,
    TPLauncher,
    rank_device,
)
from swaserve.worker.runner.model_input import (
    ModelInput,
    padding_decode_input,
    padding_prefill_input,
)
from swaserve.worker.runner.model_runner import (
    ModelRunner,
    default_kv_cache_bytes,
    resolve_device,
    resolve_dtype,
    shard_weight_bytes,
)
from swaserve.worker.runner.parallel import TPGroup
from swaserve.worker.runner.process_ranks import ProcessRanks

logger = logging.getLogger(__name__)


def engine_model_config(config: EngineConfig) -> ModelConfig:
    """The model as the engine runs it: config.json, with the checkpoint's MTP depths when
    the engine drafts with them (the first k: draft i runs depth min(i, L - 1))."""
    model_config = load_model_config(config.model)
    if config.speculative_method != "mtp":
        return model_config
    depths = checkpoint_mtp_layers(config.model)
    if depths == 0:
        raise ValueError(
            "speculative_method='mtp' needs a checkpoint with multi-token-prediction layers "
            f"(model.mtp.layers.*); {config.model} has none (use 'ngram')"
        )
    if model_config.architecture != MIMO_V2_FLASH:
        raise ValueError(
            f"speculative_method='mtp' runs MiMo-V2-Flash's MTP layers; "
            f"{model_config.architecture} has its own format (use 'ngram')"
        )
    layers = min(depths, config.num_speculative_tokens)
    return dataclasses.replace(model_config, num_mtp_layers=layers)


class ModelExecutor:
    """Rank 0's model, KV buffers and TP group (see the module docstring)."""

    def __init__(self, config: EngineConfig, *, tp_ranks: RankHandles | None = None) -> None:
        """`tp_ranks`: how ranks 1..tp-1 run (default: child processes, `ProcessRanks`; the
        cluster passes Ray actors)."""
        self.config = config
        self.model_config: ModelConfig = engine_model_config(config)
        self.model_config.check_tp_size(config.tp_size)  # ShardingError before any rank starts
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self._tp_ranks = tp_ranks
        self.launcher: TPLauncher | None = None
        # The KV budget comes from what the weights really hold: loaded first at TP = 1; a TP
        # group's ranks get the plan when they start, so there it counts their exact bytes.
        self._runner: ModelRunner | None = None
        if config.tp_size == 1:
            self._runner = ModelRunner(
                config, self.model_config, None, device=self.device, dtype=self.dtype
            )

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner (loaded at TP = 1 from the start, under TP by `start`)."""
        if self._runner is None:
            raise RuntimeError("the model executor has not started (or has closed)")
        return self._runner

    @property
    def weight_bytes(self) -> int:
        """Bytes rank 0's weights hold (its shard under TP; quantized checkpoints as stored)."""
        if self._runner is not None:
            return self._runner.weight_bytes
        return shard_weight_bytes(self.config, self.model_config, self.dtype, self.config.tp_size)

    def kv_cache_bytes(self) -> int | None:
        """The KV budget when the config sets none: CUDA's free memory after the weights
        (`mem_fraction_static`), CPU's default."""
        return default_kv_cache_bytes(
            self.config,
            self.device,
            weight_bytes=self.weight_bytes,
            weights_loaded=self._runner is not None,
        )

    def start(self, plan: PoolPlan, slot_table_shape: tuple[int, int]) -> None:
        """Allocate rank 0's KV buffers for `plan` and, under TP, start ranks 1..tp-1 and wait
        until each loaded its shard. On failure every started rank is stopped."""
        config, device, tp = self.config, self.device, TPGroup.single(self.device)
        if config.tp_size > 1:
            device = self.device = rank_device(device, 0)
            ranks = self._tp_ranks or ProcessRanks(config.tp_size)
            self.launcher = TPLauncher(RankSpec(config, plan, slot_table_shape), device, ranks)
            tp = self.launcher.tp
        try:
            if self._runner is None:
                self._runner = ModelRunner(
                    config,
                    self.model_config,
                    plan,
                    device=device,
                    dtype=self.dtype,
                    slot_table_shape=slot_table_shape,
                    tp=tp,
                )
            else:
                self._runner.allocate_kv(plan, slot_table_shape)
            if self.launcher is not None:
                self.launcher.wait_ready()
        except BaseException:
            if self.launcher is not None:
                self.launcher.close()
            raise

    def draft_forward(
        self,
        model_input: ModelInput,
        hidden_rows: torch.Tensor,
        depth: int,
        *,
        chain_entries: int = 0,
        with_logits: bool = True,
    ) -> torch.Tensor | None:
        """An MTP depth over `model_input` (`ModelRunner.draft_forward`) on every rank: rank 0
        broadcasts it as a step; returns rank 0's logits (None without `with_logits`)."""
        runner = self.runner
        if self.launcher is None:
            return runner.draft_forward(
                model_input,
                hidden_rows,
                depth,
                chain_entries=chain_entries,
                with_logits=with_logits,
            )
        args = DraftArgs(hidden_rows, depth, chain_entries, with_logits)
        return self.launcher.run_step(
            model_input,
            lambda inp: runner.draft_forward(
                inp, hidden_rows, depth, chain_entries=chain_entries, with_logits=with_logits
            ),
            args,
        )

    def forward(self, model_input: ModelInput) -> torch.Tensor:
        """Every rank runs the step: rank 0 broadcasts the input, then runs its own shard.
        Returns rank 0's logits, one row per sampled request ([S, V])."""
        if self.launcher is not None:
            return self.launcher.run_step(model_input, self.runner.forward)
        return self.runner.forward(model_input)

    def warm_up_decode_step(self, *, two_pools: bool, window: int | None) -> None:
        """With `compile`, compile (CPU) or capture (CUDA) the decode graphs now, through the
        same path as a step (every TP rank runs them), so that no request waits for it.
        Compiling in the background: nothing (`compile_decode_step_in_background`)."""
        step = self.runner.decode_step
        if step is None or step.background:
            return
        start = time.perf_counter()
        inputs = self._padding_steps(step, two_pools, window)
        for inp in inputs:
            self.forward(inp)
        logger.info(
            "decode step %s: %d shapes ready in %.1f s",
            step.mode,
            len(inputs),
            time.perf_counter() - start,
        )
        drafts = self.runner.draft_step
        if drafts is not None:
            start = time.perf_counter()
            warm_ups = drafts.warm_up_inputs()
            with torch.inference_mode():
                for depth, rows in warm_ups:
                    drafts.run_rows(rows, depth, None)
            logger.info(
                "MTP draft step %s: %d shapes ready in %.1f s",
                drafts.mode,
                len(warm_ups),
                time.perf_counter() - start,
            )

    def compile_decode_step_in_background(self, *, two_pools: bool, window: int | None) -> None:
        """Compiling in the background (`model_runner.compiles_in_background`, TP 1): start
        the thread that makes each bucket's graph; the steps run eagerly until theirs is
        ready (`DecodeStep.compile_in_background`)."""
        step = self.runner.decode_step
        if step is not None and step.background:
            step.compile_in_background(self._padding_steps(step, two_pools, window))
            drafts = self.runner.draft_step
            if drafts is not None and drafts.background:
                drafts.compile_in_background(drafts.warm_up_inputs(), after=step.compiled)

    @contextlib.contextmanager
    def draft_hold(self, forwards: list[tuple[int, int]]) -> Iterator[bool]:
        """Whether MTP depth forwards of (depth, rows) run through the compiled draft step
        now (`DraftStep.hold`), holding it while they do; False at TP > 1 or without it."""
        drafts = self.runner.draft_step if self.launcher is None else None
        if drafts is None:
            yield False
            return
        with drafts.hold(forwards) as held:
            yield held

    def draft_rows(self, rows: DraftRows, depth: int) -> torch.Tensor:
        """`ModelRunner.draft_rows` (inside `draft_hold`)."""
        return self.runner.draft_rows(rows, depth)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """`ModelRunner.draft_logits`."""
        return self.runner.draft_logits(out)

    @staticmethod
    def _padding_steps(step: DecodeStep, two_pools: bool, window: int | None) -> list[ModelInput]:
        return [
            padding_decode_input(
                b, two_pools=two_pools, sliding_window_size=window, row=step.padding_row
            )
            for b in step.warm_up_shapes()
        ]

    def time_prefill(
        self,
        slots: torch.Tensor,  # [T] int64 full slots the host allocated for the measurement
        translate: Callable[[torch.Tensor], torch.Tensor] | None,
        window: int | None,
    ) -> float:
        """Seconds of a prefill of T padding tokens written at `slots` (after one untimed run:
        first calls pay one-time costs)."""
        num_tokens = slots.numel()
        model_input = padding_prefill_input(
            torch.arange(num_tokens) % self.model_config.vocab_size,
            slots,
            translate,
            sliding_window_size=window,
        )
        self.forward(model_input)
        start = time.perf_counter()
        self.forward(model_input)
        return time.perf_counter() - start

    def check_alive(self) -> None:
        """Raise `TensorParallelError` when a TP rank has ended."""
        if self.launcher is not None:
            self.launcher.check_alive()

    def close(self, *, wait_compiles: bool = True) -> None:
        """Stop the background compile and the TP ranks, and drop the weights and the KV
        buffers. `wait_compiles=False`: do not wait for the graph a background compile is
        compiling (its thread ends after it)."""
        try:
            runner = self._runner
            if runner is not None:
                close_steps([runner.decode_step, runner.draft_step], wait=wait_compiles)
            if self.launcher is not None:
                self.launcher.close()
        finally:
            self._runner = None
