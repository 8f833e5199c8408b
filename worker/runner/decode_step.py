"""The compiled decode step: a pure-decode batch run as one fixed-shape graph.

At small batches a decode step is dominated by per-operator dispatch (hundreds of small ops,
each a few microseconds of Python and dispatcher work), not by arithmetic. SGLang and vLLM take
that away on GPUs with CUDA graphs captured per batch-size bucket over persistent input buffers;
this module does the same on CUDA and runs the same fixed-shape step through `torch.compile`
(inductor: fused C++ kernels, no Python per op) on CPU.

A step is taken here when every request of the batch adds exactly one token and none repairs a
window (`DecodeStep.accepts`); prefill and mixed steps stay eager. The step is padded:

    batch      B rows → Bp = the smallest bucket >= B (`BATCH_BUCKETS`, up to the slot table's
               rows, more with speculative decoding, where a request's drafts are rows of
               its own: `model_runner.decode_rows`); a padded row is the slot table's padding
               row (no request's), position 0, and writes the padding slot 0
    full keys  the longest read → Lf, rounded up to `KEY_BLOCK` (CPU: a dynamic dimension of
               one compiled graph) or to a power of two >= `MIN_GRAPH_KEYS` (CUDA: one graph
               per (Bp, Lf))
    SWA keys   always W + 1

Every per-step input — token ids, positions, slot-table rows, the new tokens' full and SWA
slots — is packed on the host into one [5, Bp] int64 tensor and copied with one transfer into a
persistent device buffer (`inputs`), which the graph reads in place; the attention reads come
from the device slot table, gathered inside the graph (`static_decode.decode_metadata`). So
one step is one host → device copy of 40 · Bp bytes, one replay (or one compiled call), and the
logits it returns; nothing is read back. TP ranks pad the broadcast `ModelInput` the same way
(`bucket` depends only on it), so every rank runs the same bucket.

Models see `static_shapes()` True while the step runs: the MoE then takes a path with no host
read (`BatchedExperts.forward`). Compiled on CPU, the step's GEMMs run over copies of the
weights in panels for our C++ GEMM kernel (`models/prepacked.py`, made when the runner loads the model) and its
attention over our C++ kernel (`attention/cpu_kernels.py`, built here before any trace).

On CPU a compiled graph is called directly once it exists, as a CUDA graph is replayed: the
first step of each (Bp, Lf) goes through dynamo (which checks its guards, traces and compiles
when no graph matches, and builds the graph's argument list), and `InductorBackend` records the
compiled graph and the arguments it was given. Every argument is persistent (the weights, the
KV buffers, the slot tables, views of `inputs` and of the key columns, and the sizes of the
shape), so the later steps of that shape call the graph with the same list: no guard check
and no Python rebuilding ~100 arguments per step (0.12 ms of a 0.65 ms step at batch 1 of the
decode bench, 0.35 ms of 2.74 ms at batch 8). A step that breaks the graph (TP) always goes
through dynamo.

Compiling in the background (`compile="auto"` on CPU): the engine serves eagerly from its
first step while a thread compiles (or loads from the disk cache) each bucket's graph, by
running a padding-only step of that bucket, smallest bucket first. A step whose bucket is
ready runs compiled; one whose bucket is not, or that comes while the thread holds the step
(`_lock`: one thread at a time uses the persistent buffers `inputs` and `hidden`), runs
eagerly (`run` returns None). What the thread's steps write beside the engine's eager steps is
theirs alone: the padding row of the slot table, the padding slot of each pool, and `hidden`
(whose rows a compiled step hands the drafts as a copy then). `static_shapes` is per thread.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import types
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch._inductor.compile_fx import compile_fx

from swaserve.proto import environment
from swaserve.worker.attention import cpu_kernels
from swaserve.worker.attention.static_decode import DecodeBatch, DecodeMetadata, decode_metadata
from swaserve.worker.kv.slot_table import DeviceSlotTable
from swaserve.worker.models.static_step import static_shapes
from swaserve.worker.runner.host_tensors import to_device
from swaserve.worker.runner.model_input import ModelInput

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
"""Padded batch sizes of the decode graph (SGLang's capture sizes are alike: dense at small
batches, where padding costs most). A slot table with more rows adds its row count."""
KEY_BLOCK = 64
"""CPU: the full layers' key width is rounded up to this (a dynamic dimension of the graph)."""
MIN_GRAPH_KEYS = 256
"""CUDA: the smallest key width of a captured graph; widths double from there."""
INPUT_FIELDS = 5  # input ids, positions, slot-table rows, full slots, SWA slots

_COMPILING: weakref.WeakSet[DecodeStep] = weakref.WeakSet()  # steps whose thread runs
_COMPILING_LOCK = threading.Lock()  # the threads take themselves out as they end


def close_steps(steps: Iterable[DecodeStep | None], *, wait: bool = True) -> None:
    """Stop the background compile of each step, then wait for each (after the graph it is
    compiling). All stop before any is waited for: a draft step's thread waits for its decode
    step's to end. Without `wait` they are only told to stop (the exit hook waits for them
    if the process ends normally)."""
    live = [step for step in steps if step is not None]
    for step in live:
        step.stop()
    if wait:
        for step in live:
            step.close()


@atexit.register
def _stop_compiles_at_exit() -> None:
    """At interpreter exit (an engine never shut down): `close_steps` over every step whose
    thread still runs. A thread left inside inductor while the interpreter finalizes aborts
    the process ("terminate called without an active exception")."""
    with _COMPILING_LOCK:
        steps = list(_COMPILING)
    close_steps(steps)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The buckets up to `max_batch`, and `max_batch` itself."""
    small = tuple(b for b in BATCH_BUCKETS if b < max_batch)
    return (*small, max_batch)


def bucket_of(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"a decode batch of {n} requests exceeds the largest bucket {buckets[-1]}")


def key_width(longest: int, max_len: int, *, graphs: bool) -> int:
    """The padded key width of the full layers for a batch whose longest read is `longest`."""
    if graphs:
        width = MIN_GRAPH_KEYS
        while width < longest:
            width *= 2
    else:
        width = -(-longest // KEY_BLOCK) * KEY_BLOCK
    return min(width, max_len)


class Graph(Protocol):
    """A captured step: `capture(fn)` records `fn` (which reads only persistent buffers) and
    returns its output buffer, holding the result of this step; `replay()` runs it again,
    refilling that buffer."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaGraph:
    """`torch.cuda.CUDAGraph`, captured after one warm-up run on a side stream (lazy
    initialisations and the caching allocator's first blocks happen outside the capture); every
    graph of a runner shares one memory pool."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # the warm-up computes the step for real (its K/V writes are idempotent)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()  # recorded, not run: `out` is the graph's output buffer
        self.graph.replay()  # fills it: the caller reads this step's logits from it
        return out

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory() -> Callable[[], Graph]:
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraph(pool)


@dataclass(slots=True)
class DecodeStepStats:
    steps: int = 0
    captures: int = 0  # graphs captured (CUDA) or compiled shapes first run (CPU)
    compile_s: float = 0.0  # wall time of the first runs of each shape (compile or capture)
    direct: int = 0  # CPU: steps that called their shape's compiled graph directly
    eager: int = 0  # background compile: steps left to the eager path (bucket not ready, or busy)
    buckets: dict[int, int] = field(default_factory=dict)  # Bp → steps run in it


class CompiledGraph:
    """A graph inductor compiled, called as dynamo calls it; each call is appended to `calls`
    (which `DecodeStep` empties around each step it traces)."""

    def __init__(self, fn: Callable[..., Any], calls: list[GraphCall]) -> None:
        self.fn = fn
        self.calls = calls

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        self.calls.append(GraphCall(self.fn, args, out))
        return out


@dataclass(slots=True)
class GraphCall:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    out: Any

    def returned(self, result: torch.Tensor) -> bool:
        """Whether the graph's outputs are `result` alone: the traced function did nothing
        but run the graph (nothing replayed around it that a direct call would skip)."""
        out = self.out
        return isinstance(out, (list, tuple)) and len(out) == 1 and out[0] is result


class InductorBackend:
    """A dynamo backend: inductor with `options` (what `torch.compile(options=...)` passes it),
    each compiled graph wrapped to record its calls into `calls`."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.calls: list[GraphCall] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> CompiledGraph:
        fn = compile_fx(gm, example_inputs, config_patches=self.options)
        if not callable(fn):  # an AOT compile's artifact paths: not what this backend asks for
            raise TypeError(f"inductor returned {type(fn).__name__}, not a callable graph")
        return CompiledGraph(fn, self.calls)


class DecodeStep:
    """The fixed-shape decode step of one model runner (see the module docstring).

    `mode`: "graphs" captures one `Graph` per (Bp, Lf) from `graph_factory` (CUDA graphs by
    default); "compile" runs the step through `torch.compile` (two graphs: batch 1, and the
    larger buckets with the batch dynamic; the key width dynamic in both). `model(batch)` is
    the model's forward."""

    buckets: tuple[int, ...]  # the padded batch sizes of its graphs
    input_fields = INPUT_FIELDS  # rows of `inputs`
    hands_on_hidden = True  # keeps each step's hidden states for MTP drafts (`hidden`)

    def __init__(
        self,
        model: Callable[[DecodeBatch], torch.Tensor],
        slot_table: DeviceSlotTable,
        *,
        sliding_window_size: int | None,
        two_pools: bool,
        device: torch.device,
        mode: str,
        graph_factory: Callable[[], Graph] | None = None,
        graph_breaks: bool = False,
        attention_chunk_size: int | None = None,
        max_batch: int | None = None,
        background: bool = False,
    ) -> None:
        """`graph_breaks`: the model's forward breaks the graph (TP collectives run eagerly
        between compiled pieces, see `compile_options`). `max_batch`: the most rows a step
        has (default: the slot table's request rows; more when a request's drafts are rows of
        its own, speculative decoding). `background`: the graphs are made by
        `compile_in_background`, and a step runs only in a bucket that is ready."""
        if slot_table.padding_row is None:
            raise ValueError("the decode step needs a slot table with a padding row")
        self.graph_breaks = graph_breaks
        if mode not in ("graphs", "compile"):
            raise ValueError(f"mode must be 'graphs' or 'compile', got {mode!r}")
        if mode == "compile":
            self.cache_dir = use_compile_cache(environment.cache_dir() / "inductor")
            if device.type == "cpu":
                cpu_kernels.load()  # built before any trace: the graphs call it
        self.model = model
        self.slot_table = slot_table
        self.window = sliding_window_size
        self.attention_chunk_size = attention_chunk_size
        self.two_pools = two_pools
        self.device = device
        self.mode = mode
        self.buckets = self.make_buckets(max_batch or slot_table.num_rows)
        self.padding_row = slot_table.padding_row
        self.background = background
        self.ready: set[Hashable] = set()  # buckets whose graph has run (compiled or captured)
        self.compiled = threading.Event()  # background: the thread is done (see compile_error)
        self.compile_error: BaseException | None = None  # why the background compile stopped
        self._lock = threading.Lock()  # held by the thread that runs the step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.max_len = slot_table.max_len
        self.inputs = torch.zeros(
            self.input_fields, self.buckets[-1] + 1, dtype=torch.int64, device=device
        )  # [F, Bmax + 1] int64: the persistent input buffer every graph reads (one column
        # more than the largest bucket: every bucket's view has the same strides)
        self._cols = torch.arange(self.max_len, dtype=torch.int64, device=device)  # [L] int64
        self.stats = DecodeStepStats()
        # graphs by (variant, Bp, Lf): the variant is 0 here, a draft depth in `DraftStep`
        self._graphs: dict[tuple[int, int, int], tuple[Graph, torch.Tensor]] = {}
        self._graph_factory = graph_factory
        self._compiled: dict[int, Callable[..., torch.Tensor]] = {}  # by variant
        self._backend: InductorBackend | None = None
        self._direct: dict[tuple[int, int, int], Callable[[], Any]] = {}  # (variant, Bp, Lf)
        # → its graph, bound to the arguments dynamo gave it
        self._seen: set[tuple[int, int, int]] = set()
        # A model with MTP layers: each step's normed hidden states, written inside the graph
        # (the drafts read them: `model.last_hidden` is set to this step's rows)
        self.hidden: torch.Tensor | None = None
        if self.hands_on_hidden and getattr(model, "keep_hidden", False):
            config, dtype = model.config, model.dtype  # type: ignore[attr-defined]
            self.hidden = torch.zeros(
                self.buckets[-1] + 1, config.hidden_size, dtype=dtype, device=device
            )  # [Bmax + 1, D]

    @staticmethod
    def make_buckets(max_batch: int) -> tuple[int, ...]:
        """The padded batch sizes of the graphs for at most `max_batch` rows."""
        return batch_buckets(max_batch)

    def accepts(self, inp: ModelInput) -> bool:
        """Whether `inp` is a pure-decode step this graph runs: one new token per request, no
        window repair, within the buckets."""
        return (
            inp.num_tokens == inp.batch_size
            and inp.batch_size > 0
            and inp.window_repair is None
            and inp.batch_size <= self.buckets[-1]
            and (inp.out_swa_loc is not None) == self.two_pools
        )

    def shape(self, inp: ModelInput) -> tuple[int, int]:
        """(Bp, Lf) of `inp`: a function of the input alone, the same on every TP rank."""
        bp = bucket_of(inp.batch_size, self.buckets)
        longest = int(inp.positions.max()) + 1
        return bp, key_width(longest, self.max_len, graphs=self.mode == "graphs")

    def run(self, inp: ModelInput) -> torch.Tensor | None:  # [N, vocab] float32 (device)
        """The logits of `inp.logits_indices`. The runner applies `inp.writes` (re-addressed
        positions) first; the new tokens' own slot-table entries are written in the graph.
        None (compiling in the background) when the step's bucket is not ready yet or the
        compiling thread holds the step now: the caller runs it eagerly."""
        shape = self.shape(inp)
        if not self.background:
            return self._run(inp, shape)
        if shape[0] not in self.ready or not self._lock.acquire(blocking=False):
            self.stats.eager += 1
            return None
        try:
            return self._run(inp, shape)
        finally:
            self._lock.release()

    def _run(
        self, inp: ModelInput, shape: tuple[int, int], *, publish: bool = True
    ) -> torch.Tensor:
        """`run` in this thread, in `shape` (`shape(inp)`); `publish`: hand the model this
        step's hidden states (the background compile's padding steps do not)."""
        bp, width = shape
        b = inp.batch_size
        fields = [inp.input_ids, inp.positions, inp.req_rows, inp.out_full_loc, inp.out_swa_loc]
        self._load_inputs(fields, b, bp)
        logits = self._call(0, bp, width)
        if self.hidden is not None and publish:
            # the next compiled step (maybe the compiling thread's) rewrites these rows
            hidden = self.hidden[:b].clone() if self.background else self.hidden[:b]
            self.model.last_hidden = hidden  # type: ignore[attr-defined]
        rows = inp.logits_indices
        if (rows.numel() == b and b == bp) or logits.shape[0] == 0:  # [0, V]: a TP rank > 0
            return logits
        return logits[to_device(rows, self.device)]

    def _step(
        self, inputs: torch.Tensor, cols: torch.Tensor, variant: int = 0
    ) -> torch.Tensor:  # [Bp, V] float
        """The step over the persistent inputs [5, Bp] and the key columns [Lf] (`variant`:
        0, the one graph of each shape here)."""
        table = self.slot_table
        rows, positions = inputs[2], inputs[1]
        table.full[rows, positions] = inputs[3].to(table.dtype)  # padding: the padding row's
        if table.swa is not None and self.two_pools:
            table.swa[rows, positions] = inputs[4].to(table.dtype)
        batch = DecodeBatch(inputs[0], inputs[1], self._metadata(inputs, cols))
        if self.hidden is None:
            return self.model(batch).float()
        logits, hidden = self.model.forward_hidden(batch)  # type: ignore[attr-defined]
        self.hidden[: hidden.shape[0]].copy_(hidden)
        return logits.float()

    def _load_inputs(self, fields: list[torch.Tensor | None], rows: int, bp: int) -> None:
        """Pack the step's host rows of `inputs` (field i from `fields[i]`, None: zeros; the
        first field may be shorter) for `rows` rows padded to `bp`, and copy them in one
        transfer; padding rows are position 0 of the padding row, slot 0."""
        host = torch.zeros(self.inputs.shape[0], bp, dtype=torch.int64)  # [F, Bp] int64
        host[2, rows:] = self.padding_row
        for i, values in enumerate(fields):
            if values is not None:
                host[i, : values.numel()] = values
        self.inputs[:, :bp].copy_(to_device(host, self.device), non_blocking=True)
        self.stats.steps += 1
        self.stats.buckets[bp] = self.stats.buckets.get(bp, 0) + 1

    def _call(self, variant: int, bp: int, width: int) -> torch.Tensor:
        """Run (capture or compile first) the graph of (`variant`, Bp, Lf) over `inputs`."""
        key = (variant, bp, width)
        first = key not in self._seen
        start = time.perf_counter()
        with static_shapes():
            out = self._graph(*key) if self.mode == "graphs" else self._compile(*key)
        if first:
            self._seen.add(key)
            self.stats.captures += 1
            self.stats.compile_s += time.perf_counter() - start
            self.ready.add(self.ready_key(variant, bp))
        return out

    def ready_key(self, variant: int, bp: int) -> Hashable:
        """What `ready` holds once the graph of (`variant`, Bp) has run: Bp here."""
        return bp

    def _metadata(self, inputs: torch.Tensor, cols: torch.Tensor) -> DecodeMetadata:
        """The attention reads and writes of the rows of `inputs` (rows 1-4: positions,
        slot-table rows, full and SWA slots), from the device slot tables."""
        table = self.slot_table
        swa_table = None
        if self.window is not None:
            swa_table = table.swa if self.two_pools else table.full
        return decode_metadata(
            full_table=table.full,
            swa_table=swa_table,
            rows=inputs[2],
            positions=inputs[1],
            out_full_loc=inputs[3],
            out_swa_loc=inputs[4] if self.two_pools else None,
            full_cols=cols,
            sliding_window_size=self.window,
            attention_chunk_size=self.attention_chunk_size,
        )

    def _graph(self, variant: int, bp: int, width: int) -> torch.Tensor:
        key = (variant, bp, width)
        entry = self._graphs.get(key)
        if entry is None:
            factory = self._graph_factory or cuda_graph_factory()
            self._graph_factory = factory
            graph = factory()
            inputs, cols = self.inputs[:, :bp], self._cols[:width]
            out = graph.capture(lambda: self._step(inputs, cols, variant))
            self._graphs[key] = entry = (graph, out)
            return out  # `capture` left this step's result in it
        graph, out = entry
        graph.replay()
        return out

    def _compile(self, variant: int, bp: int, width: int) -> torch.Tensor:
        direct = self._direct.get((variant, bp, width))
        if direct is not None:
            self.stats.direct += 1
            return direct()[0]
        if variant not in self._compiled:
            inductor, dynamo = compile_options(guard_modules=self.graph_breaks)
            if self._backend is None:
                self._backend = InductorBackend(inductor)
            self._compiled[variant] = torch.compile(
                own_code(self, variant),
                fullgraph=not self.graph_breaks,
                backend=self._backend,
                options=dynamo,
            )
        assert self._backend is not None
        calls = self._backend.calls
        calls.clear()
        logits = self._traced(variant, bp, width)
        if not self.graph_breaks and len(calls) == 1 and calls[0].returned(logits):
            self._direct[(variant, bp, width)] = functools.partial(calls[0].fn, *calls[0].args)
        calls.clear()  # the recorded call holds this step's logits
        return logits

    def _traced(self, variant: int, bp: int, width: int) -> torch.Tensor:
        """The step through dynamo: its guards pick (or trace and compile) the graph."""
        inputs, cols = self.inputs[:, :bp], self._cols[:width]
        # Batch and key width symbolic where the model lets them be: a few graphs in all
        # (batch 1; the batches whose MoE copies the pairs' weights; the rest), any width.
        if bp > 1:
            torch._dynamo.maybe_mark_dynamic(inputs, 1)
        torch._dynamo.maybe_mark_dynamic(cols, 0)
        try:
            return self._compiled[variant](inputs, cols)
        except torch._dynamo.exc.Unsupported as exc:  # a break in a step meant to trace whole
            if self.graph_breaks:
                raise
            logger.warning("the decode step breaks the graph (%s): compiling it in pieces", exc)
            self.graph_breaks, self._backend = True, None
            self._compiled.clear()
            return self._compile(variant, bp, width)

    def compile_in_background(self, inputs: list[ModelInput]) -> None:
        """Start a thread that runs each of `inputs` (padding-only steps, one per bucket: see
        `warm_up_shapes`) through the step, holding it, so that its bucket becomes ready; then
        sets `compiled`. A failure is logged and kept in `compile_error`: the buckets not ready
        stay eager. `close` stops it between buckets."""

        def runs() -> Iterator[Callable[[], object]]:  # iterated in the thread, as it goes
            for inp in inputs:
                yield functools.partial(self._run, inp, self.shape(inp), publish=False)

        self._start_thread(runs())

    def _start_thread(
        self, runs: Iterable[Callable[[], object]], after: threading.Event | None = None
    ) -> None:
        """The background compile's thread: once `after` is set (if given), each of `runs`
        holding the step, between checks of `close`."""
        threads = torch.get_num_threads()  # the engine thread's: a new thread has the default

        def work() -> None:
            start = time.perf_counter()
            try:
                if after is not None:
                    after.wait()
                torch.set_num_threads(threads)  # inductor's kernels keep the count they see
                with torch.inference_mode():
                    for run in runs:
                        if self._stop.is_set():
                            return
                        with self._lock:
                            run()
                logger.info(
                    "%s compiled in the background: %d graphs in %.1f s",
                    type(self).__name__,
                    len(self.ready),
                    time.perf_counter() - start,
                )
            except Exception as exc:  # the engine keeps serving eagerly
                self.compile_error = exc
                logger.warning("background compile of the %s failed: %r", type(self).__name__, exc)
            finally:
                with _COMPILING_LOCK:
                    _COMPILING.discard(self)
                self.compiled.set()

        if not self.background or self._thread is not None:
            raise RuntimeError("compile_in_background: once, on a step made with background=True")
        self._thread = threading.Thread(target=work, name="swaserve-decode-compile", daemon=True)
        self._thread.start()
        with _COMPILING_LOCK:  # after its start (a thread that ended first is joined at once)
            if not self.compiled.is_set():
                _COMPILING.add(self)

    def stop(self) -> None:
        """Tell the background compile to stop (after the bucket it is compiling)."""
        self._stop.set()

    def close(self) -> None:
        """Stop the background compile (after the bucket it is compiling) and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def warm_up_shapes(self) -> list[int]:
        """The batch sizes whose padding-only steps compile (CPU) or capture (CUDA) every graph
        the step will need, so that no request pays for it: every bucket, at the smallest key
        width (a wider graph is captured on CUDA when a batch first needs it; on CPU the width
        is symbolic). A bucket whose graph exists costs one padded step."""
        return list(self.buckets)


def own_code(
    step: DecodeStep, variant: int = 0
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`step._step` over a code object of its own, `variant` bound as its default. dynamo
    keeps its compiled graphs per code object, and the module guards are off
    (`compile_options`): two engines in one process (two models) must not share graphs, nor
    two variants of a step (a draft step's depths: other weights, one code each), so each
    step's function is a copy."""
    fn = type(step)._step
    code = fn.__code__.replace()
    own = types.FunctionType(code, fn.__globals__, fn.__name__, (variant,))
    return types.MethodType(own, step)


def compile_options(*, guard_modules: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(inductor's options, dynamo's) for the CPU step. Without `guard_modules` the model's
    modules are not guarded (dynamo's `guard_filter_fn`): their weights are fixed once the step
    exists (fused, bound), and checking ~10 guards per parameter on every call costs about as
    much as a layer (0.17 ms of a 2.6 ms step at batch 1). That holds only for a step traced
    whole, from `_step` down: under TP each collective breaks the graph, and the code resumed
    after a break inside a layer is one code object for every layer, told apart by its module
    guards alone. The FX graph and AOT caches (on by default) live under
    `TORCHINDUCTOR_CACHE_DIR` (`inductor/` of the cache dir). `cpp_wrapper`: the graph's kernels are
    called from generated C++, not Python (batch 8 of the decode bench 1.2-1.3× faster, the
    same compile time)."""
    inductor: dict[str, Any] = {"cpp_wrapper": True}
    if guard_modules:
        return inductor, None
    return inductor, {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


def use_compile_cache(cache_dir: Path) -> Path:
    """Point inductor's on-disk caches (FX graphs, AOT graphs, compiled kernels) at
    `cache_dir` unless `TORCHINDUCTOR_CACHE_DIR` says otherwise, so that a second start loads
    the compiled step instead of compiling it again. Returns the directory in use."""
    path = environment.inductor_cache_dir(cache_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path
