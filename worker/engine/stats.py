"""Engine counters (monotonic since start)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

STEP_PHASES = ("schedule", "input", "model", "sample", "draft", "postprocess")
STEP_LOG_LEN = 8192
"""Steps `StepLog` keeps (a few minutes of a busy engine; ~100 bytes each)."""


class StepRecord(NamedTuple):
    """One step as it ran: its decode rows, the prefills it carried (requests, prompt tokens,
    and the cached or computed tokens before them, which their attention reads), its wall
    time from scheduling to its outputs, and when it started (`time.perf_counter()`: the gaps
    between steps are the serving loop's own time, its reports and its dispatch)."""

    decode_rows: int
    prefill_requests: int
    prefill_tokens: int
    prefill_context_tokens: int
    seconds: float
    started_s: float


class StepLog:
    """The engine's last `STEP_LOG_LEN` steps (`StepRecord`s): what a model of its step cost
    is fitted to (bench/cluster_sim.py)."""

    def __init__(self, maxlen: int = STEP_LOG_LEN) -> None:
        self.records: deque[StepRecord] = deque(maxlen=maxlen)

    def add(self, record: StepRecord) -> None:
        self.records.append(record)

    def take(self) -> list[StepRecord]:
        """The records, oldest first, and forget them."""
        out = list(self.records)
        self.records.clear()
        return out


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_tokens: int = 0  # of which served from the prefix cache
    generated_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens the model computed (chunks, repairs, retries)
    prefill_s: float = 0.0  # forward time of the steps that computed them
    decode_steps: int = 0  # steps of decodes only ...
    decode_s: float = 0.0  # ... and their forward time
    prefill_chunks: int = 0  # chunks that ended before the prompt did
    retractions: int = 0
    swa_freed_tokens: int = 0  # out-of-window SWA slots given back by running requests
    tombstoned_pages: int = 0  # pages of the prefix cache whose SWA KV was evicted
    window_repairs: int = 0  # finished repairs: cached prefixes resumed by recomputing a window
    window_repair_tokens: int = 0  # tokens those repairs recomputed
    finished_requests: int = 0
    aborted_requests: int = 0
    failed_steps: int = 0  # steps whose forward or sampling raised (their requests got "error")
    spec_verifies: int = 0  # speculative decoding: a decode's verify of its drafts (per request)
    spec_draft_tokens: int = 0  # drafts proposed (and verified)
    spec_accepted_tokens: int = 0  # drafts the target accepted
    step_time_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))
    """Wall time spent in each phase of `Engine.step` (see `StepTimer`)."""

    def count_step(self, prefill_tokens: int, pure_decode: bool, seconds: float) -> None:
        """A step's forward seconds: to the prefill counters when it computed prompt tokens,
        to the decode ones when it only decoded (a step that verified drafts and computed no
        prompt is a decode step: what one step of the running decodes costs now). Sampling is left out: a request's logits
        processing (a grammar's first masks, penalties) is its own cost, not the worker's
        speed, and counted in it made one worker look several times slower than its twin."""
        if prefill_tokens:
            self.prefill_tokens += prefill_tokens
            self.prefill_s += seconds
        elif pure_decode:
            self.decode_steps += 1
            self.decode_s += seconds

    def timer(self) -> StepTimer:
        return StepTimer(self.step_time_s)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class StepTimer:
    """Adds the time since the previous lap to a phase's total (one perf_counter per lap);
    `lap` returns it."""

    __slots__ = ("_last", "_start", "_totals")

    def __init__(self, totals: dict[str, float]) -> None:
        self._totals = totals
        self._start = self._last = time.perf_counter()

    @property
    def started_s(self) -> float:
        """When the timer was created (`time.perf_counter()`)."""
        return self._start

    def since_start(self) -> float:
        """Seconds from the timer's creation to its last lap."""
        return self._last - self._start

    def lap(self, phase: str) -> float:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        self._totals[phase] += elapsed
        return elapsed
