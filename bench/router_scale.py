"""One router over a fleet, by simulation: 16 / 64 / 256 synthetic workers × 10^2 / 10^3 / 10^4
cached sequences each, fed to one `Router` as real `WorkerReport`s with KV events.

First the event mix: a real tiny-model `Engine` (page size 16, W = 32, a pool small enough to
evict) serves a multi-turn load (sessions over 4 shared system prompts, 3-6 turns each), and
`engine.take_kv_events()` is counted per step: pages stored, removed, tombstoned, revived, and
the pages of a report that carries events. Those proportions drive the synthetic workers.

A synthetic worker's cache holds `S` sequences, each one of 16 shared system prompts of 1024
tokens (weights 1 / (j + 1): a few tenants dominate) and 1-4 turns of 256 unique tokens (mean
40 pages at P = 16). A turn is one `KVStored` chained under the previous one, with real page
hashes (`page_hashes`, blake2b); when a turn is stored, the first `tombstoned / stored` × 16
pages of the previous turn are tombstoned (at most the pages that left the W = 128 window), as
the engine's decodes leave the window. A sequence's tokens come from its own seed, so a probe
can regenerate them instead of keeping them.

Per cell (workers N × sequences S):
- build: each worker's sequences, 64 per report (seq 1, 2, ...; headroom of an idle worker
  with room for everything), into one router; the view's page count must equal the pages sent
  (no event mismatch);
- memory: RSS growth over the build, in a process forked for the cell (the router is the
  only thing that grows there), and that ÷ pages held: bytes per cached page, beside the
  view's own count of its state (`ExactCacheView.memory_bytes`; `--traced` adds
  tracemalloc's exact figure, at a cost in time and memory);
- decision: `Router.route` on probes — 80 % a cached sequence cut after a random turn plus a
  new 128-token message, 10 % a system prompt plus a fresh message, 10 % random tokens — each
  timed thrice (route, finish, route again) keeping the fastest, and the single-shot p99;
  in-flight requests are capped at 4 per worker (finished FIFO);
- GC: the time of one full `gc.collect()` after the build less one before it: the router's
  share of the pause a collection of the oldest generation costs (the exact view's pages
  are numpy columns, which the collector does not track);
- ingest: steady churn in reports sized like the engine's: a new sequence stored, its earlier
  turns tombstoned, the oldest sequences' leaf pages removed at the engine's removed / stored
  rate; pages applied per second of `Router.update` alone.

Cells whose page count is over `--max-pages` are not built: their memory is predicted from the
largest built cell's bytes per page, decision and ingest from the built cell with the same N
and the most sequences (both depend on the prompt and the worker count, not on the pages held;
the built cells show it). Goals (issue #23): decision p99 < 1 ms at 256 workers; memory < 8 GB
at 256 × 10^4; ingest >= 10^5 pages/s. The sharding figure: the pages one router holds in 8 GB,
and so the workers × sequences past which the fleet is split over router actors.

    python bench/router_scale.py [--quick] [--json] [--max-pages N] [--cells NxS,...] [--traced]

`--cells 256x10000` builds just those cells (whatever their size); the rest are predicted.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import random
import tempfile
import time
import tracemalloc
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

from swaserve.proto.kv_events import KVEvent, KVRemoved, KVStored, KVTombstoned, page_hashes
from swaserve.proto.kv_rules import window_repair_tokens
from swaserve.proto.messages import Headroom, WorkerReport
from swaserve.router import Router, RouterConfig

P, W = 16, 128  # page size and window of the simulated fleet
SYSTEM_PROMPTS, SYSTEM_TOKENS, TURN_TOKENS, MAX_TURNS = 16, 1024, 256, 4
VOCAB = range(200_000)
MEMORY_GOAL_BYTES = 8 * 10**9
DECISION_GOAL_MS, INGEST_GOAL_PAGES_S = 1.0, 1e5
MEAN_PAGES_PER_SEQUENCE = (1 + MAX_TURNS) * TURN_TOKENS // (2 * P)  # 40 unique pages
SYSTEM_WEIGHTS = [1 / (j + 1) for j in range(SYSTEM_PROMPTS)]


def expected_pages(workers: int, sequences: int) -> int:
    """Pages the fleet's caches hold, summed over workers: each worker's sequences' unique
    pages plus the system prompts at least one of its sequences uses."""
    share = [w / sum(SYSTEM_WEIGHTS) for w in SYSTEM_WEIGHTS]
    systems = sum(1 - (1 - q) ** sequences for q in share)
    return round(workers * (sequences * MEAN_PAGES_PER_SEQUENCE + systems * (SYSTEM_TOKENS // P)))


@dataclass(frozen=True, slots=True)
class EventMix:
    """Pages per event kind from the engine's stream, and the pages of a report with events."""

    stored_pages: int
    removed_pages: int
    tombstoned_pages: int
    revived_pages: int
    steps: int
    reports_with_events: int

    @property
    def removed_per_stored(self) -> float:
        return self.removed_pages / max(1, self.stored_pages)

    @property
    def tombstoned_per_stored(self) -> float:
        return self.tombstoned_pages / max(1, self.stored_pages)

    @property
    def pages_per_report(self) -> float:
        total = self.stored_pages + self.removed_pages + self.tombstoned_pages + self.revived_pages
        return total / max(1, self.reports_with_events)


def engine_event_mix(sessions: int, pool_tokens: int, seed: int) -> EventMix:
    """Run a tiny GPT-OSS engine (P = 16, W = 32, `pool_tokens` full tokens: small enough that
    it evicts) over `sessions` multi-turn sessions, 8 at a time, and count its KV events per
    step."""
    import torch

    from swaserve.worker import Engine, EngineConfig, SamplingParams
    from swaserve.worker.models.tiny import make_tiny_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = random.Random(seed)
    pages: Counter[str] = Counter()
    steps = reports = 0
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(
            Path(tmp), num_layers=4, sliding_window_size=32, hidden_size=32, vocab_size=320
        )
        config = EngineConfig(
            model=str(model),
            dtype="float32",
            page_size=P,
            max_total_tokens=pool_tokens,
            chunked_prefill_size=512,
            seed=seed,
        )
        engine = Engine(config)
        systems = [[rng.randrange(4, 250) for _ in range(256)] for _ in range(4)]
        turns_left = {s: rng.randint(3, 6) for s in range(sessions)}
        history: dict[int, tuple[list[int], list[int]]] = {}
        active: dict[str, tuple[int, list[int], list[int]]] = {}

        def submit(s: int) -> None:
            system, past = history.setdefault(s, (rng.choice(systems), []))
            prompt = system + past + [rng.randrange(4, 250) for _ in range(rng.randint(32, 96))]
            params = SamplingParams(temperature=1.0, max_new_tokens=rng.randint(32, 128))
            active[engine.add_request(prompt, params)] = (s, prompt, [])

        pending = deque(range(sessions))
        for _ in range(min(8, sessions)):
            submit(pending.popleft())
        try:
            while active:
                outputs = engine.step()
                steps += 1
                events = engine.take_kv_events()
                reports += bool(events)
                for event in events:
                    pages[type(event).__name__] += len(getattr(event, "page_hashes", ()))
                for out in outputs:
                    s, prompt, generated = active[out.request_id]
                    generated += out.new_token_ids
                    if not out.finished:
                        continue
                    del active[out.request_id]
                    history[s] = (history[s][0], prompt[len(history[s][0]) :] + generated)
                    turns_left[s] -= 1
                    if turns_left[s] > 0:
                        submit(s)
                    elif pending:
                        submit(pending.popleft())
            engine.check()
        finally:
            engine.shutdown()
            torch.set_num_threads(threads)
    return EventMix(
        pages["KVStored"],
        pages["KVRemoved"],
        pages["KVTombstoned"],
        pages["KVRevived"],
        steps,
        reports,
    )


class SyntheticFleet:
    """Sequences of N workers as page-hash chains, regenerated from their seeds on demand."""

    def __init__(self, workers: int, seed: int, mix: EventMix) -> None:
        self.workers, self.seed, self.mix = workers, seed, mix
        rng = random.Random(seed)
        self.systems = [rng.choices(VOCAB, k=SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPTS)]
        self.system_hashes = [page_hashes(s, P) for s in self.systems]
        self.seq = [0] * workers  # reports sent per worker
        self.systems_held: list[set[int]] = [set() for _ in range(workers)]
        self.headroom = Headroom(
            10**12, 10**12, 0, 10**12, 10**12, 0, 0, 0,
            sliding_window_size=W,
            window_repair_tokens=window_repair_tokens(2, W, P),
            page_size=P,
            chunked_prefill_size=8192,
        )  # fmt: skip

    def sequence(self, worker: int, index: int) -> tuple[int, list[int], list[int]]:
        """(system prompt, unique tokens, their page hashes) of sequence `index` of `worker`."""
        rng = random.Random((self.seed * 1_000_003 + worker) * 1_000_003 + index)
        system = rng.choices(range(SYSTEM_PROMPTS), SYSTEM_WEIGHTS)[0]
        unique = rng.choices(VOCAB, k=rng.randint(1, MAX_TURNS) * TURN_TOKENS)
        return system, unique, page_hashes(unique, P, self.system_hashes[system][-1])

    def store_events(self, worker: int, index: int) -> list[KVEvent]:
        """The events that cache sequence `index` on `worker`: its system prompt (once per
        worker), then one `KVStored` per turn, each tombstoning part of the turn before."""
        system, unique, hashes = self.sequence(worker, index)
        events: list[KVEvent] = []
        if system not in self.systems_held[worker]:
            self.systems_held[worker].add(system)
            sh = self.system_hashes[system]
            events.append(KVStored(tuple(sh), None, tuple(self.systems[system]), P))
        turn_pages = TURN_TOKENS // P
        tombstoned = min(round(self.mix.tombstoned_per_stored * turn_pages), turn_pages - W // P)
        parent = self.system_hashes[system][-1]
        for t in range(len(hashes) // turn_pages):
            page_range = slice(t * turn_pages, (t + 1) * turn_pages)
            turn = tuple(unique[t * TURN_TOKENS : (t + 1) * TURN_TOKENS])
            events.append(KVStored(tuple(hashes[page_range]), parent, turn, P))
            if t and tombstoned > 0:
                start = (t - 1) * turn_pages
                events.append(KVTombstoned(tuple(hashes[start : start + tombstoned])))
            parent = hashes[page_range][-1]
        return events

    def report(self, worker: int, events: list[KVEvent]) -> WorkerReport:
        self.seq[worker] += 1
        return WorkerReport(f"w{worker}", "i0", self.seq[worker], 0.0, self.headroom, events)


def pages_of(events: list[KVEvent]) -> int:
    return sum(len(getattr(e, "page_hashes", ())) for e in events)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(router: Router, fleet: SyntheticFleet, sequences: int) -> tuple[int, float]:
    """Every worker's sequences into `router`, 64 per report; (pages sent, update seconds)."""
    sent, update_s = 0, 0.0
    for k in range(fleet.workers):
        router.add_worker(f"w{k}")
        for first in range(0, sequences, 64):
            events = [
                e
                for i in range(first, min(sequences, first + 64))
                for e in fleet.store_events(k, i)
            ]
            report = fleet.report(k, events)
            sent += pages_of([e for e in events if isinstance(e, KVStored)])
            start = time.perf_counter()
            router.update(report)
            update_s += time.perf_counter() - start
    return sent, update_s


def decision_latency(router: Router, fleet: SyntheticFleet, sequences: int, probes: int) -> dict:
    """p50 / p99 of `Router.route` over `probes` prompts (see the module docstring)."""
    rng = random.Random(fleet.seed + 7)
    times_ms, single_ms, hits = [], [], 0
    inflight: deque[str] = deque()
    for i in range(probes):
        draw = rng.random()
        if draw < 0.8:
            system, unique, _ = fleet.sequence(
                rng.randrange(fleet.workers), rng.randrange(sequences)
            )
            cut = rng.randint(1, len(unique) // TURN_TOKENS) * TURN_TOKENS
            prompt = fleet.systems[system] + unique[:cut] + rng.choices(VOCAB, k=128)
        elif draw < 0.9:
            prompt = rng.choice(fleet.systems) + rng.choices(VOCAB, k=128)
        else:
            prompt = rng.choices(VOCAB, k=1024)
        tries = []
        for attempt in range(3):  # the same decision thrice: keep the least disturbed one
            if attempt:
                router.finish(f"p{i}")
            start = time.perf_counter()
            decision = router.route(f"p{i}", prompt, 128)
            tries.append(1e3 * (time.perf_counter() - start))
        hits += decision.predicted_hit_tokens > 0
        times_ms.append(min(tries))
        single_ms.append(tries[0])
        inflight.append(f"p{i}")
        if len(inflight) > 4 * fleet.workers:
            router.finish(inflight.popleft())
    for request_id in inflight:
        router.finish(request_id)
    times_ms.sort()
    single_ms.sort()
    return {
        "probes": probes,
        "hit_share": hits / probes,
        "p50_ms": percentile(times_ms, 0.5),
        "p99_ms": percentile(times_ms, 0.99),
        "p99_single_shot_ms": percentile(single_ms, 0.99),
    }


def churn_reports(fleet: SyntheticFleet, sequences: int, reports: int) -> list[WorkerReport]:
    """Steady-state reports: per worker in turn, new sequences stored (with their tombstones)
    and the oldest sequences' pages removed leaf first at the engine's removed / stored rate,
    cut into reports of the engine's pages per report."""
    per_report = max(1, round(fleet.mix.pages_per_report))
    out: list[WorkerReport] = []
    k = 0
    next_new = [sequences] * fleet.workers
    oldest = [0] * fleet.workers
    left = [-1] * fleet.workers  # unique pages of the oldest sequence still held (-1: all)
    while len(out) < reports:
        events = fleet.store_events(k, next_new[k])
        next_new[k] += 1
        owed = round(
            fleet.mix.removed_per_stored * pages_of([e for e in events if isinstance(e, KVStored)])
        )
        while owed > 0 and oldest[k] < next_new[k] - 1:
            hashes = fleet.sequence(k, oldest[k])[2]
            held = len(hashes) if left[k] < 0 else left[k]
            n = min(owed, held)
            events.append(KVRemoved(tuple(hashes[held - n : held])))
            owed -= n
            left[k] = held - n
            if left[k] == 0:
                oldest[k], left[k] = oldest[k] + 1, -1
        flat = [page_event for e in events for page_event in split(e, per_report)]
        batch: list[KVEvent] = []
        for e in flat:
            batch.append(e)
            if pages_of(batch) >= per_report:
                out.append(fleet.report(k, batch))
                batch = []
        if batch:
            out.append(fleet.report(k, batch))
        k = (k + 1) % fleet.workers
    return out


def split(event: KVEvent, pages: int) -> list[KVEvent]:
    """An event as events of at most `pages` pages, in an order the view applies alike."""
    if isinstance(event, KVStored) and len(event.page_hashes) > pages:
        out, parent = [], event.parent_hash
        for s in range(0, len(event.page_hashes), pages):
            hashes = event.page_hashes[s : s + pages]
            out.append(KVStored(hashes, parent, event.token_ids[s * P : (s + len(hashes)) * P], P))
            parent = hashes[-1]
        return out
    if isinstance(event, KVRemoved) and len(event.page_hashes) > pages:
        h = event.page_hashes
        return [KVRemoved(h[max(0, e - pages) : e]) for e in range(len(h), 0, -pages)]
    return [event]


def ingest(router: Router, reports: list[WorkerReport]) -> dict:
    pages = sum(pages_of(r.events) for r in reports)
    start = time.perf_counter()
    for report in reports:
        router.update(report)
    elapsed = time.perf_counter() - start
    return {"reports": len(reports), "pages": pages, "pages_per_s": pages / elapsed}


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def run_cell(workers: int, sequences: int, mix: EventMix, args: argparse.Namespace) -> dict:
    fleet = SyntheticFleet(workers, args.seed, mix)
    start = time.perf_counter()
    gc.collect()
    gc_before_ms = 1e3 * (time.perf_counter() - start)
    if args.traced:
        tracemalloc.start()
    rss_before = rss_bytes()
    router = Router(RouterConfig(report_timeout_s=1e9), clock=lambda: 0.0)
    start = time.perf_counter()
    sent, update_s = build(router, fleet, sequences)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    gc.collect()  # a full pass over the router's objects: the pause a router process can see
    gc_full_ms = 1e3 * (time.perf_counter() - start) - gc_before_ms  # the router's share
    memory = rss_bytes() - rss_before
    traced = tracemalloc.get_traced_memory()[0] if args.traced else None
    tracemalloc.stop()
    view = router._exact
    assert view is not None
    held = sum(view.num_pages(k) for k in range(workers))
    if router.stats.event_mismatches or held != sent:
        raise RuntimeError(
            f"view holds {held} pages of {sent} sent, {router.stats.event_mismatches} mismatches"
        )
    cell = {
        "workers": workers,
        "sequences": sequences,
        "built": True,
        "pages_held": held,
        "expected_pages": expected_pages(workers, sequences),
        "trie_pages": view.num_nodes,
        "view_bytes": view.memory_bytes(),
        "build_s": build_s,
        "build_pages_per_s": held / update_s,
        "gc_full_ms": gc_full_ms,
        "rss_bytes": memory,
        "memory_bytes": memory if traced is None else traced,
        "memory_measure": "rss" if traced is None else "tracemalloc",
    }
    cell["bytes_per_page"] = cell["memory_bytes"] / held
    cell["decision"] = decision_latency(router, fleet, sequences, args.probes)
    cell["ingest"] = ingest(router, churn_reports(fleet, sequences, args.churn_reports))
    if router.stats.event_mismatches:
        raise RuntimeError(f"churn: {router.stats.event_mismatches} event mismatches")
    if args.check:
        router.check()
    return cell


def predict(workers: int, sequences: int, built: list[dict]) -> dict:
    """An unbuilt cell from the built ones (see the module docstring)."""
    largest = max(built, key=lambda c: c["pages_held"])
    same_n = [c for c in built if c["workers"] == workers] or [
        max(built, key=lambda c: c["workers"])
    ]
    nearest = max(same_n, key=lambda c: c["sequences"])
    pages = expected_pages(workers, sequences)
    return {
        "workers": workers,
        "sequences": sequences,
        "built": False,
        "pages_held": pages,
        "bytes_per_page": largest["bytes_per_page"],
        "memory_bytes": pages * largest["bytes_per_page"],
        "decision": {k: nearest["decision"][k] for k in ("p50_ms", "p99_ms")},
        "ingest": {"pages_per_s": nearest["ingest"]["pages_per_s"]},
        "predicted_from": [
            largest["workers"],
            largest["sequences"],
            nearest["workers"],
            nearest["sequences"],
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for tests")
    parser.add_argument("--max-pages", type=int, default=11_000_000, help="largest cell to build")
    parser.add_argument("--probes", type=int, default=2000)
    parser.add_argument("--churn-reports", type=int, default=20_000)
    parser.add_argument("--traced", action="store_true", help="tracemalloc bytes per page too")
    parser.add_argument("--cells", default="", help="build only these cells, e.g. 16x100,256x10000")
    parser.add_argument("--check", action="store_true", help="Router.check() after each cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    workers_grid, sequences_grid, sessions, pool = (16, 64, 256), (100, 1000, 10_000), 40, 8192
    if args.quick:
        workers_grid, sequences_grid, sessions, pool = (4, 16), (10, 100), 10, 3072
        args.probes, args.churn_reports, args.check, args.traced = 200, 500, True, True
        args.max_pages = min(args.max_pages, 40_000)
    # The engine runs in a process of its own, so that the cells fork one without torch.
    with multiprocessing.get_context("spawn").Pool(1) as engine_pool:
        mix = engine_pool.apply(engine_event_mix, (sessions, pool, args.seed))
    print(
        f"engine event mix over {mix.steps} steps ({mix.reports_with_events} with events): "
        f"stored {mix.stored_pages}, removed {mix.removed_pages} "
        f"({mix.removed_per_stored:.2f} per stored), tombstoned {mix.tombstoned_pages} "
        f"({mix.tombstoned_per_stored:.2f}), revived {mix.revived_pages}; "
        f"{mix.pages_per_report:.1f} pages per report"
    )
    only = {tuple(int(x) for x in cell.split("x")) for cell in args.cells.split(",") if cell}
    cells = []
    for n in workers_grid:
        for s in sequences_grid:
            if (n, s) not in only if only else expected_pages(n, s) > args.max_pages:
                continue
            with multiprocessing.get_context("fork").Pool(1) as pool:  # a fresh heap per cell
                cells.append(pool.apply(run_cell, (n, s, mix, args)))
            print_cell(cells[-1])
    built = list(cells)
    for n in workers_grid:
        for s in sequences_grid:
            if not any(c["workers"] == n and c["sequences"] == s for c in built):
                cells.append(predict(n, s, built))
                print_cell(cells[-1])
    summary = summarize(cells, workers_grid[-1], sequences_grid[-1])
    print(
        f"at {workers_grid[-1]} x {sequences_grid[-1]}: decision p99 {summary['decision_p99_ms']:.3f} ms "
        f"(goal < {DECISION_GOAL_MS}), memory {summary['memory_bytes'] / 1e9:.1f} GB (goal < 8), "
        f"ingest {summary['ingest_pages_per_s']:.0f} pages/s (goal >= 1e5); one router holds "
        f"{summary['pages_per_router']:.3g} pages in 8 GB = {summary['sequences_per_router']:.3g} "
        f"sequences; routers needed: {summary['routers_needed']}"
    )
    if args.json:
        print(json.dumps({"event_mix": mix_json(mix), "cells": cells, "summary": summary}))
    return 0


def summarize(cells: list[dict], workers: int, sequences: int) -> dict:
    target = next(c for c in cells if c["workers"] == workers and c["sequences"] == sequences)
    at_n = [c for c in cells if c["workers"] == workers]
    built = [c for c in cells if c["built"]]
    bytes_per_page = max(built, key=lambda c: c["pages_held"])["bytes_per_page"]
    pages_per_router = MEMORY_GOAL_BYTES / bytes_per_page
    return {
        "decision_p99_ms": max(c["decision"]["p99_ms"] for c in at_n),
        "memory_bytes": target["memory_bytes"],
        "ingest_pages_per_s": min(c["ingest"]["pages_per_s"] for c in cells),
        "bytes_per_page": bytes_per_page,
        "pages_per_router": pages_per_router,
        "sequences_per_router": pages_per_router / MEAN_PAGES_PER_SEQUENCE,
        "routers_needed": -(-target["memory_bytes"] // MEMORY_GOAL_BYTES),
    }


def mix_json(mix: EventMix) -> dict:
    return {
        "steps": mix.steps,
        "reports_with_events": mix.reports_with_events,
        "stored_pages": mix.stored_pages,
        "removed_pages": mix.removed_pages,
        "tombstoned_pages": mix.tombstoned_pages,
        "revived_pages": mix.revived_pages,
        "removed_per_stored": mix.removed_per_stored,
        "tombstoned_per_stored": mix.tombstoned_per_stored,
        "pages_per_report": mix.pages_per_report,
    }


def print_cell(c: dict) -> None:
    tag = "built" if c["built"] else "predicted"
    d = c["decision"]
    print(
        f"{c['workers']:>4} workers x {c['sequences']:>6} seqs ({tag:>9}): {c['pages_held']:>11,} pages, "
        f"{c['bytes_per_page']:6.0f} B/page"
        + (f" (view {c['view_bytes'] / c['pages_held']:.0f})" if "view_bytes" in c else "")
        + f", {c['memory_bytes'] / 1e9:7.2f} GB; decision p50 "
        f"{d['p50_ms']:.3f} p99 {d['p99_ms']:.3f} ms; ingest {c['ingest']['pages_per_s']:,.0f} pages/s"
        + (f"; full GC {c['gc_full_ms']:.0f} ms" if "gc_full_ms" in c else ""),
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
