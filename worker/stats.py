"""Engine counters (monotonic since start)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_tokens: int = 0  # of which served from the prefix cache
    generated_tokens: int = 0
    prefill_chunks: int = 0  # chunks that ended before the prompt did
    retractions: int = 0
    swa_freed_tokens: int = 0  # out-of-window SWA slots given back by running requests
    tombstoned_pages: int = 0  # pages of the prefix cache whose SWA KV was evicted
    finished_requests: int = 0
    aborted_requests: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
