"""Engine counters (monotonic since start)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

STEP_PHASES = ("schedule", "input", "model", "sample", "postprocess")


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_tokens: int = 0  # of which served from the prefix cache
    generated_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens the model computed (chunks, repairs, retries)
    prefill_s: float = 0.0  # wall time of the steps that computed them (forward + sample)
    prefill_chunks: int = 0  # chunks that ended before the prompt did
    retractions: int = 0
    swa_freed_tokens: int = 0  # out-of-window SWA slots given back by running requests
    tombstoned_pages: int = 0  # pages of the prefix cache whose SWA KV was evicted
    window_repairs: int = 0  # finished repairs: cached prefixes resumed by recomputing a window
    window_repair_tokens: int = 0  # tokens those repairs recomputed
    finished_requests: int = 0
    aborted_requests: int = 0
    failed_steps: int = 0  # steps whose forward or sampling raised (their requests got "error")
    step_time_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))
    """Wall time spent in each phase of `Engine.step` (see `StepTimer`)."""

    def timer(self) -> StepTimer:
        return StepTimer(self.step_time_s)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class StepTimer:
    """Adds the time since the previous lap to a phase's total (one perf_counter per lap);
    `lap` returns it."""

    __slots__ = ("_last", "_totals")

    def __init__(self, totals: dict[str, float]) -> None:
        self._totals = totals
        self._last = time.perf_counter()

    def lap(self, phase: str) -> float:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        self._totals[phase] += elapsed
        return elapsed
