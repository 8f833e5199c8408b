"""Pure KV rules shared by the worker and the router (which must not import each other).

- `cdiv` / `page_floor` / `page_ceil`: page arithmetic.
- `read_start` / `needed_before`: a local layer's span rule. A sliding window W: a query at q
  reads keys [q - W, q]. Chunked attention with chunk C (Llama 4): a query at q reads
  [floor(q / C)·C, q], nothing before its chunk. A chunked model passes W = C - 1 (the most
  keys before a query any query reads) wherever the rules only size things (pools, admission,
  kernels' masks) and `attention_chunk_size` = C wherever the rule decides what is read, freed
  or matched.
- `valid_match_length`: the SWA window rule of a prefix match (architecture §6). A matched path is a
  sequence of runs, each live (SWA KV held) or a tombstone (full KV only). A match may end only
  where at least W live tokens precede the end, or where no tombstone lies before it:

      # runs:   [live 8][tomb 4][live 2][live 3]      W = 4
      # ends:    ok at 8          no at 14  ok at 17 (5 live tokens since the tombstone)

  The radix cache (`SWARadixCache._walk`), the KV-event mirror (`bench/kv_event_mirror.py`)
  call it; the router's one-walk-for-all-workers bit-mask match is tested against it. Under
  the chunk rule a match of length L needs the live KV of [floor(L / C)·C, L): a chunk boundary
  needs none, so a match may end at one inside a tombstone.
- `prefix_reuse`: what a match lets a request skip once window repair is allowed (architecture §6): a
  path whose full KV is cached but whose window before the end was freed may be resumed by
  recomputing its last R = `window_repair_tokens(...)` tokens (their SWA KV only), where that
  saves more than the plain match under the window rule. The radix cache, the KV-event mirror
  and the router's cache view all answer with it.
- `swa_tokens_for_extend`: the SWA slots a prefill chunk of n tokens needs (the chunk plus the
  window before it, plus a page of slack); admission on the worker and the router's headroom
  estimate both use it. `max_swa_extend_tokens` inverts it: the longest extend an SWA pool
  takes (the engine's chunk cap, `RequestLimits`' unchunked-prompt limit).
- `min_swa_pool_tokens`: the smallest SWA pool that serves one request; every pool planner and
  the engine refuse a smaller one.
- `decode_swa_tokens`: `W + I + P`, the most SWA slots a decoding request holds; the pool
  planners size SWA pools with it.

`RequestLimits` (`request_limits.py`) applies these rules to a request's lengths.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative a and positive b."""
    return -(-a // b)


def page_floor(n: int, page_size: int) -> int:
    return n // page_size * page_size


def page_ceil(n: int, page_size: int) -> int:
    return cdiv(n, page_size) * page_size


def read_start(position: int, sliding_window_size: int, attention_chunk_size: int | None) -> int:
    """The first key a local layer's query at `position` reads: `position - W` (at least 0)
    under a sliding window, the start of its chunk under chunked attention."""
    if attention_chunk_size:
        return position // attention_chunk_size * attention_chunk_size
    return max(0, position - sliding_window_size)


def needed_before(end: int, sliding_window_size: int, attention_chunk_size: int | None) -> int:
    """Live tokens right before `end` that the next token's local layers read: W (fewer near
    the start) under a window, `end mod C` under chunks (0 at a chunk boundary)."""
    return end - read_start(end, sliding_window_size, attention_chunk_size)


def check_span_rule(
    sliding_window_size: int, attention_chunk_size: int | None, page_size: int
) -> None:
    """Raise ValueError unless a chunked rule is consistent: W = C - 1 and C a multiple of P
    (chunk boundaries are page boundaries: whole pages are freed and matched)."""
    c = attention_chunk_size
    if c is None:
        return
    if not isinstance(c, int) or c < 1 or c % page_size:
        raise ValueError(f"attention_chunk_size={c!r} must be a positive multiple of P={page_size}")
    if sliding_window_size != c - 1:
        raise ValueError(
            f"a chunked rule reads at most C - 1 = {c - 1} keys before a query; "
            f"got sliding_window_size={sliding_window_size}"
        )


def valid_match_length(
    runs: Iterable[tuple[int, bool]],
    sliding_window_size: int,
    attention_chunk_size: int | None = None,
) -> int:
    """Longest end of the matched path `runs` ((num_tokens, is_tombstone) in path order) at
    which a match may stop under the span rule. Window rule: ends are only considered at run
    boundaries (a caller that needs finer ends splits its runs: the radix cache's nodes, the
    mirror's pages). Chunk rule: also at the chunk boundaries inside a run (they need no live
    KV); a caller splits its run there."""
    best = 0
    end = 0
    live_run: float = float("inf")  # live tokens since the last tombstone; inf: none yet
    c = attention_chunk_size
    for num_tokens, tombstone in runs:
        if tombstone:
            live_run = 0
        else:
            live_run += num_tokens
        start, end = end, end + num_tokens
        if c:
            if live_run >= end % c:
                best = end
            elif end // c * c > start:  # inside this run, past it nothing is valid
                best = end // c * c
        elif live_run >= sliding_window_size:
            best = end
    return best


@dataclass(frozen=True, slots=True)
class PrefixReuse:
    """A match of `match_len` tokens whose last `repair_len` tokens are recomputed (their SWA KV
    only; 0 = a plain match). The request skips `saved_tokens` = match_len - repair_len."""

    match_len: int
    repair_len: int = 0

    @property
    def saved_tokens(self) -> int:
        return self.match_len - self.repair_len


def window_repair_tokens(
    num_swa_layers: int,
    sliding_window_size: int,
    page_size: int,
    attention_chunk_size: int | None = None,
) -> int:
    """R: the receptive field of a window, L_swa · W tokens, page-rounded up. Recomputing the R
    tokens before a match end through all layers (full layers reading their cached KV, SWA
    layers seeing only the recomputed range) makes the SWA KV of the last W of them exact: each
    SWA layer moves the inexact left edge W tokens to the right. 0 under the chunk rule (see
    `prefix_reuse`: a chunk boundary is always a valid end)."""
    if attention_chunk_size:
        return 0
    if num_swa_layers < 0 or sliding_window_size < 0 or page_size < 1:
        raise ValueError(
            f"bad arguments: num_swa_layers={num_swa_layers}, "
            f"sliding_window_size={sliding_window_size}, page_size={page_size}"
        )
    return page_ceil(num_swa_layers * sliding_window_size, page_size)


def prefix_reuse(
    runs: Iterable[tuple[int, bool]],
    sliding_window_size: int,
    repair_tokens: int = 0,
    attention_chunk_size: int | None = None,
) -> PrefixReuse:
    """The best resume point of the matched path `runs` ((num_tokens, is_tombstone) in path
    order; every run has full KV): the plain match under the window rule, or, when
    `repair_tokens` R > 0, the whole path with its last R tokens repaired if that skips more
    (R smaller than what it saves over the plain match)::

        # runs [live 40][tomb 200][live 8], W = 32, R = 64
        # plain: 40 (8 live tokens before 248 are not a window)   repaired: 248 - 64 = 184 saved

    Under the chunk rule a repair never pays: recomputing from the last chunk boundary b
    before the path's end skips b tokens, which the plain match at b skips already.
    """
    runs = list(runs)
    valid = valid_match_length(runs, sliding_window_size, attention_chunk_size)
    if attention_chunk_size:
        return PrefixReuse(valid)
    full = sum(n for n, _ in runs)
    if repair_tokens > 0 and full - repair_tokens > valid:
        return PrefixReuse(full, repair_tokens)
    return PrefixReuse(valid)


def swa_tokens_for_extend(num_tokens: int, sliding_window_size: int, page_size: int) -> int:
    """SWA slots a chunk of `num_tokens` new tokens needs: the chunk, the window of W tokens
    before it, and one page of slack for a chunk that starts mid-page."""
    return num_tokens + sliding_window_size + page_size


def max_swa_extend_tokens(swa_pool_tokens: int, sliding_window_size: int, page_size: int) -> int:
    """The most tokens one extend (a prefill chunk, or a whole prompt without chunked prefill)
    may add on an SWA pool of `swa_pool_tokens`: its SWA need (`swa_tokens_for_extend`) plus a
    page for the decode after it must fit."""
    return swa_pool_tokens - swa_tokens_for_extend(0, sliding_window_size, page_size) - page_size


def min_swa_pool_tokens(sliding_window_size: int, page_size: int) -> int:
    """The smallest SWA pool that holds one decoding request: its window, the page it writes
    into and the next token, page-rounded. For W >= P this is "more than W + P tokens"."""
    return page_ceil(max(sliding_window_size, page_size) + page_size + 1, page_size)


def decode_swa_tokens(sliding_window_size: int, swa_eviction_interval: int, page_size: int) -> int:
    """`W + I + P`: the most SWA slots a decoding request past its window holds. It frees
    out-of-window SWA only once I (`swa_eviction_interval`) positions are due, in whole pages
    (architecture §6.5)."""
    return sliding_window_size + swa_eviction_interval + page_size
