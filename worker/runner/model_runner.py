"""ModelRunner: one rank's device-side state — the model's weights, this rank's KV buffers, the
device slot tables and the attention backend — driven by `ModelInput` alone. It never decides
policy and never sees a request, the allocator or the tree.

Per step: copy the input to the device (pinned, non-blocking on CUDA), apply the slot-table
writes (re-addressed ranges, then the new tokens' slots), run the model, return the logits of
the sampling rows. Nothing is read back from the device here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.torch_version import TorchVersion

from swaserve.proto import environment
from swaserve.worker.attention.base import ForwardBatch
from swaserve.worker.attention.registry import select_backend
from swaserve.worker.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from swaserve.worker.kv.memory import build_kv_pool
from swaserve.worker.kv.pool_plan import PoolPlan
from swaserve.worker.kv.slot_table import DeviceSlotTable
from swaserve.worker.models.causal_lm import UnboundBackend
from swaserve.worker.models.config import ModelConfig
from swaserve.worker.models.loader import build_meta_model, build_model, load_weights
from swaserve.worker.models.quantized_weights import resident_bytes
from swaserve.worker.runner.decode_step import DecodeStep, Graph
from swaserve.worker.runner.draft_step import DraftRows, DraftStep
from swaserve.worker.runner.host_tensors import to_device
from swaserve.worker.runner.model_input import ModelInput
from swaserve.worker.runner.parallel import TPGroup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def shard_weight_bytes(
    config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, tp_size: int
) -> int:
    """Bytes rank 0's weights will hold once loaded, exactly: its shard built on the meta
    device, in the form the weights stay in (quantized or not), summed over `nbytes` (what
    `ModelRunner.weight_bytes` measures after the load)."""
    model = build_meta_model(
        model_config,
        UnboundBackend(),
        dtype=dtype,
        tp=TPGroup(rank=0, world_size=tp_size),
        dequantize_weights=config.dequantize_weights,
    )
    return resident_bytes(model)


def default_kv_cache_bytes(
    config: EngineConfig,
    device: torch.device,
    *,
    weight_bytes: int,
    weights_loaded: bool,
) -> int | None:
    """The KV budget when the config gives none: a fixed size on CPU; on CUDA
    `mem_fraction_static` of the memory free once this rank's weights are resident — measured
    after they are loaded (`weights_loaded`), or, where the plan must precede the load (a TP
    group hands it to ranks that load in parallel), the free memory now less their exact
    resident `weight_bytes` (`shard_weight_bytes`; real bytes: an MXFP4 byte holds two values).
    None when the config sets one."""
    if config.kv_cache_bytes is not None or config.max_total_tokens is not None:
        return None
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    if weights_loaded:
        torch.cuda.empty_cache()  # what the load left cached is free for the KV pool
    free_bytes, _ = torch.cuda.mem_get_info(device)
    left = free_bytes if weights_loaded else free_bytes - weight_bytes
    budget = int(left * config.mem_fraction_static)
    if budget <= 0:
        state = "after loading" if weights_loaded else "before loading"
        raise ValueError(
            f"no GPU memory left for the KV cache: {free_bytes} B free {state} weights of "
            f"{weight_bytes} B"
        )
    return budget


CPU_COMPILE_MIN_TORCH = "2.13"
"""The oldest torch whose inductor the CPU decode step is compiled with: torch 2.11's writes
past a buffer in the MoE step of an MXFP4 checkpoint (a masked reduction of 2 rows stored as
16), which corrupts the heap; 2.13 is the version the tests run."""


def cpu_compile_supported(version: str | None = None) -> bool:
    """Whether this torch (or `version`) is one the CPU decode step compiles with."""
    return TorchVersion(version or torch.__version__) >= CPU_COMPILE_MIN_TORCH


def compile_mode(config: EngineConfig, device: torch.device) -> str | None:
    """How the pure-decode step runs: "graphs" (CUDA graphs), "compile" (torch.compile) or
    None (eager). `compile="auto"`: CUDA graphs on CUDA; on CPU torch.compile in the
    background (`compiles_in_background`), else eager (see the README). `compile=True` on CPU
    with a torch older than `CPU_COMPILE_MIN_TORCH` raises ValueError."""
    if config.compile == "auto":
        if device.type == "cuda":
            return "graphs"
        return "compile" if compiles_in_background(config, device) else None
    if not config.compile:
        return None
    if device.type == "cuda":
        return "graphs"
    if not cpu_compile_supported():
        raise ValueError(
            f"compile=True on CPU needs torch >= {CPU_COMPILE_MIN_TORCH} "
            f"(this is {torch.__version__}, whose inductor miscompiles the decode step's MoE); "
            "use compile='auto' (eager with this torch) or compile=False"
        )
    return "compile"


def compiles_in_background(config: EngineConfig, device: torch.device) -> bool:
    """`compile="auto"` on CPU at TP 1 (a background step could not run a TP group's
    collectives beside the engine's), unless `SWASERVE_CPU_AUTO_COMPILE=0` or the torch is
    older than `CPU_COMPILE_MIN_TORCH`: the engine serves eagerly while a thread compiles the
    decode step's buckets."""
    return (
        config.compile == "auto"
        and device.type == "cpu"
        and config.tp_size == 1
        and environment.cpu_auto_compile()
        and cpu_compile_supported()
    )


MAX_VERIFY_ROWS = 512
"""The most rows a decode graph has for steps that verify drafts (a request's token and each
of its drafts is a row): larger verify steps run eagerly rather than every start capturing or
compiling graphs of thousands of rows (their logits alone: rows x vocab floats)."""


def decode_rows(config: EngineConfig, requests: int) -> int:
    """The most rows a decode step runs as a graph: a row per request (the slot table's rows),
    more with speculative decoding, where each of the up to
    `speculative_disable_by_batch_size` - 1 drafting requests has 1 + k rows (at most
    `MAX_VERIFY_ROWS`)."""
    if config.speculative_method is None:
        return requests
    drafting = requests
    if (limit := config.speculative_disable_by_batch_size) is not None:
        drafting = min(drafting, limit - 1)
    return max(requests, min(drafting * (1 + config.num_speculative_tokens), MAX_VERIFY_ROWS))


def draft_step_rows(config: EngineConfig, requests: int) -> int:
    """The most rows an MTP depth forward runs as a graph: a decode step's committed tokens
    (`decode_rows`: a request's token and its accepted drafts) and a chain row per request (at
    most `MAX_VERIFY_ROWS`); a prefill chunk's refresh, larger, runs eagerly."""
    return min(decode_rows(config, requests) + requests, MAX_VERIFY_ROWS)


class ModelRunner:
    """Loads the model on its device, then gives it this rank's KV buffers and slot tables, and
    runs forward passes from `ModelInput`s."""

    decode_step: DecodeStep | None = None  # the compiled pure-decode step (`allocate_kv`)
    draft_step: DraftStep | None = None  # the compiled MTP depth forward (`allocate_kv`)
    _draft_batch: tuple[ModelInput, ForwardBatch] | None = None  # the latest MTP refresh's

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        plan: PoolPlan | None,
        *,
        device: torch.device,
        dtype: torch.dtype,
        slot_table_shape: tuple[int, int] | None = None,
        tp: TPGroup | None = None,
        graph_factory: Callable[[], Graph] | None = None,
    ) -> None:
        """Loads the weights first (`weight_bytes` is what they hold), then allocates the KV
        buffers of `plan`; with `plan` None only the weights, so that the caller can size the
        KV pool from the memory they left and then call `allocate_kv`."""
        self.tp = tp or TPGroup.single(device)
        self.device = device
        self.dtype = dtype
        self.model_config = model_config
        self.attention_backend = config.attention_backend
        self.model = build_model(
            model_config,
            UnboundBackend(),
            dtype=dtype,
            device=device,
            tp=self.tp,
            dequantize_weights=config.dequantize_weights,
        )
        load_weights(self.model, config.model)
        self.model.fuse_projections()
        self.weight_bytes = resident_bytes(self.model)  # parameters + buffers, this rank's
        self.compile_mode = compile_mode(config, device)
        self.compile_background = compiles_in_background(config, device)
        self.config = config
        if self.compile_mode == "compile":  # and the compiled CPU step's prepacked copies
            self.weight_bytes += self.model.prepack_weights()
        self.graph_factory = graph_factory
        if plan is not None:
            if slot_table_shape is None:
                raise ValueError("a ModelRunner given a plan needs its slot_table_shape")
            self.allocate_kv(plan, slot_table_shape)

    def allocate_kv(self, plan: PoolPlan, slot_table_shape: tuple[int, int]) -> None:
        """This rank's KV buffers of `plan`, the device slot tables, and the attention backend
        over them, bound to the model. Once, after the weights are loaded."""
        self.plan = plan
        device, dtype = self.device, self.dtype
        spec = self.model_config.kv_spec(self.tp.world_size)
        rows, max_len = slot_table_shape
        # MTP draft steps write positions that hold no slot yet: a scratch page per table row,
        # in the MTP layers' buffers only
        mtp = self.model_config.num_mtp_layers
        first = self.model_config.num_layers
        self.kv_pool = build_kv_pool(
            spec,
            plan,
            dtype=dtype,
            device=device,
            scratch_rows=rows * plan.page_size if mtp else 0,
            scratch_layer_ids=frozenset(range(first, first + mtp)),
        )
        self.slot_table = DeviceSlotTable(
            rows, max_len, with_swa=not plan.single_pool, device=device, padding_row=True
        )
        backend_cls = select_backend(device, self.attention_backend, dtype=dtype)
        self.backend = backend_cls(
            self.kv_pool,
            self.model_config.sliding_window_size,
            attention_chunk_size=self.model_config.attention_chunk_size,
        )
        self.model.bind_backend(self.backend)
        if self.compile_mode is not None:
            self.decode_step = self.make_decode_step(self.compile_mode, self.graph_factory)
            self.draft_step = self.make_draft_step(self.compile_mode, self.graph_factory)

    def make_decode_step(
        self, mode: str, graph_factory: Callable[[], Graph] | None = None
    ) -> DecodeStep:
        """The fixed-shape decode step over this runner's model, slot table and pools (after
        `allocate_kv`); `graph_factory` stands in for CUDA graphs (tests)."""
        return DecodeStep(
            self.model,
            self.slot_table,
            sliding_window_size=self.model_config.sliding_window_size,
            two_pools=not self.plan.single_pool,
            device=self.device,
            mode=mode,
            graph_factory=graph_factory,
            graph_breaks=self.tp.world_size > 1,
            attention_chunk_size=self.model_config.attention_chunk_size,
            max_batch=decode_rows(self.config, self.slot_table.num_rows),
            background=self.compile_background and mode == "compile",
        )

    def make_draft_step(
        self, mode: str, graph_factory: Callable[[], Graph] | None = None
    ) -> DraftStep | None:
        """The fixed-shape MTP depth forward (`draft_step`), or None: no MTP drafts, or TP > 1
        (the depths' forwards then run eagerly)."""
        if self.config.speculative_method != "mtp" or self.tp.world_size > 1:
            return None
        return DraftStep(
            self.model,
            self.slot_table,
            num_depths=self.model_config.num_mtp_layers,
            sliding_window_size=self.model_config.sliding_window_size,
            two_pools=not self.plan.single_pool,
            device=self.device,
            mode=mode,
            graph_factory=graph_factory,
            attention_chunk_size=self.model_config.attention_chunk_size,
            max_batch=draft_step_rows(self.config, self.slot_table.num_rows),
            background=self.compile_background and mode == "compile",
        )

    @torch.inference_mode()
    def draft_rows(self, rows: DraftRows, depth: int) -> torch.Tensor:  # [N, D] (device)
        """MTP depth `depth` over `rows` through `draft_step` (inside its `hold`): each row's
        normed output, the LM head's input (`draft_logits`)."""
        assert self.draft_step is not None
        last = self.model.last_hidden
        assert last is not None, "a draft forward follows a target forward"
        hidden = last[self._to_device(rows.hidden_rows)]  # [N, D]
        return self.draft_step.run_rows(rows, depth, hidden)

    @torch.inference_mode()
    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:  # [A, D] → [A, vocab] float32
        return self.model.logits(out).float()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.device)  # pinned, non-blocking on CUDA; no copy on CPU

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> torch.Tensor:  # [N, vocab] float32 (device)
        """Logits of `inp.logits_indices` (the rows that sample), after writing the slot tables."""
        dev = self._to_device
        writes = inp.writes
        self.slot_table.write(
            dev(writes.rows),
            dev(writes.positions),
            dev(writes.full),
            None if writes.swa is None else dev(writes.swa),
        )
        if self.decode_step is not None and self.decode_step.accepts(inp):
            logits = self.decode_step.run(inp)
            if logits is not None:
                return logits
        positions = dev(inp.positions)
        out_full = dev(inp.out_full_loc)
        out_swa = None if inp.out_swa_loc is None else dev(inp.out_swa_loc)
        extend = inp.seq_lens - inp.prefix_lens  # [B] int64 (CPU)
        token_rows = torch.repeat_interleave(inp.req_rows, extend, output_size=inp.num_tokens)
        keep = inp.full_table_tokens()  # [K] int64 (CPU): None = every token
        if keep is None:
            self.slot_table.write(dev(token_rows), positions, out_full, out_swa)
        else:  # a window repair: its tokens' full table entries stay the cached prefix's
            self.slot_table.write_full(
                dev(token_rows[keep]), dev(inp.positions[keep]), dev(inp.out_full_loc[keep])
            )
            if out_swa is not None:
                self.slot_table.write_swa(dev(token_rows), positions, out_swa)
        batch = ForwardBatch(
            input_ids=dev(inp.input_ids),
            positions=positions,
            prefix_lens=inp.prefix_lens,
            seq_lens=inp.seq_lens,
            req_rows=inp.req_rows,
            slot_table=self.slot_table,
            out_full_loc=out_full,
            out_swa_loc=out_swa,
            logits_rows=dev(inp.logits_indices),
            swa_floor=inp.swa_floor(),
        )
        return self.model(batch).float()

    @torch.inference_mode()
    def draft_forward(
        self,
        inp: ModelInput,
        hidden_rows: torch.Tensor,
        depth: int,
        *,
        chain_entries: int = 0,
        with_logits: bool = True,
    ) -> torch.Tensor | None:  # [N, vocab] float32 (device), or None
        """MTP depth `depth` (`models.mtp`) over `inp`, whose row r reads the target's normed
        hidden state at row `hidden_rows[r]` of the latest `forward`. Its entries are a refresh
        (positions whose slots the slot tables hold already), then `chain_entries` chain steps
        (one token each, `engine.mtp`): each first points its request's table at `prefix_lens`
        (the position after its last computed one) to its out slot; its RoPE position
        (`inp.positions`) may lie past that. Depths that run the same input share its
        attention metadata (built for the first). Logits of `inp.logits_indices` when
        `with_logits`."""
        last = self.model.last_hidden
        assert last is not None, "a draft forward follows a target forward"
        dev = self._to_device
        hidden = last[dev(hidden_rows)]
        if self._draft_batch is not None and self._draft_batch[0] is inp:
            return self._draft(self._draft_batch[1], hidden, depth, with_logits)
        if n := chain_entries:  # a chain entry is one token: the last n tokens are theirs
            rows, at = dev(inp.req_rows[-n:]), dev(inp.prefix_lens[-n:])
            if inp.out_swa_loc is not None:
                self.slot_table.write_swa(rows, at, dev(inp.out_swa_loc[-n:]))
            else:
                self.slot_table.write_full(rows, at, dev(inp.out_full_loc[-n:]))
        out_swa = None if inp.out_swa_loc is None else dev(inp.out_swa_loc)
        batch = ForwardBatch(
            input_ids=dev(inp.input_ids),
            positions=dev(inp.positions),
            prefix_lens=inp.prefix_lens,
            seq_lens=inp.seq_lens,
            req_rows=inp.req_rows,
            slot_table=self.slot_table,
            out_full_loc=dev(inp.out_full_loc),
            out_swa_loc=out_swa,
            logits_rows=dev(inp.logits_indices),
            swa_floor=inp.swa_floor(),
            local_only=True,
        )
        self._draft_batch = (inp, batch)
        return self._draft(batch, hidden, depth, with_logits)

    def _draft(
        self, batch: ForwardBatch, hidden: torch.Tensor, depth: int, with_logits: bool
    ) -> torch.Tensor | None:
        logits = self.model.draft(batch, hidden, depth, with_logits)
        return None if logits is None else logits.float()
