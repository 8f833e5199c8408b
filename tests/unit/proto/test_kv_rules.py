"""The window rule, window repair, page arithmetic and SWA need of `swaserve.proto.kv_rules`,
against a brute-force reading of architecture §6, and the router's bit-mask match against the same
rules."""

from __future__ import annotations

import random

import pytest

from swaserve.proto.kv_rules import (
    PrefixReuse,
    cdiv,
    check_span_rule,
    decode_swa_tokens,
    max_swa_extend_tokens,
    min_swa_pool_tokens,
    needed_before,
    page_ceil,
    page_floor,
    prefix_reuse,
    read_start,
    swa_tokens_for_extend,
    valid_match_length,
    window_repair_tokens,
)


def brute_force(runs: list[tuple[int, bool]], window: int) -> int:
    """Expand runs to tokens; an end e (a run boundary) is valid iff no tombstone token lies in
    [0, e) or the last `window` tokens before e are all live."""
    tokens = [t for n, tomb in runs for t in [tomb] * n]
    ends = [0]
    for n, _ in runs:
        ends.append(ends[-1] + n)
    best = 0
    for e in ends[1:]:
        before = tokens[:e]
        if not any(before) or (e >= window and not any(before[e - window :])):
            best = e
    return best


def test_reference_example() -> None:
    runs = [(8, False), (4, True), (2, False), (3, False)]
    assert valid_match_length(runs, 4) == 17
    assert valid_match_length(runs[:3], 4) == 8
    assert valid_match_length([(3, True)], 2) == 0
    assert valid_match_length([], 2) == 0


@pytest.mark.parametrize("seed", range(5))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        runs = [(rng.randint(1, 5), rng.random() < 0.3) for _ in range(rng.randint(0, 8))]
        window = rng.randint(1, 9)
        assert valid_match_length(runs, window) == brute_force(runs, window), (runs, window)


def test_prefix_reuse_reference_example() -> None:
    runs = [(40, False), (200, True), (8, False)]  # the docstring's picture, W = 32
    assert prefix_reuse(runs, 32) == PrefixReuse(40)
    assert prefix_reuse(runs, 32, 64) == PrefixReuse(248, 64)
    assert prefix_reuse(runs, 32, 64).saved_tokens == 184
    assert prefix_reuse(runs, 32, 208) == PrefixReuse(40)  # 248 - 208 = 40: no gain, no repair
    assert prefix_reuse([(48, False)], 32, 16) == PrefixReuse(48)  # a live window: no repair
    assert prefix_reuse([], 32, 16) == PrefixReuse(0)
    assert window_repair_tokens(2, 128, 16) == 256 and window_repair_tokens(3, 5, 4) == 16


def brute_force_reuse(runs: list[tuple[int, bool]], window: int, repair: int) -> int:
    """Saved tokens: the best of the valid plain ends and, with R > 0, the whole path less R."""
    options = [brute_force(runs, window)]
    if repair > 0:
        options.append(sum(n for n, _ in runs) - repair)
    return max(options)


@pytest.mark.parametrize("seed", range(3))
def test_prefix_reuse_saves_the_most_of_plain_and_repaired(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        runs = [(rng.randint(1, 5), rng.random() < 0.4) for _ in range(rng.randint(0, 8))]
        window, repair = rng.randint(1, 9), rng.choice([0, 0, 1, 2, 4, 8, 16])
        reuse = prefix_reuse(runs, window, repair)
        assert reuse.saved_tokens == brute_force_reuse(runs, window, repair), (runs, window)
        assert reuse.repair_len in (0, repair) and reuse.match_len <= sum(n for n, _ in runs)


def test_page_arithmetic() -> None:
    assert [cdiv(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert page_floor(7, 4) == 4 and page_ceil(7, 4) == 8 and page_ceil(8, 4) == 8
    assert swa_tokens_for_extend(100, 16, 4) == 120
    assert min_swa_pool_tokens(16, 4) == 24 and min_swa_pool_tokens(2, 4) == 12
    assert max_swa_extend_tokens(40, 8, 4) == 24  # 24 + W + P fits, plus a page for a decode
    assert decode_swa_tokens(127, 128, 16) == 271  # W + I + P


@pytest.mark.parametrize("seed", range(3))
def test_router_bitmask_match_follows_the_rule(seed: int) -> None:
    """The router's one-walk match over KV events equals the rule on each worker's pages:
    `prefix_reuse` with the worker's own W and R (R = 0: the plain window rule)."""
    from swaserve.proto.kv_events import KVStored, KVTombstoned, page_hashes
    from swaserve.router.exact_view import ExactCacheView

    rng = random.Random(seed)
    page = 2
    for _ in range(200):
        tokens = [rng.randint(0, 3) for _ in range(page * rng.randint(1, 8))]
        hashes = page_hashes(tokens, page)
        view = ExactCacheView(page)
        windows, repairs = {}, {}
        runs_of = {}
        for worker in range(4):
            held = rng.randint(0, len(hashes))
            tombs = [rng.random() < 0.35 for _ in range(held)]
            windows[worker] = rng.randint(0, 7)
            repairs[worker] = page * rng.choice([0, 0, 1, 2, 3, 5])
            if held:
                view.apply(
                    worker,
                    [KVStored(tuple(hashes[:held]), None, tuple(tokens[: held * page]), page)],
                )
                tomb_hashes = tuple(h for h, t in zip(hashes, tombs, strict=False) if t)
                if tomb_hashes:
                    view.apply(worker, [KVTombstoned(tomb_hashes)])
            runs_of[worker] = [(page, t) for t in tombs]
        assert view.match(tokens, windows) == {
            w: valid_match_length(runs_of[w], window) for w, window in windows.items()
        }
        got = view.match(tokens, windows, repairs)
        for worker, window in windows.items():
            expected = prefix_reuse(runs_of[worker], window, repairs[worker]).saved_tokens
            assert got[worker] == expected, (runs_of[worker], window, repairs[worker])


def brute_force_chunked(runs: list[tuple[int, bool]], chunk: int) -> int:
    """Expand runs to tokens; an end e (a run boundary or a multiple of C) is valid iff the
    tokens of [floor(e / C)·C, e) are all live."""
    tokens = [t for n, tomb in runs for t in [tomb] * n]
    ends = {0, *range(0, len(tokens) + 1, chunk)}
    pos = 0
    for n, _ in runs:
        pos += n
        ends.add(pos)
    return max(e for e in ends if not any(tokens[e // chunk * chunk : e]))


@pytest.mark.parametrize("seed", range(5))
def test_chunk_rule_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        runs = [(rng.randint(1, 7), rng.random() < 0.4) for _ in range(rng.randint(0, 8))]
        chunk = rng.randint(1, 9)
        got = valid_match_length(runs, chunk - 1, chunk)
        assert got == brute_force_chunked(runs, chunk), (runs, chunk)
        assert prefix_reuse(runs, chunk - 1, 64, chunk) == PrefixReuse(got)  # never a repair


def test_chunk_rule_ends_at_a_boundary_inside_a_tombstone() -> None:
    # [live 4][tomb 10][live 3], C = 8: the end 17 needs [16, 17) live: ok; cut at 14 the
    # last valid end is the boundary 8 inside the tombstone (no SWA KV needed there).
    assert valid_match_length([(4, False), (10, True), (3, False)], 7, 8) == 17
    assert valid_match_length([(4, False), (10, True)], 7, 8) == 8
    assert read_start(17, 7, 8) == 16 and needed_before(16, 7, 8) == 0
    assert read_start(17, 7, None) == 10 and needed_before(3, 7, None) == 3
    assert window_repair_tokens(4, 7, 1, 8) == 0
    with pytest.raises(ValueError, match="multiple of P"):
        check_span_rule(7, 8, 3)
    with pytest.raises(ValueError, match="C - 1"):
        check_span_rule(8, 8, 1)


@pytest.mark.parametrize("seed", range(3))
def test_router_match_follows_the_chunk_rule_beside_windowed_workers(seed: int) -> None:
    """Workers with chunked local layers (C, W = C - 1) next to windowed ones in one view: each
    answers `valid_match_length` under its own rule."""
    from swaserve.proto.kv_events import KVStored, KVTombstoned, page_hashes
    from swaserve.router.exact_view import ExactCacheView

    rng = random.Random(seed)
    page = 2
    for _ in range(200):
        tokens = [rng.randint(0, 3) for _ in range(page * rng.randint(1, 10))]
        hashes = page_hashes(tokens, page)
        view = ExactCacheView(page)
        windows, chunks, runs_of = {}, {}, {}
        for worker in range(5):
            held = rng.randint(0, len(hashes))
            tombs = [rng.random() < 0.4 for _ in range(held)]
            if worker % 2:
                chunks[worker] = page * rng.randint(1, 4)
                windows[worker] = chunks[worker] - 1
            else:
                windows[worker] = rng.randint(0, 7)
            if held:
                view.apply(
                    worker,
                    [KVStored(tuple(hashes[:held]), None, tuple(tokens[: held * page]), page)],
                )
                tomb_hashes = tuple(h for h, t in zip(hashes, tombs, strict=False) if t)
                if tomb_hashes:
                    view.apply(worker, [KVTombstoned(tomb_hashes)])
            runs_of[worker] = [(page, t) for t in tombs]
        got = view.match(tokens, windows, None, chunks)
        for worker, window in windows.items():
            expected = valid_match_length(runs_of[worker], window, chunks.get(worker))
            assert got[worker] == expected, (runs_of[worker], window, chunks.get(worker))
