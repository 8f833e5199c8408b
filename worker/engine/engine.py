"""Engine: the hybrid-SWA engine of one worker. `step()` is schedule → run → postprocess."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from swaserve.proto.kv_events import KVCleared, KVEvent, KVTombstoned
from swaserve.proto.kv_rules import page_floor
from swaserve.proto.messages import Headroom
from swaserve.proto.sampling_params import SamplingParams
from swaserve.proto.stream import FinishReason, RequestTimings
from swaserve.proto.text.tokenizer import load_tokenizer
from swaserve.worker.config import EngineConfig
from swaserve.worker.engine.builder import build_host_state
from swaserve.worker.engine.request import Request, RequestStatus
from swaserve.worker.engine.scheduler import ScheduledBatch
from swaserve.worker.engine.stats import StepLog, StepRecord
from swaserve.worker.runner.executor import RankHandles, TPLauncher
from swaserve.worker.runner.model_executor import ModelExecutor
from swaserve.worker.runner.model_input import (
    ModelInput,
    build_model_input,
)
from swaserve.worker.runner.model_runner import ModelRunner
from swaserve.worker.runner.parallel import TensorParallelError
from swaserve.worker.runner.sampler import Sampler, make_generator, reseed

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 256
"""Padding tokens of the prefill an engine times at start (`Engine._measure_prefill`)."""


class RequestError(ValueError):
    """A request the engine can never serve (bad prompt, too long for the pools, bad id)."""


@dataclass(slots=True)
class RequestOutput:
    """What one `step()` produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set with finish_reason "error": why the step failed
    timings: RequestTimings | None = None  # with the request's first token: where its TTFT went


@dataclass(frozen=True, slots=True)
class GenerateOutput:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    cached_tokens: int


class Engine:
    """Continuous batching over the two-pool KV cache and the SWA radix cache.

    Not thread-safe: one caller drives `add_request` / `step` / `abort` (the cluster's worker
    actor does so from one loop).
    """

    def __init__(self, config: EngineConfig, *, tp_ranks: RankHandles | None = None) -> None:
        """`tp_ranks`: how ranks 1..tp-1 run (default: spawned processes; the cluster passes
        Ray actors)."""
        self.config = config
        # The device side loads the weights first (at TP = 1): the KV budget is what is left.
        self.executor = executor = ModelExecutor(config, tp_ranks=tp_ranks)
        self.model_config = executor.model_config
        self.host = host = build_host_state(
            config, self.model_config, executor.kv_cache_bytes(), executor.dtype
        )
        self.plan, self.allocator, self.tree, self.kv = (
            host.plan,
            host.allocator,
            host.tree,
            host.kv,
        )
        self.window, self.hybrid = host.window, host.hybrid
        self.window_repair_tokens = host.window_repair_tokens  # R; 0: no repair (architecture §6)
        self.scheduler, self.stats = host.scheduler, host.stats
        self.step_log = StepLog()
        self.request_limits, self.max_model_len = host.request_limits, host.max_model_len
        self.page_size = config.page_size
        executor.start(self.plan, host.slot_table_shape)
        self._broken: str | None = None  # why the TP group can no longer run
        translate = self.kv.translate if self.hybrid else None
        executor.warm_up_decode_step(two_pools=not self.plan.single_pool, window=self.window)
        self._measure_prefill(min(CALIBRATION_TOKENS, host.slot_table.max_len), translate)
        self.sampler = Sampler(executor.device, config.seed)
        self.tokenizer = load_tokenizer(config.model, config.tokenizer)
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._events: list[KVEvent] = []

    def _measure_prefill(self, num_tokens: int, translate: Callable | None) -> None:
        """Time a prefill of `num_tokens` padding tokens on slots of the pools and count it in
        the prefill counters, so that the first report already carries this worker's prefill
        speed (`Headroom.prefill_s_total`) and a router need not wait for its first requests
        to tell a slow worker."""
        num_tokens = page_floor(num_tokens, self.page_size)
        slots = self.allocator.alloc(num_tokens) if num_tokens else None  # [T] int64
        if slots is None:
            return  # pools smaller than the measurement: the first requests measure it
        try:
            self.stats.prefill_s += self.executor.time_prefill(slots, translate, self.window)
            self.stats.prefill_tokens += num_tokens
        finally:
            self.allocator.free(slots)

    @property
    def runner(self) -> ModelRunner:
        return self.executor.runner

    @property
    def launcher(self) -> TPLauncher | None:
        return self.executor.launcher

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights hold in memory on rank 0 (parameters and buffers; its
        shard under TP, each rank about as much): quantized checkpoints count as stored."""
        return self.executor.weight_bytes

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: list[int] | str,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        submitted_s: float | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises `RequestError` if it can never be served.
        `submitted_s` (`time.monotonic()`): when the caller took it, if earlier than now (its
        `RequestTimings.loop_wait_s`)."""
        req = self._new_request(prompt, sampling_params, request_id)
        req.trace.submitted_s = submitted_s
        self._requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def _new_request(
        self,
        prompt: list[int] | str,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        """A validated `Request`, not queued yet (raises `RequestError`)."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        prompt_ids = self._prompt_ids(prompt)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self._check_fits(prompt_ids, params)
        return Request(
            request_id,
            prompt_ids,
            params,
            arrival=next(self._arrivals),
            generator=make_generator(params, self.executor.device),
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request and release all it holds; False if it is unknown or already done."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(req)
        self.stats.aborted_requests += 1
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def _prompt_ids(self, prompt: list[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer.json: pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be ints in [0, {vocab})")
        return ids

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """`RequestError` for a request no state of the pools could serve; past max_model_len
        it is cut (finish reason "length"), not refused."""
        refused = self.request_limits.check(
            len(prompt_ids), params.max_new_tokens, cut_at_model_len=True
        )
        if refused is not None:
            raise RequestError(refused.message)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step: schedule → run → postprocess. Returns the requests that advanced.

        If the forward or the sampling raises, the requests of that batch end with finish
        reason `error` (and the message), everything they hold is released, and the engine goes
        on serving the others."""
        if self._broken is not None:
            raise TensorParallelError(f"the engine's TP group is down: {self._broken}")
        timer = self.stats.timer()
        batch = self.scheduler.schedule()
        timer.lap("schedule")
        failed = self._unservable_outputs()
        if batch is None:
            self._on_idle()
            return failed
        model_input = self._model_input(batch)
        timer.lap("input")
        try:
            logits = self._forward(model_input)
            spent = timer.lap("model")
            next_tokens = self._sample(batch, logits)
            spent += timer.lap("sample")
        except TensorParallelError as exc:  # the group is gone: fail cleanly, then say so
            self._broken = str(exc)
            self._fail(batch, exc)
            raise
        except Exception as exc:  # a failed step must not take the engine down
            return failed + self._fail(batch, exc)
        prefill = batch.prefill_tokens
        self.stats.count_step(prefill, batch.pure_decode, spent)
        finished = self.scheduler.process_results(batch, next_tokens)
        self.stats.steps += 1
        outputs = self._outputs(batch, next_tokens, finished)
        timer.lap("postprocess")
        nd = batch.num_decodes
        self.step_log.add(
            StepRecord(
                nd,
                len(batch.reqs) - nd,
                prefill,
                sum(batch.prefix_lens[nd:]),
                timer.since_start(),
                timer.started_s,
            )
        )
        return failed + outputs if failed else outputs

    def _forward(self, model_input: ModelInput) -> torch.Tensor:
        return self.executor.forward(model_input)

    def _model_input(self, batch: ScheduledBatch) -> ModelInput:
        decode, nd = batch.decode, batch.num_decodes
        prefix_lens: Sequence[int] | np.ndarray = batch.prefix_lens
        if decode is not None and batch.pure_decode:  # the batch's arrays as they are
            tokens, rows = decode.last_tokens.copy(), decode.rows.copy()  # [B] int64 each
            prefix_lens = decode.seq_lens.copy()  # [B] int64
        else:
            tokens = [] if decode is None else decode.last_tokens.tolist()
            rows = [] if decode is None else decode.rows.tolist()
            for req, start, n in zip(
                batch.reqs[nd:], batch.prefix_lens[nd:], batch.extend_lens[nd:], strict=True
            ):
                tokens += req.token_slice(start, start + n)
                rows.append(req.row)
        repairs = None  # the window repairs of this step's chunks (architecture §6)
        if batch.repairs is not None:
            repairs = [(0, 0) if r is None else (r.start, r.end) for r in batch.repairs]
        return build_model_input(
            token_ids=tokens,
            prefix_lens=prefix_lens,
            extend_lens=batch.extend_lens,
            req_rows=rows,
            samples=batch.samples,
            out_full_loc=batch.out_full_loc,
            writes=self.kv.take_writes(),
            translate=self.kv.translate if self.hybrid else None,
            sliding_window_size=self.window,
            window_repair=repairs,
        )

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[int | None]:
        """`logits` has one row per sampling request, in batch order."""
        if batch.decode is not None and batch.pure_decode:
            self.stats.generated_tokens += len(batch.reqs)
            out: list[int | None] = self._sample_rows(  # type: ignore[assignment]
                logits, batch.reqs, all_greedy=batch.decode.all_greedy
            )
            return out
        rows = [i for i, s in enumerate(batch.samples) if s]
        out = [None] * len(batch.reqs)
        if rows:
            reqs = [batch.reqs[i] for i in rows]
            tokens = self._sample_rows(logits, reqs, all(r.params.greedy for r in reqs))
            for i, token in zip(rows, tokens, strict=True):
                out[i] = token
            self.stats.generated_tokens += len(rows)
        return out

    def _sample_rows(
        self, logits: torch.Tensor, reqs: list[Request], all_greedy: bool
    ) -> list[int]:
        if all_greedy:
            tokens = self.sampler.greedy(logits)
            return (tokens.numpy() if tokens.device.type == "cpu" else tokens).tolist()
        for r in reqs:
            if r.generator is not None:  # the draw at this position, wherever it runs
                reseed(r.generator, r.params, len(r.prompt_ids) + len(r.output_ids))
        tokens = self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        return tokens.tolist()

    def _fail(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        message = f"{type(exc).__name__}: {exc}"
        logger.exception("a step of %d requests failed; they end with 'error'", len(batch.reqs))
        self.stats.failed_steps += 1
        in_batch = {id(r) for r in batch.reqs}
        self.kv.requeue_writes({r.row for r in self.scheduler.running if id(r) not in in_batch})
        self.scheduler.fail(batch, message)
        outputs = []
        for req in batch.reqs:
            outputs.append(
                RequestOutput(
                    req.request_id, [], True, FinishReason.ERROR, req.cached_tokens, message
                )
            )
            self._requests.pop(req.request_id, None)
        self._collect_events()
        return outputs

    def _unservable_outputs(self) -> list[RequestOutput]:
        """The requests the scheduler just ended as unservable (finish reason `error`)."""
        outputs = []
        for req in self.scheduler.take_failed():
            self._requests.pop(req.request_id, None)
            outputs.append(
                RequestOutput(
                    req.request_id, [], True, FinishReason.ERROR, req.cached_tokens, req.error
                )
            )
        return outputs

    def _outputs(
        self, batch: ScheduledBatch, next_tokens: list[int | None], finished: list[Request]
    ) -> list[RequestOutput]:
        """One output per request that sampled; a request that did not (a prefill chunk)
        neither advanced nor finished."""
        self._forget(finished)
        decode = batch.decode
        if decode is not None and batch.pure_decode and not finished:
            # Every request of the decode batch advanced and none left it: its lists are the
            # outputs' fields as they are (no request is read).
            return list(
                map(
                    RequestOutput,
                    decode.request_ids,
                    [[t] for t in next_tokens],
                    itertools.repeat(False),
                    itertools.repeat(None),
                    decode.cached_tokens,
                )
            )
        outputs = []
        now = time.monotonic()
        for req, token in zip(batch.reqs, next_tokens, strict=True):
            if token is None:
                continue
            reason = req.finish_reason  # set in this step if it finished, else None
            first = len(req.output_ids) == 1  # its first token (a re-prefill has more)
            outputs.append(
                RequestOutput(
                    req.request_id,
                    [token],
                    reason is not None,
                    reason,
                    req.cached_tokens,
                    timings=req.trace.timings(now) if first else None,
                )
            )
        return outputs

    def _forget(self, finished: list[Request]) -> None:
        for req in finished:
            self._requests.pop(req.request_id, None)
            self.stats.finished_requests += 1
        self._collect_events()

    def _on_idle(self) -> None:
        self._collect_events()
        if self.config.check_on_idle and not self.scheduler.running:
            self.check()

    # ---- offline -------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int] | str] | list[int] | str,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerateOutput]:
        """Run a batch of prompts to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                ids.append(self.add_request(prompt, params))  # type: ignore[arg-type]
        except Exception:
            for rid in ids:
                self.abort(rid)
            raise
        reqs = {rid: self._requests[rid] for rid in ids}
        while any(not r.finished for r in reqs.values()):
            self.step()
        return [self._generate_output(reqs[rid]) for rid in ids]

    def _generate_output(self, req: Request) -> GenerateOutput:
        text = self.tokenizer.decode(req.output_ids) if self.tokenizer else ""
        reason = req.finish_reason or FinishReason.ABORT
        return GenerateOutput(list(req.output_ids), text, reason, req.cached_tokens)

    # ---- reports -------------------------------------------------------------------------
    def headroom(self) -> Headroom:
        return self.host.headroom()

    def take_kv_events(self) -> list[KVEvent]:
        """KV cache events since the last call, for the router."""
        self._collect_events()
        events, self._events = self._events, []
        return events

    def kv_snapshot_events(self) -> list[KVEvent]:
        """The prefix cache as a snapshot for a router that lost track of it
        (`SWARadixCache.snapshot_events`; only `KVCleared` without a cache). Takes and drops
        the events not yet taken: the snapshot holds their effect, and the next
        `take_kv_events` continues from it."""
        self.take_kv_events()
        if self.tree is None:
            return [KVCleared()]
        return self.tree.snapshot_events()

    def _collect_events(self) -> None:
        if self.tree is None:
            return
        for event in self.tree.take_events():
            if isinstance(event, KVTombstoned):
                self.stats.tombstoned_pages += len(event.page_hashes)
            self._events.append(event)

    # ---- integrity / lifecycle -----------------------------------------------------------
    def check(self) -> None:
        """Raise if the allocator or the prefix cache is inconsistent: every full slot is free,
        held by exactly one running request, or held by the tree."""
        owned = [self.scheduler.owned_slots()]
        if self.tree is not None:
            owned.append(self.tree.cached_indices())
            self.tree.check()
        self.allocator.check(owned=torch.cat(owned))
        self.kv.check(self.scheduler.running)
        self.scheduler.check()

    def flush_cache(self) -> None:
        """Drop the prefix cache (no request may be running)."""
        self.scheduler.flush_cache()
        self._collect_events()

    def shutdown(self) -> None:
        """Abort everything, free the KV memory and stop the TP ranks (none is left running,
        also after a `TensorParallelError`)."""
        try:
            for rid in list(self._requests):
                self.abort(rid)
            if self.tree is not None:
                self.tree.reset()
            self._requests.clear()
        finally:
            self.executor.close()

    def request_status(self, request_id: str) -> RequestStatus | None:
        req = self._requests.get(request_id)
        return req.status if req else None
