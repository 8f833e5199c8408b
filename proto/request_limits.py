"""RequestLimits: what a worker can ever serve, and the one check of a request against it.

The engine (`Engine.add_request`, `RequestError`), `RoutedCluster` (`InvalidRequest`), the gRPC
ingress (INVALID_ARGUMENT) and the OpenAI API (400) all ask `check`; the OpenAI API also asks
`max_new_tokens_room` for the default of `max_tokens`. A worker builds its limits from its
pool plan; the driver learns them from the worker (`ModelInfo.limits`).

    n = prompt tokens, m = max_new_tokens, L = max_model_len, F = full pool, P = page size
    prompt          n < L                        one position left to generate into
    max_new_tokens  n + m <= L                   refused up front, never cut short (the
                                                 engine alone cuts at L: `cut_at_model_len`)
    max_new_tokens  ceil_P(n + m) <= F           the full KV stays for the whole request
                    (`prompt` when n + 1 alone does not fit)
    prompt          n <= max_unchunked_prompt_tokens    two pools and no chunked prefill: the
                                                 whole prompt is one extend into the SWA pool
                                                 (chunked layers: no limit once one chunk fits)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from swaserve.proto.kv_rules import (
    max_swa_extend_tokens,
    page_ceil,
    page_floor,
    swa_tokens_for_extend,
)


@dataclass(frozen=True, slots=True)
class RequestRefused:
    """Why a request can never be served: `field` is what the client must change."""

    field: Literal["prompt", "max_new_tokens"]
    message: str


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The facts of one worker that bound a request (the same on every worker of a cluster).

    `sliding_window_size` is W (0: the model has no SWA layers); `swa_pool_tokens` is 0 when
    the worker keeps one pool (no SWA limit then); `chunked_prefill_size` is the engine's chunk
    after its cap, None when prompts are prefilled in one go."""

    max_model_len: int
    full_pool_tokens: int
    page_size: int
    sliding_window_size: int = 0
    swa_pool_tokens: int = 0
    chunked_prefill_size: int | None = None
    attention_chunk_size: int | None = None  # chunked SWA layers: no extend is longer than C

    @property
    def max_unchunked_prompt_tokens(self) -> int | None:
        """The longest prompt the SWA pool can prefill in one extend when chunked prefill is
        off (None: no such limit). A chunked model's extends stop at every multiple of C, so
        it has none when an extend of C tokens fits."""
        if self.swa_pool_tokens == 0 or self.chunked_prefill_size is not None:
            return None
        longest = max_swa_extend_tokens(
            self.swa_pool_tokens, self.sliding_window_size, self.page_size
        )
        if self.attention_chunk_size and longest >= self.attention_chunk_size:
            return None
        return longest

    def max_new_tokens_room(self, prompt_tokens: int) -> int:
        """The most max_new_tokens a prompt of `prompt_tokens` tokens may ask for under the
        model-length and full-pool rules of `check` (< 1: the prompt alone is too long)."""
        limit = min(self.max_model_len, page_floor(self.full_pool_tokens, self.page_size))
        return limit - prompt_tokens

    def check(
        self,
        prompt_tokens: int,
        max_new_tokens: int,
        *,
        max_new_name: str = "max_new_tokens",
        cut_at_model_len: bool = False,
    ) -> RequestRefused | None:
        """The first rule of the module docstring the request breaks, or None (it fits an
        idle worker). `max_new_name`: what the caller's clients call max_new_tokens in the
        message. `cut_at_model_len`: the engine's rule, which ends a request at max_model_len
        (finish reason "length") instead of refusing it; only that much must fit the pool."""
        n, m, p = prompt_tokens, max_new_tokens, self.page_size
        if n >= self.max_model_len:
            return RequestRefused(
                "prompt",
                f"the prompt has {n} tokens; the model's limit is {self.max_model_len} in all",
            )
        if cut_at_model_len:
            m = min(m, self.max_model_len - n)
        elif n + m > self.max_model_len:
            return RequestRefused(
                "max_new_tokens",
                f"prompt ({n} tokens) + {max_new_name} ({m}) exceeds the model's limit of "
                f"{self.max_model_len} tokens",
            )
        need = page_ceil(n + m, p)
        if need > self.full_pool_tokens:
            fault: Literal["prompt", "max_new_tokens"] = (
                "prompt" if page_ceil(n + 1, p) > self.full_pool_tokens else "max_new_tokens"
            )
            return RequestRefused(
                fault,
                f"prompt ({n} tokens) + {max_new_name} ({m}) needs {need} KV tokens; the full "
                f"pool holds {self.full_pool_tokens}",
            )
        limit = self.max_unchunked_prompt_tokens
        if limit is not None and n > limit:
            swa_need = swa_tokens_for_extend(n, self.sliding_window_size, p) + p
            return RequestRefused(
                "prompt",
                f"a prompt of {n} tokens does not fit the SWA pool without chunked prefill: it "
                f"needs {swa_need} SWA tokens, the pool holds {self.swa_pool_tokens} (at most "
                f"{limit} prompt tokens); enable chunked_prefill_size",
            )
        return None
