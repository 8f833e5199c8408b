"""Throughput of SWARadixCache insert / match / evict on a multi-turn chat workload.

Workload: a shared system prompt, then conversations of T turns; turn t of a conversation is
the system prompt plus t user+assistant exchanges. Requests arrive round-robin over the
conversations, turn by turn: each reuses its previous turn (`prev_prefix_len`), brings slots
for its new tokens, has freed the SWA KV that decode pushed out of its window, and is
inserted. The tree then holds N = conversations × T cached sequences, N = 10^3, 10^4, 10^5.

Printed per scale: insert, match and evict throughput (evict ops: nodes removed or tombstoned,
by calls that each evict ~64 nodes, allocator frees included) and the match time for keys of
1..T turns: the fastest batch of 50 matches (best of 3), timed close together for all trees,
so that other load on the machine disturbs every scale alike. The baseline is the smallest
tree of the same run: at a fixed key length, match time should stay flat as the tree grows
100× (the walk follows the key, not the tree) and grow with the key's length instead.

    python bench/radix_ops.py [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from swaserve.proto.kv_events import KVRemoved, KVTombstoned
from swaserve.worker.kv import SWATokenAllocator, swa_free_boundary
from swaserve.worker.kv.radix_cache import SWARadixCache


@dataclass(frozen=True, slots=True)
class Workload:
    page_size: int = 16
    window: int = 128
    system_tokens: int = 256
    turn_tokens: int = 256  # user + assistant tokens added per turn
    turns: int = 4

    def full_tokens(self, conversations: int) -> int:
        return self.system_tokens + conversations * self.turns * self.turn_tokens


def conversations(work: Workload, count: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """The system prompt and each conversation's turn tokens, drawn from a 2^16 vocabulary
    (no two conversations share a first page)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = list(range(1 << 16))  # shared int objects keep 10^5 conversations small
    system = [
        vocab[i] for i in torch.randint(1 << 16, (work.system_tokens,), generator=gen).tolist()
    ]
    length = work.turns * work.turn_tokens
    ids = torch.randint(1 << 16, (count, length), generator=gen).tolist()
    return system, [[vocab[i] for i in row] for row in ids]


def build(
    work: Workload, num_convs: int
) -> tuple[SWARadixCache, list[int], list[list[int]], float]:
    """A tree of the system prompt plus `num_convs` conversations of `work.turns` turns, filled
    the way finished requests fill it. Returns it, the tokens, and the seconds spent in insert.

    Each request reuses the previous turn (its slots, `prev_prefix_len`), brings new slots for
    its new tokens, and has freed the SWA KV that decode pushed out of its window. Allocation
    and SWA freeing are batched per round of turns to keep the set-up cheap; only `insert`
    is timed.
    """
    system, convs = conversations(work, num_convs)
    full = work.full_tokens(num_convs) + work.page_size
    allocator = SWATokenAllocator(full, full, page_size=work.page_size)
    cache = SWARadixCache(allocator, work.window, work.page_size)
    system_slots = allocator.alloc(len(system))
    assert system_slots is not None, "the pools fit the whole workload"
    cache.insert(system, system_slots)  # the system prompt, warm and live
    prefix = [system_slots] * num_convs  # [len(prev turn)] int64 slots each conversation reuses
    insert_s = 0.0
    for turn in range(1, work.turns + 1):
        new = allocator.alloc(num_convs * work.turn_tokens)
        assert new is not None
        values = [torch.cat((prefix[c], own)) for c, own in enumerate(new.split(work.turn_tokens))]
        length = len(system) + turn * work.turn_tokens
        m = length - work.turn_tokens
        boundary = swa_free_boundary(
            length, sliding_window_size=work.window, page_size=work.page_size, radix_cache=True
        )
        allocator.free_swa(torch.cat([v[m:boundary] for v in values]))
        for conv, value in zip(convs, values, strict=True):
            key = system + conv[: turn * work.turn_tokens]
            start = time.perf_counter()
            cache.insert(key, value, prev_prefix_len=m, swa_evicted_seqlen=max(boundary, m))
            insert_s += time.perf_counter() - start
        prefix = values
        cache.take_events()
    return cache, system, convs, insert_s


def run(work: Workload, scales: list[int], probes: int) -> dict[int, dict[str, object]]:
    """Build one tree per scale, time matches interleaved across the trees (other load on the
    machine then slows every scale alike), then time evictions on each."""
    built = {n: build(work, n // work.turns) for n in scales}
    probes = min([probes] + [len(convs) for _, _, convs, _ in built.values()])
    rng = random.Random(1)
    batches: dict[tuple[int, int], list[list[list[int]]]] = {}
    for n, (_, system, convs, _) in built.items():
        for turn in range(1, work.turns + 1):
            keys = [system + c[: turn * work.turn_tokens] for c in rng.sample(convs, probes)]
            batches[n, len(keys[0])] = [keys[i : i + 50] for i in range(0, probes, 50)]
    match_us: dict[int, dict[int, float]] = {n: {} for n in scales}
    for (n, length), key_batches in sorted(batches.items(), key=lambda item: item[0][::-1]):
        cache = built[n][0]
        match_us[n][length] = min(best_us(cache, b) / len(b) for b in key_batches)
    results = {}
    for n, (cache, _, _, insert_s) in built.items():
        nodes, cached = len(cache._nodes()), cache.total_size()
        # A scheduler short of memory evicts its whole shortfall in one call: ~64 nodes per
        # call, on at most a quarter of the tree per phase.
        calls = max(1, min(20, nodes // (4 * 64)))
        results[n] = {
            "sequences": n,
            "tree_nodes": nodes,
            "cached_full_tokens": cached[0],
            "cached_swa_tokens": cached[1],
            "insert_ops_s": n / insert_s,
            "match_ops_s": work.turns / sum(match_us[n].values()) * 1e6,
            "match_us_by_key_len": match_us[n],
            "evict_ops_s": evicted_nodes_per_s(cache, 64 * work.turn_tokens, 0, calls),
            "swa_evict_ops_s": evicted_nodes_per_s(cache, 0, 64 * work.window, calls),
        }
    return results


def best_us(cache: SWARadixCache, keys: list[list[int]], repeats: int = 3) -> float:
    """µs to match all `keys`, fastest of `repeats` runs: the least disturbed by other load."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for key in keys:
            cache.match_prefix(key)
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def evicted_nodes_per_s(
    cache: SWARadixCache, full_tokens: int, swa_tokens: int, calls: int
) -> float:
    """Nodes removed or tombstoned per second by `calls` evictions of the given sizes."""
    cache.take_events()
    start = time.perf_counter()
    for _ in range(calls):
        cache.evict(full_tokens, swa_tokens)
    elapsed = time.perf_counter() - start
    return sum(isinstance(e, (KVRemoved, KVTombstoned)) for e in cache.take_events()) / elapsed


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line"
    )
    parser.add_argument(
        "--quick", action="store_true", help="10^2 and 10^3 sequences only (for tests)"
    )
    args = parser.parse_args(argv)
    work = Workload()
    scales = [100, 1000] if args.quick else [1000, 10_000, 100_000]
    probes = 200 if args.quick else 500
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny bookkeeping tensors: as in the scheduler, no intra-op pool
    try:
        results = run(work, scales, probes)
    finally:
        torch.set_num_threads(threads)

    report = summarize(work, results)
    if args.json:
        print(json.dumps(report))
    return report


def summarize(work: Workload, results: dict[int, dict[str, object]]) -> dict[str, object]:
    """Print the table and the two scaling ratios; return the JSON report."""
    scales = list(results)
    us_by: dict[int, dict[int, float]] = {n: r["match_us_by_key_len"] for n, r in results.items()}  # type: ignore[misc]
    lengths = list(us_by[scales[0]])
    print(f"SWARadixCache, P={work.page_size}, W={work.window}, {work.turns} turns of {work.turn_tokens} tokens "
          f"after a {work.system_tokens}-token system prompt; KV events on")  # fmt: skip
    print(f"{'sequences':>10} {'nodes':>8} {'insert/s':>10} {'match/s':>10} {'swa evict/s':>12} {'evict/s':>10}")  # fmt: skip
    for n, r in results.items():
        print(f"{n:>10} {r['tree_nodes']:>8} {r['insert_ops_s']:>10.0f} {r['match_ops_s']:>10.0f} "
              f"{r['swa_evict_ops_s']:>12.0f} {r['evict_ops_s']:>10.0f}")  # fmt: skip
    print("match µs by key length in tokens (ratio to the smallest tree):")
    print(f"{'sequences':>10} " + " ".join(f"{length:>14}" for length in lengths))
    growth = {n: {k: us_by[n][k] / us_by[scales[0]][k] for k in lengths} for n in scales}
    for n in scales:
        print(f"{n:>10} " + " ".join(f"{us_by[n][k]:>7.1f} ({growth[n][k]:.2f})" for k in lengths))
    tree_ratio = {n: geomean(growth[n].values()) for n in scales}
    key_ratio = geomean(us_by[n][lengths[-1]] / us_by[n][lengths[0]] for n in scales)
    print("vs tree size (1.00 = flat): " + ", ".join(
        f"{n // scales[0]}× sequences → {tree_ratio[n]:.2f}× match time" for n in scales[1:]))  # fmt: skip
    print(f"vs key length: {lengths[-1] / lengths[0]:.1f}× tokens → {key_ratio:.2f}× match time "
          f"(geometric means over key lengths / tree sizes)")  # fmt: skip
    return {
        "bench": "radix_ops",
        "page_size": work.page_size,
        "sliding_window_size": work.window,
        "scales": {str(n): r for n, r in results.items()},
        "match_time_ratio_vs_smallest_tree": {str(n): tree_ratio[n] for n in scales},
        "match_time_ratio_longest_vs_shortest_key": key_ratio,
        "key_length_ratio": lengths[-1] / lengths[0],
    }


def geomean(values: Iterable[float]) -> float:
    logs = [math.log(v) for v in values]
    return math.exp(sum(logs) / len(logs))


if __name__ == "__main__":
    main()
