"""What a worker streams for one request (`GenerateChunk`) and how a request ends
(`FinishReason`). Plain dataclasses: they cross the worker → ingress boundary (Ray pickles them)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    """Why a request ended. The first four are a request's own end, what a client sees; the
    last two are control signals between a worker and the ingress, never shown to a client."""

    STOP = "stop"  # a stop token (or EOS) was sampled
    LENGTH = "length"  # max_new_tokens (or the model's context) reached
    ABORT = "abort"
    ERROR = "error"  # the step that ran it failed; the chunk's `error` says why
    WORKER_LOST = "worker_lost"  # the worker died: the ingress migrates the request
    MISROUTED = "misrouted"  # a replica that was not the one chosen got the call: route again


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Where a request's time to first token went inside its worker (the chunk that carries
    its first token carries these). Seconds on the worker's monotonic clock.

        submitted ─ loop_wait_s ─► add ─ queued_s ─► admitted ─ prefill_s ─► first token

    `held_by`: what last kept it waiting at admission ("" if it was admitted at its first
    try): "running" (max_running_requests), "rows" (no slot-table row), "budget" (the step's
    prefill tokens went to requests before it), "full" / "swa" (that pool's admission budget),
    "pools" (no slots even after eviction). `prefill_steps`: the steps that computed its prompt
    (a chunk each); `step_decodes` / `step_prefill_tokens`: those steps' decode rows and prompt
    tokens, its own and other requests' (the mix it shared its steps with). `loop_wait_s`: from
    the worker's taking the request to its engine loop adding it, which happens between steps
    (mostly the rest of the step under way)."""

    queued_s: float
    prefill_s: float
    held_by: str
    prefill_steps: int
    step_decodes: int
    step_prefill_tokens: int
    loop_wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log-probability under the distribution it was drawn from (after the
    grammar mask, `min_tokens`, `logit_bias`, the penalties and the temperature; before top-k,
    top-p and min-p cut it), and the `top` most likely tokens of that distribution, best
    first, as (token id, log-probability) pairs (as many as `SamplingParams.logprobs`)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class GenerateChunk:
    """A request's new tokens since its previous chunk.

    `finish_reason` is set on the last chunk; `error` says why for ERROR, WORKER_LOST and
    MISROUTED. A worker's first chunk for a request is empty: it took the request."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    error: str | None = None
    worker_id: str = ""  # set by the cluster: the group that served it
    timings: RequestTimings | None = None  # on the chunk with the request's first token
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids`, when asked

    def merge(self, later: GenerateChunk) -> None:
        """Append `later`, the same request's next chunk: its tokens (and their logprobs)
        after these, its end and its error; the first token's timings stay."""
        self.token_ids.extend(later.token_ids)
        if later.logprobs:
            self.logprobs = [*(self.logprobs or ()), *later.logprobs]
        self.finished, self.finish_reason = later.finished, later.finish_reason
        self.cached_tokens = later.cached_tokens or self.cached_tokens
        self.error = later.error
        self.timings = self.timings or later.timings
