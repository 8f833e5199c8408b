"""Engine: the hybrid-SWA engine of one worker. `step()` is schedule → run → postprocess."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from swaserve.proto.grammar import GrammarError
from swaserve.proto.kv_events import KVCleared, KVEvent, KVTombstoned
from swaserve.proto.kv_rules import page_floor
from swaserve.proto.messages import Headroom
from swaserve.proto.sampling_params import SamplingParams
from swaserve.proto.stream import FinishReason, RequestTimings, TokenLogprob
from swaserve.proto.text.detokenizer import IncrementalDetokenizer
from swaserve.proto.text.tokenizer import load_tokenizer
from swaserve.worker.config import EngineConfig
from swaserve.worker.engine.builder import build_host_state
from swaserve.worker.engine.decode_batch import DecodeBatch
from swaserve.worker.engine.grammar import GrammarCompiler, GrammarMatcher, bitmask_width
from swaserve.worker.engine.mtp import MTPDrafter
from swaserve.worker.engine.request import Request, RequestSampling, RequestStatus
from swaserve.worker.engine.scheduler import ScheduledBatch
from swaserve.worker.engine.stats import StepLog, StepRecord
from swaserve.worker.kv.memory import scratch_base
from swaserve.worker.runner.executor import RankHandles, TPLauncher
from swaserve.worker.runner.host_tensors import to_device
from swaserve.worker.runner.logits import PenaltyState, process_logits, token_logprobs
from swaserve.worker.runner.model_executor import ModelExecutor
from swaserve.worker.runner.model_input import (
    ModelInput,
    build_model_input,
)
from swaserve.worker.runner.model_runner import ModelRunner
from swaserve.worker.runner.parallel import TensorParallelError
from swaserve.worker.runner.sampler import Sampler, argmax_rows, make_generator, reseed
from swaserve.worker.runner.spec_verify import greedy_accept

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005
"""How long an idle `step()` waits for a grammar being compiled (then it returns)."""

GRAMMAR_TIMEOUT_S = 30.0
"""A request whose grammar is not compiled after this long ends with an error (llguidance
bounds its own work by fuel, so this is a backstop: a starved compile thread)."""

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
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked


@dataclass(frozen=True, slots=True)
class GenerateOutput:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked


class _VerifiedPosition:
    """A request as `process_logits` sees it at a verified row: its output so far followed by
    the drafts before that row."""

    __slots__ = ("output_ids", "params", "prompt_ids", "stop_ids")

    def __init__(self, req: Request, drafts: list[int]) -> None:
        self.params, self.prompt_ids, self.stop_ids = req.params, req.prompt_ids, req.stop_ids
        self.output_ids = req.output_ids + drafts if drafts else req.output_ids


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
        calibration = min(CALIBRATION_TOKENS, host.slot_table.max_len)
        if self.model_config.attention_chunk_size and self.model_config.swa_layer_ids:
            calibration = min(calibration, self.model_config.attention_chunk_size)  # one extend
        self._measure_prefill(calibration, translate)
        executor.compile_decode_step_in_background(
            two_pools=not self.plan.single_pool, window=self.window
        )  # after the measurement, which it would slow
        self.sampler = Sampler(executor.device, config.seed)
        self.tokenizer = load_tokenizer(config.model, config.tokenizer)
        self._requests: dict[str, Request] = {}
        self._compiling: dict[Request, tuple[Future, float]] = {}  # waiting for their grammar
        self._grammar_failed: list[RequestOutput] = []  # ended there; the next step returns them
        self._special: set[Request] = set()  # live requests that ask more than the draw
        self._grammar: GrammarCompiler | None = None  # made at the first constrained request
        self._masks: ThreadPoolExecutor | None = None  # fills grammar masks during forwards
        self._arrivals = itertools.count()
        self._events: list[KVEvent] = []
        self._mtp: MTPDrafter | None = None  # speculative_method="mtp": drafts after each step
        if config.speculative_method == "mtp":
            self._mtp = MTPDrafter(
                executor,
                num_layers=self.model_config.num_mtp_layers,
                page_size=self.page_size,
                scratch_base=scratch_base(self.plan),
            )
            self.scheduler.drafter = self._mtp

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
        *,
        resumed_tokens: int = 0,
    ) -> str:
        """Queue a request; returns its id. Raises `RequestError` if it can never be served.
        `submitted_s` (`time.monotonic()`): when the caller took it, if earlier than now (its
        `RequestTimings.loop_wait_s`). `resumed_tokens`: how many of the prompt's last tokens
        the request generated already (`EngineRequest.resumed_tokens`)."""
        req = self._new_request(prompt, sampling_params, request_id, resumed_tokens)
        req.trace.submitted_s = submitted_s
        if req.sampling is not None or req.logprobs is not None or req.params.processed:
            self._special.add(req)
        spec = req.params.structured_outputs
        future = None if spec is None else self.grammar.submit(spec)
        self._requests[req.request_id] = req
        if future is None:
            self.scheduler.add(req)
        else:  # queued once its grammar is compiled (off this thread): `_admit_compiled`
            self._compiling[req] = (future, time.monotonic())
            self._admit_compiled()
        return req.request_id

    @property
    def grammar(self) -> GrammarCompiler:
        """The grammar compiler for this engine's tokenizer (made at first use)."""
        if self._grammar is None:
            if self.tokenizer is None:
                raise RequestError("structured_outputs needs the model's tokenizer.json")
            eos = sorted(self.scheduler.eos_token_ids)
            self._grammar = GrammarCompiler(
                self.tokenizer.tokenizer.to_str(), self.model_config.vocab_size, eos
            )
        return self._grammar

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is compiled; end those whose grammar failed or
        took too long (their outputs wait in `_grammar_failed` for the next step)."""
        failed = self._grammar_failed
        now = time.monotonic()
        for req, (future, submitted) in list(self._compiling.items()):
            late = now - submitted > GRAMMAR_TIMEOUT_S
            if not (future.done() or late):
                continue
            del self._compiling[req]
            try:
                if not future.done():
                    raise GrammarError(
                        f"its grammar was not compiled within {GRAMMAR_TIMEOUT_S:g} s"
                    )
                matcher = GrammarMatcher(future.result())
            except Exception as exc:
                self._requests.pop(req.request_id, None)
                req.end(FinishReason.ERROR, str(exc))
                failed.append(
                    RequestOutput(req.request_id, [], True, FinishReason.ERROR, 0, str(exc))
                )
                continue
            assert req.sampling is not None
            for token in req.sampling.resumed:  # a migrated request's output so far
                matcher.accept(token)
            req.sampling.matcher = matcher
            self.scheduler.add(req)

    def _new_request(
        self,
        prompt: list[int] | str,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        resumed_tokens: int = 0,
    ) -> Request:
        """A validated `Request`, not queued yet (raises `RequestError`)."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        prompt_ids = self._prompt_ids(prompt)
        if not 0 <= resumed_tokens < len(prompt_ids):
            raise RequestError("resumed_tokens must be less than the prompt's length")
        if resumed_tokens and params.min_tokens:
            left = max(0, params.min_tokens - resumed_tokens)
            params = params.model_copy(update={"min_tokens": left})
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
            sampling=self._request_sampling(prompt_ids, params, resumed_tokens),
            logprobs=None if params.logprobs is None else [],
        )

    def _request_sampling(
        self, prompt_ids: list[int], params: SamplingParams, resumed_tokens: int = 0
    ) -> RequestSampling | None:
        """The state a request's sampling options need (None when they need none); raises
        `RequestError` for options this engine cannot serve."""
        try:
            params.check_vocab(self.model_config.vocab_size, stop_token_ids=False)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if not (params.stop or params.structured_outputs or params.penalized):
            return None
        resumed = prompt_ids[len(prompt_ids) - resumed_tokens :] if resumed_tokens else []
        sampling = RequestSampling(resumed=resumed)
        if params.stop:
            if self.tokenizer is None:
                raise RequestError(
                    "stop strings need the model's tokenizer.json: use stop_token_ids"
                )
            sampling.stop_text = IncrementalDetokenizer(
                self.tokenizer.tokenizer, prompt_ids, params.stop
            )
        if params.structured_outputs is not None:
            try:
                self.grammar.check(params.structured_outputs)
            except GrammarError as exc:
                raise RequestError(str(exc)) from None
        return sampling

    def abort(self, request_id: str) -> bool:
        """Stop a request and release all it holds; False if it is unknown or already done."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if self._compiling.pop(req, None) is not None:
            req.end(FinishReason.ABORT)
        else:
            self.scheduler.abort(req)
        self.stats.aborted_requests += 1
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._compiling or self._grammar_failed)

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
        if self._compiling:
            self._admit_compiled()
        if self._special:  # the batch's sampling skips its per-row options when none is live
            self._special = {r for r in self._special if not r.finished}
        failed, self._grammar_failed = self._grammar_failed, []
        batch = self.scheduler.schedule()
        timer.lap("schedule")
        failed += self._unservable_outputs()
        if batch is None:
            if self._compiling:  # nothing to run but grammars to wait for
                futures = [future for future, _ in self._compiling.values()]
                wait(futures, GRAMMAR_WAIT_S, FIRST_COMPLETED)
            self._on_idle()
            return failed
        model_input = self._model_input(batch)
        sampled = self._sampled_reqs(batch)
        masks = self._start_masks(sampled)
        timer.lap("input")
        try:
            logits = self._forward(model_input)
            spent = timer.lap("model")  # the forward only: what the router's speeds compare
            emitted = None
            if batch.drafts is not None:
                emitted, next_tokens, logprobs = self._verify(batch, sampled, logits, masks)
            else:
                next_tokens, logprobs = self._sample(batch, sampled, logits, masks)
            timer.lap("sample")
        except TensorParallelError as exc:  # the group is gone: fail cleanly, then say so
            self._broken = str(exc)
            self._fail(batch, exc)
            raise
        except Exception as exc:  # a failed step must not take the engine down
            return failed + self._fail(batch, exc)
        prefill = batch.prefill_tokens
        self.stats.count_step(prefill, batch.num_decodes == len(batch.reqs), spent)
        if emitted is None:
            stopped = self._accept(batch, next_tokens)
        else:
            stopped = self._accept_verified(batch, emitted, next_tokens)
            self._count_verified(batch, emitted, next_tokens)
        if self._mtp is not None:
            self._draft(batch, model_input, next_tokens, emitted, stopped)
            timer.lap("draft")
        finished = self.scheduler.process_results(batch, next_tokens, stopped, emitted)
        self.stats.steps += 1
        outputs = self._outputs(batch, next_tokens, finished, logprobs, emitted)
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

    def _draft(
        self,
        batch: ScheduledBatch,
        model_input: ModelInput,
        next_tokens: list[int | None],
        emitted: list[list[int]] | None,
        stopped: list[int],
    ) -> None:
        """MTP: refresh the depths over what the step committed and make the next step's
        drafts (`engine.mtp`) for the requests that go on (not those this step ends: by their
        sampling, a stop id or their length). A failure here costs only the drafts: the step's
        tokens stand and the next step decodes without them (under TP a failure leaves the
        ranks out of step: the batch fails and the engine is broken, as when a forward fails)."""
        assert self._mtp is not None
        caps = [0] * len(batch.reqs)  # refresh only
        limit = self.scheduler.limits.speculative_max_batch
        if limit is None or len(self.scheduler.running) < limit:
            ending = set(stopped)
            counts = self._emitted_counts(batch, next_tokens, emitted)
            for i, req in enumerate(batch.reqs):
                last = next_tokens[i]
                if i not in ending and (last is None or last not in req.stop_ids):
                    caps[i] = self.scheduler.draft_room(req, counts[i])
        try:
            self._mtp.after_step(batch, model_input, next_tokens, emitted, caps)
        except TensorParallelError as exc:  # the group is out of step: as a failed forward
            self._broken = str(exc)
            self._fail(batch, exc)
            raise
        except Exception:
            logger.exception("MTP drafts failed; the next step decodes without them")
            for req in batch.reqs:
                req.mtp_drafts = None

    @staticmethod
    def _emitted_counts(
        batch: ScheduledBatch, next_tokens: list[int | None], emitted: list[list[int]] | None
    ) -> list[int]:
        """Tokens each request of the batch gains from this step."""
        nd = batch.num_decodes
        return [
            len(emitted[i]) if emitted is not None and i < nd else int(t is not None)
            for i, t in enumerate(next_tokens)
        ]

    def _forward(self, model_input: ModelInput) -> torch.Tensor:
        return self.executor.forward(model_input)

    def _model_input(self, batch: ScheduledBatch) -> ModelInput:
        decode, nd = batch.decode, batch.num_decodes
        prefix_lens: Sequence[int] | np.ndarray = batch.prefix_lens
        extend_lens, samples = batch.extend_lens, batch.samples
        repairs = None  # the window repairs of this step's chunks (architecture §6)
        if batch.repairs is not None:
            repairs = [(0, 0) if r is None else (r.start, r.end) for r in batch.repairs]
        if decode is not None and batch.pure_decode:  # the batch's arrays as they are
            tokens, rows = decode.last_tokens.copy(), decode.rows.copy()  # [B] int64 each
            prefix_lens = decode.seq_lens.copy()  # [B] int64
        else:
            tokens = [] if decode is None else decode.last_tokens.tolist()
            rows = [] if decode is None else decode.rows.tolist()
            if decode is not None and batch.drafts is not None:
                tokens, rows, positions = self._verify_rows(decode, batch.drafts)
                prefix_lens = positions + batch.prefix_lens[nd:]
                extend_lens = [1] * len(tokens) + batch.extend_lens[nd:]
                samples = [True] * len(tokens) + batch.samples[nd:]
                if repairs is not None:
                    repairs = [(0, 0)] * len(tokens) + repairs[nd:]
            for req, start, n in zip(
                batch.reqs[nd:], batch.prefix_lens[nd:], batch.extend_lens[nd:], strict=True
            ):
                tokens += req.token_slice(start, start + n)
                rows.append(req.row)
        return build_model_input(
            token_ids=tokens,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            req_rows=rows,
            samples=samples,
            out_full_loc=batch.out_full_loc,
            writes=self.kv.take_writes(),
            translate=self.kv.translate if self.hybrid else None,
            sliding_window_size=self.window,
            window_repair=repairs,
        )

    @staticmethod
    def _verify_rows(
        decode: DecodeBatch, drafts: list[list[int]]
    ) -> tuple[list[int], list[int], list[int]]:
        """A step with drafts: (tokens, slot-table rows, positions) of its decode part, where
        each decode's last token and each of its drafts is a decode row of its own on the
        request's slot-table row, at its own position. Every row writes its KV before any
        attends (as in any decode step), so the row at position p reads the drafts before it;
        and the step stays one new token per row: a decode step, which the compiled or
        captured decode graphs take when no prefill shares it."""
        counts = np.fromiter((1 + len(d) for d in drafts), dtype=np.int64, count=len(drafts))
        firsts = np.cumsum(counts) - counts  # [B] int64
        total = int(counts.sum())
        offsets = np.arange(total) - np.repeat(firsts, counts)  # [T] int64 draft index
        positions = np.repeat(decode.seq_lens, counts) + offsets  # [T] int64
        tokens: list[int] = []
        for last, proposed in zip(decode.last_tokens.tolist(), drafts, strict=True):
            tokens.append(last)
            tokens += proposed
        return tokens, np.repeat(decode.rows, counts).tolist(), positions.tolist()

    @staticmethod
    def _logits_per_request(batch: ScheduledBatch) -> list[int]:
        """A step with drafts: the logits rows of each request of the batch, in order: a
        decode's last token and every draft of it, a prefill chunk's last token if it
        samples."""
        assert batch.drafts is not None
        nd = batch.num_decodes
        return [1 + len(d) for d in batch.drafts] + [int(s) for s in batch.samples[nd:]]

    def _sampled_reqs(self, batch: ScheduledBatch) -> list[Request]:
        """The requests that sample this step, in batch order (one logits row each)."""
        if batch.decode is not None and batch.pure_decode:
            return batch.reqs
        if batch.drafts is not None:  # the requests with one logits row (no drafts)
            return [
                r
                for r, n in zip(batch.reqs, self._logits_per_request(batch), strict=True)
                if n == 1
            ]
        return [r for r, s in zip(batch.reqs, batch.samples, strict=True) if s]

    def _start_masks(self, sampled: list[Request]) -> Future | None:
        """Start filling the grammar masks of the constrained rows on a thread, to overlap the
        forward (llguidance drops the GIL); None when no row is constrained."""
        if not self._special:
            return None
        rows = [
            (i, r.sampling.matcher)
            for i, r in enumerate(sampled)
            if r.sampling is not None and r.sampling.matcher is not None
        ]
        if not rows:
            return None
        if self._masks is None:
            self._masks = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._masks.submit(self._fill_masks, rows)

    def _fill_masks(self, rows: list[tuple[int, GrammarMatcher]]) -> tuple[list[int], torch.Tensor]:
        """(rows, bitmask [m, words] int32 on the host) of the constrained rows."""
        width = bitmask_width(self.model_config.vocab_size)
        pinned = self.executor.device.type == "cuda"
        bitmask = torch.empty((len(rows), width), dtype=torch.int32, pin_memory=pinned)
        for j, (_, matcher) in enumerate(rows):
            matcher.fill(bitmask, j)
        return [i for i, _ in rows], bitmask

    def _sample(
        self,
        batch: ScheduledBatch,
        sampled: list[Request],
        logits: torch.Tensor,
        masks: Future | None,
    ) -> tuple[list[int | None], dict[int, TokenLogprob]]:
        """`logits` has one row per sampling request, in batch order. Returns the token of
        each request of the batch (None: it did not sample) and, by batch index, the
        log-probabilities of those that asked for them."""
        if batch.decode is not None and batch.pure_decode:
            self.stats.generated_tokens += len(batch.reqs)
            tokens, logprobs = self._sample_rows(logits, sampled, batch.decode.all_greedy, masks)
            return tokens, {i: e for i, e in enumerate(logprobs) if e is not None}  # type: ignore[return-value]
        rows = [i for i, s in enumerate(batch.samples) if s]
        out: list[int | None] = [None] * len(batch.reqs)
        by_index: dict[int, TokenLogprob] = {}
        if rows:
            tokens, logprobs = self._sample_rows(
                logits, sampled, all(r.params.greedy for r in sampled), masks
            )
            for j, (i, token) in enumerate(zip(rows, tokens, strict=True)):
                out[i] = token
                entry = logprobs[j] if logprobs else None
                if entry is not None:
                    by_index[i] = entry
            self.stats.generated_tokens += len(rows)
        return out, by_index

    def _verify(
        self,
        batch: ScheduledBatch,
        sampled: list[Request],
        logits: torch.Tensor,
        masks: Future | None,
    ) -> tuple[list[list[int]], list[int | None], dict[int, list[TokenLogprob]]]:
        """A step with drafts. `logits` has a row per draft and per last token of each decode,
        one per sampling prefill, in batch order. Returns the tokens each decode emits (its
        accepted drafts and the target's next token: `spec_verify`), the token of each request
        of the batch (None: it did not sample, or a decode with drafts, whose last kept token
        `_accept_verified` sets once it cut the run), and by batch index the
        log-probabilities of the requests that asked for them, one per token (each emitted
        token's from its own row, processed as plain decoding processes it)."""
        drafts = batch.drafts
        assert drafts is not None
        counts = self._logits_per_request(batch)
        firsts = np.cumsum(counts) - np.asarray(counts)  # [B] int64 first logits row of each
        out: list[int | None] = [None] * len(batch.reqs)
        by_index: dict[int, list[TokenLogprob]] = {}
        single = [i for i, n in enumerate(counts) if n == 1]
        if single:  # one row each: sampled as in any step (grammar, penalties, log-probs)
            index = to_device(torch.from_numpy(firsts[single]), logits.device)
            tokens, logprobs = self._sample_rows(
                logits[index], sampled, all(r.params.greedy for r in sampled), masks
            )
            for j, i in enumerate(single):
                out[i] = tokens[j]
                if logprobs and (entry := logprobs[j]) is not None:
                    by_index[i] = [entry]
        verified = [i for i, d in enumerate(drafts) if d]
        emitted: list[list[int]] = [[] if d else [out[i]] for i, d in enumerate(drafts)]  # type: ignore[list-item]
        logits = self._process_verified(logits, batch, firsts, verified)
        greedy = [i for i in verified if batch.reqs[i].params.greedy]
        if greedy:
            argmax = argmax_rows(logits).tolist()
            for i in greedy:
                lo = int(firsts[i])
                emitted[i] = greedy_accept(drafts[i], argmax[lo : lo + counts[i]])
        if sampled_drafts := [i for i in verified if not batch.reqs[i].params.greedy]:
            # Each row draws what plain decoding draws at its position; the drafts up to the
            # first row that drew otherwise are kept, then that row's token (`spec_verify`).
            rows = np.concatenate(
                [np.arange(firsts[i], firsts[i] + counts[i]) for i in sampled_drafts]
            )
            reqs = [batch.reqs[i] for i in sampled_drafts for _ in range(counts[i])]
            positions = [
                batch.reqs[i].seq_len + j for i in sampled_drafts for j in range(counts[i])
            ]
            index = to_device(torch.from_numpy(rows), logits.device)
            drawn = self.sampler.sample_at(
                logits[index], [r.params for r in reqs], [r.generator for r in reqs], positions
            ).tolist()
            at = 0
            for i in sampled_drafts:
                emitted[i] = greedy_accept(drafts[i], drawn[at : at + counts[i]])
                at += counts[i]
        if asking := [i for i in verified if batch.reqs[i].params.logprobs is not None]:
            rows = np.concatenate(
                [np.arange(firsts[i], firsts[i] + len(emitted[i])) for i in asking]
            )
            index = to_device(torch.from_numpy(rows), logits.device)
            params = [batch.reqs[i].params for i in asking for _ in emitted[i]]
            found = token_logprobs(
                logits[index].float(), params, [t for i in asking for t in emitted[i]]
            )
            at = 0
            for i in asking:
                by_index[i] = found[at : at + len(emitted[i])]
                at += len(emitted[i])
        return emitted, out, by_index

    def _sample_rows(
        self, logits: torch.Tensor, reqs: list[Request], all_greedy: bool, masks: Future | None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row (and, where asked, its log-probabilities). Rows with a grammar,
        `min_tokens`, a bias or penalties are processed first (`runner.logits`); the others
        go to the draw as the forward left them."""
        special = bool(self._special)
        if masks is not None or (special and any(r.params.processed for r in reqs)):
            logits = self._process(logits, reqs, masks)
        if all_greedy:
            tokens = self.sampler.greedy(logits)
            out = (tokens.numpy() if tokens.device.type == "cpu" else tokens).tolist()
        else:
            for r in reqs:
                if r.generator is not None:  # the draw at this position, wherever it runs
                    reseed(r.generator, r.params, len(r.prompt_ids) + len(r.output_ids))
            drawn = self.sampler.sample(
                logits, [r.params for r in reqs], [r.generator for r in reqs]
            )
            out = drawn.tolist()
        asked = [j for j, r in enumerate(reqs) if r.params.logprobs is not None] if special else []
        if not asked:
            return out, []
        lp: list[TokenLogprob | None] = [None] * len(reqs)
        index = to_device(torch.tensor(asked, dtype=torch.int64), logits.device)
        computed = token_logprobs(
            logits[index].float(), [reqs[j].params for j in asked], [out[j] for j in asked]
        )
        for j, entry in zip(asked, computed, strict=True):
            lp[j] = entry
        return out, lp

    def _process(
        self, logits: torch.Tensor, reqs: list[Request], masks: Future | None
    ) -> torch.Tensor:
        """The rows' logits after their grammar masks, `min_tokens`, biases and penalties
        (float32; a copy: the forward's buffer is not written)."""
        logits = logits.float().clone()
        vocab, device = logits.shape[1], logits.device
        penalties = [self._penalty(r, vocab, device) for r in reqs]
        bitmask, masked = None, []
        if masks is not None:
            masked, host_mask = masks.result()
            bitmask = to_device(host_mask, device)
        process_logits(logits, reqs, penalties, bitmask, masked)
        return logits

    def _accept(self, batch: ScheduledBatch, next_tokens: list[int | None]) -> list[int]:
        """Advance the sampling state of the requests that sampled (grammar, stop strings,
        penalty counters, log-probabilities kept for `generate`); returns the batch indices
        of those that it ends (finish reason "stop")."""
        stopped: list[int] = []
        if not self._special:
            return stopped
        for i, (req, token) in enumerate(zip(batch.reqs, next_tokens, strict=True)):
            if token is not None and self._feed(req, [token]) is not None:
                stopped.append(i)
        return stopped

    @staticmethod
    def _feed(req: Request, tokens: list[int]) -> int | None:
        """Feed the tokens `req` keeps, in order, to its sampling state (penalty counters,
        grammar, stop strings); how many it took up to the one that ended it, None if none
        did (or it has no such state)."""
        sampling = req.sampling
        if sampling is None:
            return None
        for j, token in enumerate(tokens):
            if sampling.penalty is not None:
                sampling.penalty.add(token)
            sampling.accept(token, len(req.output_ids) + j + 1, req.params.min_tokens)
            if sampling.stopped or sampling.failed:
                return j + 1
        return None

    @staticmethod
    def _penalty(req: Request, vocab: int, device: torch.device) -> PenaltyState | None:
        """A penalized request's counters (made at its first penalized draw), else None."""
        if not req.params.penalized:
            return None
        assert req.sampling is not None
        if req.sampling.penalty is None:
            req.sampling.penalty = PenaltyState.of(req, req.sampling.resumed, vocab, device)
        return req.sampling.penalty

    def _process_verified(
        self, logits: torch.Tensor, batch: ScheduledBatch, firsts: np.ndarray, verified: list[int]
    ) -> torch.Tensor:
        """The verified rows of requests with `min_tokens`, a bias or penalties, processed as
        plain decoding processes its logits at that position once the drafts before it are
        its tokens (the only case in which a row's draw is used): row j of a request counts
        its first j drafts as output (`PenaltyState.after`, the `min_tokens` length). A copy
        when any row is processed (the forward's buffer is not written)."""
        processed = [i for i in verified if batch.reqs[i].params.processed]
        if not processed:
            return logits
        assert batch.drafts is not None
        logits = logits.float().clone()
        vocab, device = logits.shape[1], logits.device
        rows: list[int] = []
        positions: list[_VerifiedPosition] = []
        states: list[PenaltyState | None] = []
        for i in processed:
            req, proposed = batch.reqs[i], batch.drafts[i]
            base = self._penalty(req, vocab, device)
            for j in range(len(proposed) + 1):
                rows.append(int(firsts[i]) + j)
                positions.append(_VerifiedPosition(req, proposed[:j]))
                states.append(None if base is None else base.after(proposed[:j]))
        index = to_device(torch.tensor(rows, dtype=torch.int64), device)
        sub = logits[index]
        process_logits(sub, positions, states, None, [])
        logits[index] = sub
        return logits

    def _accept_verified(
        self, batch: ScheduledBatch, emitted: list[list[int]], next_tokens: list[int | None]
    ) -> list[int]:
        """`_accept` for a step with drafts: each decode's emitted tokens are cut after the
        first that ends it (a stop id, its length, its stop string) and fed to its sampling
        state one by one; returns the batch indices its sampling ended."""
        stopped: list[int] = []
        nd = batch.num_decodes
        for i, req in enumerate(batch.reqs):
            if i < nd:
                tokens = emitted[i][: req.max_output_len - len(req.output_ids)]
                ends = [j for j, t in enumerate(tokens) if t in req.stop_ids]
                if ends:
                    tokens = tokens[: ends[0] + 1]
                emitted[i] = tokens
            elif (token := next_tokens[i]) is not None:
                tokens = [token]
            else:
                continue
            if (taken := self._feed(req, tokens)) is not None:
                if i < nd:
                    emitted[i] = tokens[:taken]
                stopped.append(i)
        for i in range(nd):  # a decode's token: the last it keeps
            next_tokens[i] = emitted[i][-1]
        return stopped

    def _count_verified(
        self, batch: ScheduledBatch, emitted: list[list[int]], next_tokens: list[int | None]
    ) -> None:
        """A step with drafts, its emitted runs cut: drafts verified and kept, tokens made."""
        assert batch.drafts is not None
        stats, nd = self.stats, batch.num_decodes
        for proposed, tokens in zip(batch.drafts, emitted, strict=True):
            if proposed:
                kept = 0  # drafts the run kept (a cut after a stop may end it on a draft)
                while kept < min(len(tokens), len(proposed)) and tokens[kept] == proposed[kept]:
                    kept += 1
                stats.spec_verifies += 1
                stats.spec_draft_tokens += len(proposed)
                stats.spec_accepted_tokens += kept
        stats.generated_tokens += sum(map(len, emitted))
        stats.generated_tokens += sum(t is not None for t in next_tokens[nd:])

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
        self,
        batch: ScheduledBatch,
        next_tokens: list[int | None],
        finished: list[Request],
        logprobs: dict[int, TokenLogprob] | dict[int, list[TokenLogprob]],
        emitted: list[list[int]] | None = None,
    ) -> list[RequestOutput]:
        """One output per request that sampled; a request that did not (a prefill chunk)
        neither advanced nor finished. `emitted` (a step with drafts): each decode's tokens;
        `logprobs` is then a list per request (one per token it made before the cut)."""
        self._forget(finished)
        nd = batch.num_decodes
        entries: dict[int, list[TokenLogprob]] = {}
        for i, entry in logprobs.items():
            made = len(emitted[i]) if emitted is not None and i < nd else 1
            entries[i] = entry[:made] if isinstance(entry, list) else [entry]
            kept = batch.reqs[i].logprobs
            if kept is not None:
                kept.extend(entries[i])
        decode = batch.decode
        if decode is not None and batch.pure_decode and not finished and not logprobs:
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
        for i, (req, token) in enumerate(zip(batch.reqs, next_tokens, strict=True)):
            if token is None:
                continue
            reason = req.finish_reason  # set in this step if it finished, else None
            first = len(req.output_ids) == 1  # its first token (a re-prefill has more)
            outputs.append(
                RequestOutput(
                    req.request_id,
                    emitted[i] if emitted is not None and i < nd else [token],
                    reason is not None,
                    reason,
                    req.cached_tokens,
                    req.error,
                    timings=req.trace.timings(now) if first else None,
                    logprobs=entries.get(i),
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
        stop_text = req.sampling.stop_text if req.sampling is not None else None
        if stop_text is not None and stop_text.stop_reason is not None:
            text = text[: text.rfind(stop_text.stop_reason)]  # the text ends before it
        reason = req.finish_reason or FinishReason.ABORT
        logprobs = None if req.logprobs is None else list(req.logprobs)
        return GenerateOutput(list(req.output_ids), text, reason, req.cached_tokens, logprobs)

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

    def shutdown(self, *, wait_compiles: bool = True) -> None:
        """Abort everything, free the KV memory and stop the TP ranks (none is left running,
        also after a `TensorParallelError`). A background compile stops after the graph it is
        compiling; `wait_compiles=False` does not wait for that graph (a process that ends
        right after: a worker actor, a Serve replica), which can take tens of seconds cold."""
        try:
            for rid in list(self._requests):
                self.abort(rid)
            for pool in (self._grammar, self._masks):
                if pool is not None:
                    pool.shutdown()
            if self.tree is not None:
                self.tree.reset()
            self._requests.clear()
        finally:
            self.executor.close(wait_compiles=wait_compiles)

    def request_status(self, request_id: str) -> RequestStatus | None:
        req = self._requests.get(request_id)
        return req.status if req else None
