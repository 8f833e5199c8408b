"""Pure KV rules shared by the worker and the router (which must not import each other).

- `cdiv` / `page_floor` / `page_ceil`: page arithmetic.
- `valid_match_length`: the SWA window rule of a prefix match (DESIGN §6). A matched path is a
  sequence of runs, each live (SWA KV held) or a tombstone (full KV only). A match may end only
  where at least W live tokens precede the end, or where no tombstone lies before it:

      # runs:   [live 8][tomb 4][live 2][live 3]      W = 4
      # ends:    ok at 8          no at 14  ok at 17 (5 live tokens since the tombstone)

  The radix cache (`SWARadixCache._walk`), the KV-event mirror (`KVEventMirror.match_length`)
  call it; the router's one-walk-for-all-workers bit-mask match is tested against it.
- `swa_tokens_for_extend`: the SWA slots a prefill chunk of n tokens needs (the chunk plus the
  window before it, plus a page of slack); admission on the worker and the router's headroom
  estimate both use it.
"""

from __future__ import annotations

from collections.abc import Iterable


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative a and positive b."""
    return -(-a // b)


def page_floor(n: int, page_size: int) -> int:
    return n // page_size * page_size


def page_ceil(n: int, page_size: int) -> int:
    return cdiv(n, page_size) * page_size


def valid_match_length(runs: Iterable[tuple[int, bool]], sliding_window_size: int) -> int:
    """Longest end of the matched path `runs` ((num_tokens, is_tombstone) in path order) at
    which a match may stop under the window rule. Ends are only considered at run boundaries:
    a caller that needs finer ends splits its runs (the radix cache's nodes, the mirror's pages)."""
    best = 0
    end = 0
    live_run: float = float("inf")  # live tokens since the last tombstone; inf: none yet
    for num_tokens, tombstone in runs:
        if tombstone:
            live_run = 0
        else:
            live_run += num_tokens
        end += num_tokens
        if live_run >= sliding_window_size:
            best = end
    return best


def swa_tokens_for_extend(num_tokens: int, sliding_window_size: int, page_size: int) -> int:
    """SWA slots a chunk of `num_tokens` new tokens needs: the chunk, the window of W tokens
    before it, and one page of slack for a chunk that starts mid-page."""
    return num_tokens + sliding_window_size + page_size


def min_swa_pool_tokens(sliding_window_size: int, page_size: int) -> int:
    """The smallest SWA pool that holds one decoding request: its window, the page it writes
    into and the next token, page-rounded."""
    return page_ceil(max(sliding_window_size, page_size) + page_size + 1, page_size)
