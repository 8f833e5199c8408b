"""The window walk: per worker, the prompt tokens its prefix cache would let a request skip,
under the engine's rule (`swaserve.proto.kv_rules.prefix_reuse`), for all workers in one pass.

Along one worker's pages of a prompt (P = 2, W = 4; L live, T tombstone), an end is valid with
no tombstone before it or with at least W live tokens right before it, and the plain match is
the last valid end before the first page the worker lacks:

    # pages:       L  L  T  L  L  L  |  (not held)
    # ends:     0  2  4  6  8  10 12
    # valid:    y  y  y  n  n  y  y     -> match 12; cut the prompt at 8 and it is 4

A worker that repairs windows (R > 0) may instead resume at the end of all the pages it holds
in a row, F, recomputing the last R: it skips max(valid, F - R). Cut the prompt above at 8
with R = 2 and it skips 6 instead of 4.

A worker with chunked local layers (C > 0, W = C - 1) matches by the chunk rule instead: an end
needs live KV only back to its chunk's start, none at a chunk boundary
(`kv_rules.valid_match_length`); the walk answers those workers one by one over their own runs.

A prompt routed to a worker whose report does not show it cached yet extends that worker's
run (`inflight_extends`): the pages past its view's run are new KV, live once the prefill ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from swaserve.proto.kv_rules import valid_match_length


def match_runs(
    runs: Iterable[tuple[int, int, int]],
    page_size: int,
    windows: Mapping[int, int],
    repair_tokens: Mapping[int, int] | None = None,
    chunk_sizes: Mapping[int, int] | None = None,
) -> dict[int, int]:
    """Tokens that each worker of `windows` (worker -> its W) would skip, given `runs`: the
    (held, tomb, pages) of a prompt's whole pages from the root, as far as any worker holds
    them, pages in a row with equal masks as one run. `prefix_reuse(runs, W, R).saved_tokens`
    over the pages each worker holds in a row, R = `repair_tokens[worker]` (absent or 0: the
    worker does not repair); `chunk_sizes[worker]` its C when its local layers are chunked.
    `walk_runs` over the workers as columns."""
    members, w, r = worker_columns(windows, repair_tokens)
    chunks = np.zeros(len(w), np.int64)
    for k, c in (chunk_sizes or {}).items():
        if k in windows:
            chunks[k] = c
    best = walk_runs(list(runs), page_size, members, w, r, chunks=chunks)
    return {k: int(best[k]) for k in windows}


def worker_columns(
    windows: Mapping[int, int], repair_tokens: Mapping[int, int] | None = None
) -> tuple[int, np.ndarray, np.ndarray]:
    """`walk_runs`' arguments for the workers of `windows`: their mask, W and R by worker."""
    size = max(windows, default=-1) + 1
    w, r = np.zeros(size, np.int64), np.zeros(size, np.int64)
    members = 0
    for k, window in windows.items():
        w[k] = window
        members |= 1 << k
    for k, repair in (repair_tokens or {}).items():
        if k in windows and repair > 0:
            r[k] = repair
    return members, w, r


def walk_runs(
    runs: Iterable[tuple[int, int, int]],
    page_size: int,
    members: int,
    windows: np.ndarray,
    repairs: np.ndarray,
    *,
    chunks: np.ndarray | None = None,
) -> np.ndarray:
    """`match_runs` for the workers of the bit mask `members`, with their W and R (> 0: it
    repairs) in int64 arrays indexed by worker (`members` < 2^len); returns the tokens each
    skips, by worker (0 outside `members`).

    One walk for all workers, with bit masks: `alive` hold every page so far; `ok` are at
    a valid end (no tombstone yet, or >= W live tokens since the last one); `in_tomb` saw
    a tombstone as their previous page. A worker that leaves a run of tombstones at end
    `e` is `ready` again at end `e + W` (`waiting` until then). A worker's valid match is
    the last end at which it was in `ok`, written when it leaves `ok` or `alive`, or when
    the walk stops; where it leaves `alive` (or the walk stops) is its full run F, and a
    repairing worker that is not in `ok` there answers max(valid, F - R). The work is a few
    mask operations per run, plus a few array operations per change of state, however many
    workers change at once.
    """
    p = page_size
    chunked = members & bits_mask(chunks > 0) if chunks is not None else 0
    best = np.zeros(len(windows), np.int64)
    if chunked:
        assert chunks is not None
        runs = list(runs)
        members &= ~chunked
        for k in mask_bits(chunked).tolist():
            best[k] = _chunk_walk(runs, p, k, int(chunks[k]))
    alive = members
    tombs_matter = members & bits_mask(windows > 0)  # with W = 0 every end is valid
    repairing = members & bits_mask(repairs > 0)
    ok, in_tomb, waiting = alive, 0, 0
    ready = np.zeros(len(windows), np.int64)  # end at which a waiting worker is ok again
    next_ready = _NEVER  # <= the least `ready` of the waiting workers
    end = 0
    for held, page_tomb, pages in runs:
        if not alive:
            break
        gone = alive & ~held
        if gone:
            if gone & ok:
                best[mask_bits(gone & ok)] = end
            if gone & repairing & ~ok:
                _repair(best, gone & repairing & ~ok, end, repairs)
            alive &= held
            ok &= alive
            in_tomb &= alive
            waiting &= alive
        tomb = page_tomb & tombs_matter & alive
        if tomb & ok:
            best[mask_bits(tomb & ok)] = end
            ok &= ~tomb
        if tomb != in_tomb:
            waiting &= ~tomb
            if leaving := in_tomb & ~tomb:  # their live run starts at this page
                at = mask_bits(leaving)
                ready[at] = end + windows[at]
                next_ready = min(next_ready, int(ready[at].min()))
                waiting |= leaving
            in_tomb = tomb
        end += p * pages  # past the run's first page nothing changes but `ready`
        if waiting and end >= next_ready:
            at = mask_bits(waiting)
            done = ready[at] <= end
            ok |= waiting & bits_mask_at(at[done], len(windows))
            waiting &= ~ok
            next_ready = int(ready[at[~done]].min()) if waiting else _NEVER
    if alive & ok:
        best[mask_bits(alive & ok)] = end
    if alive & repairing & ~ok:
        _repair(best, alive & repairing & ~ok, end, repairs)
    return best


def _chunk_walk(runs: list[tuple[int, int, int]], page_size: int, worker: int, chunk: int) -> int:
    """The match of one worker with chunked local layers: its held run of pages under the
    chunk rule (`kv_rules.valid_match_length`)."""
    bit, own = 1 << worker, []
    for held, tomb, pages in runs:
        if not held & bit:
            break
        own.append((page_size * pages, bool(tomb & bit)))
    return valid_match_length(own, chunk - 1, chunk)


def held_tokens(
    runs: Iterable[tuple[int, int, int]], page_size: int, members: int, size: int
) -> np.ndarray:
    """By worker of the bit mask `members` (an array of `size`), the tokens of the pages of
    `runs` it holds in a row from the root, tombstones or not (its full run F)."""
    out = np.zeros(size, np.int64)
    alive, end = members, 0
    for held, _, pages in runs:
        if gone := alive & ~held:
            out[mask_bits(gone)] = end
            alive &= held
        if not alive:
            return out
        end += page_size * pages
    if alive:
        out[mask_bits(alive)] = end
    return out


_NEVER = 1 << 62


def mask_bits(mask: int) -> np.ndarray:
    """The positions of the set bits of `mask` (>= 0), ascending."""
    if mask & (mask - 1) == 0:
        return np.array([mask.bit_length() - 1] if mask else [], np.intp)
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little"))


def bits_mask(flags: np.ndarray) -> int:
    """The bit mask of a bool array: bit i set where `flags[i]`."""
    return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")


def bits_mask_at(positions: np.ndarray, size: int) -> int:
    """The bit mask with the bits at `positions` (each < `size`) set."""
    flags = np.zeros(size, bool)
    flags[positions] = True
    return bits_mask(flags)


def _repair(best: np.ndarray, mask: int, full_end: int, repairs: np.ndarray) -> None:
    """The workers of `mask` hold a full run to `full_end` without a valid end there: a
    repair of their last R tokens saves `full_end - R` where that beats the valid match
    (`prefix_reuse`)."""
    at = mask_bits(mask)
    best[at] = np.maximum(best[at], full_end - repairs[at])


def inflight_extends(flying: np.ndarray, held: np.ndarray, windows: int | np.ndarray) -> np.ndarray:
    """By worker, whether the run of prompt pages its in-flight prompts hold (`flying`) beats
    its view's full run (`held`) as a match: longer, and either nothing is held or the new
    pages past the held run are a whole window (their SWA KV is live, the match ends valid)."""
    return (flying > held) & ((held == 0) | (flying - held >= windows))
