"""A request's state inside one engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from swaserve.proto.sampling_params import SamplingParams
from swaserve.proto.stream import FinishReason, RequestTimings, TokenLogprob
from swaserve.proto.text.detokenizer import IncrementalDetokenizer
from swaserve.worker.kv.radix_node import PrefixLock
from swaserve.worker.kv.swa_freeing import SWAFreeState

if TYPE_CHECKING:
    from swaserve.worker.engine.grammar import GrammarMatcher
    from swaserve.worker.engine.ngram import NgramIndex


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


_NO_SLOTS = torch.empty(0, dtype=torch.int64)  # [0] int64: the row of a request without KV


@dataclass(slots=True)
class RequestTrace:
    """When a request waited and with what it shared its prefill steps, up to its first token
    (`proto.stream.RequestTimings` is what leaves the engine). Times: `time.monotonic()`."""

    arrival_s: float
    submitted_s: float | None = None  # when its worker took it, if before `arrival_s`
    admitted_s: float = 0.0  # its first admission
    held_by: str = ""  # why admission last left it waiting ("": admitted at its first try)
    prefill_steps: int = 0
    step_decodes: int = 0
    step_prefill_tokens: int = 0

    def timings(self, first_token_s: float) -> RequestTimings:
        return RequestTimings(
            queued_s=self.admitted_s - self.arrival_s,
            prefill_s=first_token_s - self.admitted_s,
            held_by=self.held_by,
            prefill_steps=self.prefill_steps,
            step_decodes=self.step_decodes,
            step_prefill_tokens=self.step_prefill_tokens,
            loop_wait_s=0.0 if self.submitted_s is None else self.arrival_s - self.submitted_s,
        )


@dataclass(eq=False, slots=True)
class RequestSampling:
    """What a request asked of sampling beyond the draw itself, and its state: the matcher of
    its grammar, the detokenizer that watches for its stop strings, its penalty counters (the
    sampler's, on its device: `runner.logits.PenaltyState`), and whether one of them ended it
    (`stopped`: finish reason "stop")."""

    resumed: list[int] = field(default_factory=list)  # output made before a migration
    matcher: GrammarMatcher | None = None
    stop_text: IncrementalDetokenizer | None = None
    penalty: Any = None
    stopped: bool = False
    failed: str | None = None  # its grammar broke (llguidance's limits): finish reason "error"

    def accept(self, token: int, num_output: int, min_tokens: int) -> None:
        """The request kept `token`, its `num_output`-th output token."""
        if self.matcher is not None:
            self.matcher.accept(token)
            if self.matcher.error:
                self.failed = f"structured output: {self.matcher.error}"
            elif self.matcher.done:
                self.stopped = True
        if self.stop_text is not None and num_output > min_tokens:  # none before min_tokens
            self.stop_text.push([token])
            if self.stop_text.stopped:
                self.stopped = True


@dataclass(eq=False, slots=True)
class Request:
    """One generation request.

    Its token sequence is `prompt_ids + output_ids`. Positions `[0, num_computed)` have KV in
    the pools at full slots `slots[:num_computed]`; a step extends that run and samples a new
    token whenever it reaches the end of the sequence. Prefill, a prefill chunk, decode and the
    re-prefill of a retracted request are all this one move.

        # [0, swa.cache_protected_len)  owned by the prefix cache (locked by `lock`)
        # [.., num_computed)            owned by this request

    A window repair (a cached prefix whose window lost its SWA KV; the KV manager's
    `WindowRepair`, carried by the scheduled batch) resumes at its start and recomputes
    `[start, end)` for their SWA KV only: the full KV there is the tree's (the device table
    keeps its slots), the request's own slots at those positions only receive the step's SWA
    KV and go back once the prefix is re-inserted.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    generator: torch.Generator | None = None
    sampling: RequestSampling | None = None  # set when it asked for more than the draw
    logprobs: list[TokenLogprob] | None = None  # its tokens' log-probabilities, when asked
    trace: RequestTrace = field(default_factory=lambda: RequestTrace(time.monotonic()))
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0
    num_slots: int = 0  # positions of row_slots that hold slots (next to num_computed: one line)
    lock: PrefixLock | None = None
    swa: SWAFreeState = field(default_factory=SWAFreeState)
    cached_tokens: int = 0  # prompt tokens not computed: a hit's, less its repair (first admission)
    num_retractions: int = 0
    error: str | None = None  # why it ended with FinishReason.ERROR
    row: int = -1  # slot-table row while the request holds KV (KVCacheManager), else -1
    row_slots: torch.Tensor = field(default_factory=lambda: _NO_SLOTS)  # [L] int64 view of the row
    # Derived once when the request is queued (`Scheduler.add`), read by every step:
    stop_ids: frozenset[int] = frozenset()  # sampling one ends it: stop ids, EOS unless ignored
    max_output_len: int = 0  # output tokens it may make: max_new_tokens, capped by the context
    draft_index: NgramIndex | None = None  # its n-gram drafts' index (speculative decoding)
    mtp_drafts: list[int] | None = None  # the MTP drafts the last step made for it
    mtp_anchor: int = -1  # the seq_len they follow (`engine.mtp`)

    @property
    def draftable(self) -> bool:
        """Whether drafts may be verified for it: all but a request with a grammar, whose
        matcher would have to follow each draft and come back from the rejected ones; it
        decodes a token per step. Penalties, a bias and `min_tokens` are applied to each
        verified row as if the drafts before it were accepted (`Engine._process_verified`);
        log-probabilities are read from each row."""
        return self.params.structured_outputs is None

    @property
    def slots(self) -> torch.Tensor:
        """Full slot id of each position that has one ([n] int64 view of the request's
        slot-table row; valid while the request holds the row)."""
        return self.row_slots[: self.num_slots]

    def attach_row(self, row: int, row_slots: torch.Tensor) -> None:
        self.row, self.row_slots, self.num_slots = row, row_slots, 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """`token_ids[start:end]` without building the whole sequence (a decode step reads one)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:end] + self.output_ids[: max(0, end - n)]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def is_decoding(self) -> bool:
        """KV is computed up to the last sampled token: one token per step from here."""
        out = self.output_ids
        return bool(out) and self.num_computed == len(self.prompt_ids) + len(out) - 1

    @property
    def pending_tokens(self) -> int:
        """Tokens still to be computed before the next sample."""
        return self.seq_len - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def last_loc(self) -> int:
        return int(self.row_slots[self.num_computed - 1]) if self.num_computed else -1

    def end(self, reason: FinishReason, error: str | None = None) -> None:
        """The request is over: aborted (`ABORT`) or finished for `reason`; `error` says why
        a step or admission failed it (`ERROR`). Its KV is the caller's to release or cache."""
        self.status = (
            RequestStatus.ABORTED if reason == FinishReason.ABORT else RequestStatus.FINISHED
        )
        self.finish_reason = reason
        self.error = error

    def reset_kv(self) -> None:
        """Forget all KV state (after its slots and row were released)."""
        self.row, self.row_slots, self.num_slots = -1, _NO_SLOTS, 0
        self.num_computed = 0
        self.lock = None
        self.swa = SWAFreeState()
