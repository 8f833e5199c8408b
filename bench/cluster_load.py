"""Multi-turn chat over gRPC against a local cluster (`--replicas`, default 2, × TP 1):
routing policies against a baseline, in the same process (`--policies`, the first is the
baseline; default `round_robin,ttft`, ttft being the router's default; e.g.
`power_of_two,ttft,prefix` sets Ray Serve's default router, power of two choices, against
ours).

Workload (drawn once per seed, replayed for every run): S sessions share a system prompt;
turn 1 of a session is the system prompt + a user message, turn k the prompt of turn k-1 +
its answer (the tokens the model streamed back) + a new user message (1/2 to 3/2 of
`--user-tokens`, token ids). Each turn's answer is 1/2 to 3/2 of `--max-new-tokens` long,
drawn per turn (greedy, `ignore_eos`); `--fixed-answers` makes every answer that long, the
form of the first measurements: then the sessions one worker holds, decoding in one batch,
end their answers in the same step, send their next turns together and stay in step, which
no chat does. N clients (`grpc.aio`, one event loop) each take the next session and send its
turns one after another with its `session_id`: at most N sessions, hence N requests, are in
flight.

That is a closed loop: a policy that saves work gets its clients' next turns sooner, so what it
saves shows mostly as throughput, at about the same contention per worker. `--session-rate R`
makes it an open loop instead: session i starts at a time drawn from a Poisson process of R
sessions per second (from the seed: the same schedule for every policy) and sends its turns
one after another, however many sessions are in flight. The offered load is then the same for
every policy, and what a policy saves shows as latency.

Each run starts its own cluster (cold prefix caches; the workers compile their decode step, or
load it from the inductor cache, before they serve: `multiturn.workers_compile`) and gRPC
server on the one local Ray, sends one warm-up request per worker (tokens no workload prompt
starts with), then the workload, and stops the cluster. Runs alternate the policies for
`--repeats` rounds, so that a busy machine slows them alike; the median of each figure over
the rounds counts.

Per run: generated tokens / s over the run, TTFT p50 / p99 (send → first streamed item with
tokens), cached-token share (Σ usage.cached_tokens / Σ usage.prompt_tokens), wall time;
also "(router)", the share the router predicted (its hit tokens / prompt tokens over the
workload: equal to "cached" when its view of the caches is exact), "same wkr" (of the turns
k >= 2, those served by the worker that served turn k-1), requests per worker, and whether
every answer equals the first run's (greedy: cache hits must not change the tokens).

Read the figures with two effects in mind: round robin keeps a session on its worker by
accident when the clients move in step (4 clients on 2 workers: 0.6-0.8 of the turns; 5, the
default: 0.5-0.8; see "same wkr"), so its median turn is a hit too; and with
`--fixed-answers` the turns of the sessions one worker holds arrive together, so their
prefills share steps and each first token waits for all of them.

    python bench/cluster_load.py [--json] [--policies round_robin,ttft] [--sessions 10]
        [--turns 6] [--concurrency 5 | --session-rate R] [--max-new-tokens 16] [--fixed-answers]
        [--repeats 3] [--hidden 256] [--layers 4] [--window 32] [--router-config JSON]
        [--engine-config JSON] ...

Each run also prints where the time to first token went (`RoutedCluster.breakdowns`): the
router's answer, the engine's queue, the prefill, the way to the engine and back (and of it,
the wait for the step under way), the steps a prefill took with the decode rows and prompt
tokens they carried, and what held requests at admission; then the TTFT p50 of its requests
by the prompt tokens they computed (a user message: a turn that found its history; up to one
turn more; more) and the CPU per request of the engines, the router and this process (the
gRPC server and the clients). The end of the output compares those like for like (medians of
the rounds): in a closed loop a policy that saves work gets its clients' next turns sooner,
so its engines are busier and a request of one size waits longer than the baseline's of the
same size; what it saves per request shows in the CPU figures.

`--simulate` then fits bench/cluster_sim.py to the runs (the engines' step logs and the
measured hops), replays the same workload and policies on it, and prints its TTFT p50 / p99
and throughput next to the measured medians, with their errors; `--json` carries the
calibration, which `bench/cluster_sim.py --calibration` replays with other policies or
router knobs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import resource
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import grpc
from cluster_predict import predict, prediction_errors, print_predictions
from multiturn import (
    answer_lengths,
    answers_text,
    local_ray,
    make_model,
    medians,
    parse_variants,
    parse_workload_args,
    percentile,
    ratios_to,
    round_ratios,
    round_ratios_text,
    workers_compile,
    workload_parser,
)
from sim_calibration import hops_of

from swaserve.cluster.cluster import Cluster, ClusterConfig
from swaserve.cluster.grpc_server import GrpcServer, GrpcServerConfig
from swaserve.cluster.routed import TTFTBreakdown
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc
from swaserve.router import POLICIES, RouterConfig
from swaserve.worker import EngineConfig
from swaserve.worker.engine.stats import StepRecord

DEFAULT_POLICIES = ("round_robin", "ttft")  # the first: the baseline
WORKLOAD_TOKENS = range(1, 256)  # byte tokens of the tiny tokenizer; warm-ups use 0 only
RPC_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Workload:
    system: list[int]
    users: list[list[list[int]]]  # [session][turn] -> the new user tokens of that turn
    answers: list[list[int]]  # [session][turn] -> that turn's max_new_tokens (its answer's length)
    arrivals: tuple[float, ...] | None = None  # open loop: each session's start, s after the first

    @property
    def num_requests(self) -> int:
        return sum(len(turns) for turns in self.users)

    @property
    def prompt_tokens(self) -> int:
        """Σ prompt tokens of all requests: turn k adds its user tokens and k-1's answer."""
        total = 0
        for turns, answers in zip(self.users, self.answers, strict=True):
            length = len(self.system)
            for k, user in enumerate(turns):
                length += len(user) + (answers[k - 1] if k else 0)
                total += length
        return total


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    low, high = max(1, args.user_tokens // 2), args.user_tokens + args.user_tokens // 2
    system = rng.choices(WORKLOAD_TOKENS, k=args.system_tokens)
    users = [
        [rng.choices(WORKLOAD_TOKENS, k=rng.randint(low, high)) for _ in range(args.turns)]
        for _ in range(args.sessions)
    ]
    answers = answer_lengths(
        args.seed, args.sessions, args.turns, args.max_new_tokens, args.fixed_answers
    )
    arrivals = None
    if args.session_rate is not None:  # a Poisson process, drawn after (and apart from) the text
        gaps = random.Random(f"arrivals-{args.seed}")
        starts = itertools.accumulate(gaps.expovariate(args.session_rate) for _ in users[1:])
        arrivals = (0.0, *starts)
    return Workload(system, users, answers, arrivals)


@dataclass(frozen=True, slots=True)
class TurnResult:
    session: int
    turn: int
    request_id: str
    prompt_tokens: int  # usage.prompt_tokens
    cached_tokens: int  # usage.cached_tokens
    answer: tuple[int, ...]
    finish_reason: str
    worker_id: str
    ttft_s: float
    latency_s: float


def sampling(max_new_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


async def send(
    stub: pb_grpc.InferenceStub,
    prompt: list[int],
    session_id: str,
    max_new_tokens: int,
    request_id: str = "",
) -> tuple[list[int], pb.GenerateResponse, float, float]:
    """One Generate stream: the answer, the last item, TTFT and end-to-end seconds."""
    request = pb.GenerateRequest(
        request_id=request_id,
        token_ids=prompt,
        session_id=session_id,
        sampling_params=sampling(max_new_tokens),
    )
    start = time.perf_counter()
    first_s: float | None = None
    answer: list[int] = []
    last: pb.GenerateResponse | None = None
    async for item in stub.Generate(request, timeout=RPC_TIMEOUT_S):
        if item.token_ids and first_s is None:
            first_s = time.perf_counter() - start
        answer.extend(item.token_ids)
        last = item
    if last is None or first_s is None:
        raise RuntimeError(f"session {session_id}: the stream ended without tokens")
    return answer, last, first_s, time.perf_counter() - start


async def session(
    stub: pb_grpc.InferenceStub, work: Workload, i: int, out: list[TurnResult]
) -> None:
    """Session `i`'s turns, each sent once the previous one's answer is in."""
    prompt = list(work.system)
    for k, user in enumerate(work.users[i]):
        prompt += user
        request_id = f"s{i}-t{k}"
        answer, last, ttft_s, latency_s = await send(
            stub, prompt, f"session-{i}", work.answers[i][k], request_id
        )
        out.append(
            TurnResult(
                i,
                k,
                request_id,
                last.usage.prompt_tokens,
                last.usage.cached_tokens,
                tuple(answer),
                last.finish_reason,
                last.worker_id,
                ttft_s,
                latency_s,
            )
        )
        prompt += answer


async def client(
    stub: pb_grpc.InferenceStub, work: Workload, sessions: list[int], out: list[TurnResult]
) -> None:
    """Take sessions from `sessions` (shared by the clients) until none is left."""
    while sessions:
        await session(stub, work, sessions.pop(0), out)


async def arriving(
    stub: pb_grpc.InferenceStub, work: Workload, i: int, at: float, out: list[TurnResult]
) -> None:
    """Session `i` from `at` (`time.perf_counter()`) on: an open-loop arrival."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    await session(stub, work, i, out)


async def warm_up(stub: pb_grpc.InferenceStub, replicas: int) -> None:
    """One request per worker, sent together (no cache holds their prompts yet, so every
    policy spreads them over the workers); their tokens (0) start no workload prompt."""
    await asyncio.gather(*(send(stub, [0] * 16 + [i], f"warmup-{i}", 4) for i in range(replicas)))


async def drive(
    stub: pb_grpc.InferenceStub, work: Workload, concurrency: int
) -> tuple[list[TurnResult], float]:
    """The workload on `concurrency` clients, or (`work.arrivals`) each session from its
    arrival time on, however many are in flight: its results and wall seconds."""
    results: list[TurnResult] = []
    sessions = list(range(len(work.users)))
    start = time.perf_counter()
    if work.arrivals is not None:
        starts = (start + t for t in work.arrivals)
        await asyncio.gather(*(arriving(stub, work, i, at, results) for i, at in enumerate(starts)))
    else:
        await asyncio.gather(*(client(stub, work, sessions, results) for _ in range(concurrency)))
    return results, time.perf_counter() - start


async def run_policy(
    policy: str, model_dir: str, work: Workload, args: argparse.Namespace
) -> tuple[
    list[TurnResult],
    float,
    dict[str, int],
    list[TTFTBreakdown],
    dict[str, list[StepRecord]],
    dict[str, float] | None,
]:
    """A fresh cluster and server for one run, both stopped whatever happens; the results,
    the wall seconds, the router's counters over the workload (warm-up excluded), and where
    each workload request's time to first token went (`RoutedCluster.breakdowns`), its
    engines' steps, and the CPU per request of the engines, the router and this process."""
    config = ClusterConfig(
        engine=EngineConfig(
            model=model_dir,
            device="cpu",
            max_total_tokens=args.max_total_tokens,
            seed=0,
            compile=workers_compile(),
            **args.engine_config,
        ),
        router=RouterConfig(
            policy=policy,
            **(args.router_config if policy != args.policies[0] else {}),
        ),
        replicas=args.replicas,
        report_interval_s=0.1,
    )
    cluster = await Cluster.start(config)
    try:
        server = GrpcServer(cluster, GrpcServerConfig(port=0))
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.InferenceStub(channel)
                await warm_up(stub, args.replicas)
                before = await cluster.router_stats()
                cluster.breakdowns.clear()
                await take_step_logs(cluster)  # the warm-up's steps
                pids = await cpu_pids(cluster)
                cpu_before = cpu_seconds(pids)
                results, wall_s = await drive(stub, work, args.concurrency)
                cpu = cpu_per_request(cpu_before, cpu_seconds(pids), len(results))
                after = await cluster.router_stats()
                breakdowns = list(cluster.breakdowns)
                steps = await take_step_logs(cluster)
        finally:
            await server.stop(0)
    finally:
        await cluster.shutdown(timeout_s=10)
    queued = f"{policy}/queued"
    router = {
        "prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"],
        "predicted_hit_tokens": after["predicted_hit_tokens"] - before["predicted_hit_tokens"],
        "queued": after["decisions"].get(queued, 0) - before["decisions"].get(queued, 0),
    }
    return results, wall_s, router, breakdowns, steps, cpu


async def take_step_logs(cluster: Cluster) -> dict[str, list[StepRecord]]:
    """Each worker's engine steps since the last call (`Engine.step_log`)."""
    ids = sorted(cluster.groups)
    logs = await asyncio.gather(*(cluster.groups[w].engine.take_step_log.remote() for w in ids))
    return {w: [StepRecord(*r) for r in log] for w, log in zip(ids, logs, strict=True)}


def ttft_parts(breakdowns: list[TTFTBreakdown]) -> dict:
    """Where the time to first token went, over a run's requests: the router's answer, the
    engine's queue, the prefill steps (ms, p50 and p99), the steps a prefill took and the
    decode rows and prompt tokens those steps carried (means), and what held requests at
    admission (counts; "" is admitted at once)."""
    timed = [b.worker for b in breakdowns if b.worker is not None]

    def ms(values: list[float]) -> dict[str, float]:
        scaled = [1e3 * v for v in values]
        return {"p50": percentile(scaled, 0.50), "p99": percentile(scaled, 0.99)}

    def mean(values: list[int]) -> float:
        return sum(values) / max(len(values), 1)

    return {
        "route_ms": ms([b.route_s for b in breakdowns]),
        "engine_queue_ms": ms([t.queued_s for t in timed]),
        "prefill_ms": ms([t.prefill_s for t in timed]),
        "transport_ms": ms([b.transport_s for b in breakdowns if b.transport_s is not None]),
        "loop_wait_ms": ms([t.loop_wait_s for t in timed]),
        "prefill_steps": mean([t.prefill_steps for t in timed]),
        "decode_rows_per_prefill_step": sum(t.step_decodes for t in timed)
        / max(sum(t.prefill_steps for t in timed), 1),
        "prompt_tokens_per_prefill_step": sum(t.step_prefill_tokens for t in timed)
        / max(sum(t.prefill_steps for t in timed), 1),
        "held_by": dict(sorted(Counter(t.held_by for t in timed).items())),
    }


def size_classes(args: argparse.Namespace) -> tuple[tuple[str, int], ...]:
    """The upper bounds of `ttft_by_size`'s classes of computed prompt tokens: what a turn
    that found its history computes at most (its user message, and the last token of the
    answer before it), then what one that missed one turn of it computes at most."""
    message = args.user_tokens + args.user_tokens // 2
    answer = args.max_new_tokens + args.max_new_tokens // 2
    return (("a message", message + 1), ("+1 turn", 2 * message + answer + 1))


def ttft_by_size(results: list[TurnResult], classes: tuple[tuple[str, int], ...]) -> dict:
    """TTFT p50 (ms) and count of the requests by the prompt tokens they computed (not
    cached), in `size_classes`' classes and above the last: requests of one size compare
    like for like across policies. In a closed loop a policy that saves work gets its
    clients' next turns sooner, so its engines run busier and its requests of a size wait
    longer than the baseline's of the same size."""
    groups: dict[str, list[float]] = {name: [] for name, _ in classes}
    groups["more"] = []
    for r in results:
        computed = r.prompt_tokens - r.cached_tokens
        name = next((name for name, bound in classes if computed <= bound), "more")
        groups[name].append(1e3 * r.ttft_s)
    return {
        name: {"requests": len(ms), "p50_ms": percentile(ms, 0.50) if ms else None}
        for name, ms in groups.items()
    }


async def cpu_pids(cluster: Cluster) -> dict[str, list[int]]:
    """The processes whose CPU `cpu_seconds` reads: each worker's engine (TP rank 0) and the
    router; "ingress and clients" is this process (the gRPC server and the load's clients)."""
    ids = sorted(cluster.groups)
    engines = await asyncio.gather(*(cluster.groups[w].engine.pid.remote() for w in ids))
    return {"engines": list(engines), "router": [await cluster.router.pid.remote()]}


def cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float] | None:
    """CPU seconds (user + system) each group of processes has used so far; None where
    /proc does not say (not Linux)."""
    tick = os.sysconf("SC_CLK_TCK")

    def used(pid: int) -> float:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    try:
        out = {name: sum(used(p) for p in group) for name, group in pids.items()}
    except OSError:
        return None
    own = resource.getrusage(resource.RUSAGE_SELF)
    return out | {"ingress and clients": own.ru_utime + own.ru_stime}


def cpu_per_request(
    before: dict[str, float] | None, after: dict[str, float] | None, requests: int
) -> dict[str, float] | None:
    """CPU ms per workload request of each group, between two `cpu_seconds`."""
    if before is None or after is None:
        return None
    return {name: 1e3 * (after[name] - before[name]) / max(requests, 1) for name in before}


def metrics(
    results: list[TurnResult],
    wall_s: float,
    router: dict[str, int],
    reference: dict | None,
    breakdowns: list[TTFTBreakdown],
    classes: tuple[tuple[str, int], ...],
    cpu: dict[str, float] | None,
) -> dict:
    """The figures of one run; `router`: the router's counters over it; `reference`:
    (session, turn) -> answer of the first run."""
    by_turn = {(r.session, r.turn): r for r in results}
    followups = [r for r in results if r.turn > 0]
    same = sum(r.worker_id == by_turn[r.session, r.turn - 1].worker_id for r in followups)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    generated = sum(len(r.answer) for r in results)
    ttft_ms = [1e3 * r.ttft_s for r in results]
    agree = (
        sum(reference.get(key) == r.answer for key, r in by_turn.items()) / len(by_turn)
        if reference is not None
        else 1.0
    )
    return {
        "requests": len(results),
        "finished": sum(r.finish_reason == "length" for r in results),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r.cached_tokens for r in results),
        "generated_tokens": generated,
        "cached_share": sum(r.cached_tokens for r in results) / max(prompt_tokens, 1),
        "tok_s": generated / wall_s,
        "ttft_p50_ms": percentile(ttft_ms, 0.50),
        "ttft_p99_ms": percentile(ttft_ms, 0.99),
        "latency_p50_ms": percentile([1e3 * r.latency_s for r in results], 0.50),
        "wall_s": wall_s,
        "same_worker_share": same / max(len(followups), 1),
        "router_predicted_share": router["predicted_hit_tokens"] / max(router["prompt_tokens"], 1),
        "router_queued": router["queued"],
        "requests_per_worker": dict(sorted(Counter(r.worker_id for r in results).items())),
        "answers_equal_first_run": agree,
        "ttft_parts": ttft_parts(breakdowns),
        "ttft_by_size": ttft_by_size(results, classes),
        "cpu_ms_per_request": cpu,
    }


async def run_all(model_dir: str, work: Workload, args: argparse.Namespace) -> list[dict]:
    runs: list[dict] = []
    reference: dict | None = None
    print(HEADER, flush=True)
    for round_ in range(args.repeats):
        for policy in args.policies:
            results, wall_s, router, breakdowns, steps, cpu = await run_policy(
                policy, model_dir, work, args
            )
            m = metrics(results, wall_s, router, reference, breakdowns, size_classes(args), cpu)
            if reference is None:
                reference = {(r.session, r.turn): r.answer for r in results}
            hops = hops_of({r.request_id: r.ttft_s for r in results}, breakdowns)
            answers = {(r.session, r.turn): r.answer for r in results}
            runs.append(
                {"round": round_ + 1, "policy": policy, **m}
                | {"steps": steps, "hops": hops, "answers": answers}
            )
            print_row(runs[-1])
    return runs


HEADER = (
    f"{'round':>5} {'policy':<12} {'wall s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
    f"{'cached':>7} {'(router)':>8} {'same wkr':>8} {'done':>5}  requests per worker"
)


def print_row(run: dict) -> None:
    per_worker = " ".join(str(n) for n in run["requests_per_worker"].values())
    print(
        f"{run['round']!s:>5} {run['policy']:<12} {run['wall_s']:>7.2f} {run['tok_s']:>7.1f} "
        f"{run['ttft_p50_ms']:>7.0f}ms {run['ttft_p99_ms']:>7.0f}ms "
        f"{run['cached_share']:>7.3f} {run['router_predicted_share']:>8.3f} "
        f"{run['same_worker_share']:>8.2f} {run['finished']:>5}  {per_worker}",
        flush=True,
    )
    parts = run["ttft_parts"]
    held = ", ".join(f"{k or 'at once'} {v}" for k, v in parts["held_by"].items())
    print(
        f"{'':>5} TTFT parts p50/p99: route {parts['route_ms']['p50']:.0f}/"
        f"{parts['route_ms']['p99']:.0f} ms, engine queue {parts['engine_queue_ms']['p50']:.0f}/"
        f"{parts['engine_queue_ms']['p99']:.0f} ms, prefill {parts['prefill_ms']['p50']:.0f}/"
        f"{parts['prefill_ms']['p99']:.0f} ms, transport {parts['transport_ms']['p50']:.0f}/"
        f"{parts['transport_ms']['p99']:.0f} ms (of which the step under way "
        f"{parts['loop_wait_ms']['p50']:.0f}/{parts['loop_wait_ms']['p99']:.0f} ms); "
        f"{parts['prefill_steps']:.1f} steps per prefill "
        f"with {parts['decode_rows_per_prefill_step']:.1f} decode rows and "
        f"{parts['prompt_tokens_per_prefill_step']:.0f} prompt tokens each; admitted: {held}",
        flush=True,
    )
    sizes = ", ".join(
        f"{name}: {c['p50_ms']:.0f} ms ({c['requests']})"
        for name, c in run["ttft_by_size"].items()
        if c["requests"]
    )
    cpu = run["cpu_ms_per_request"]
    cpu_text = (
        ""
        if cpu is None
        else "; CPU per request: " + ", ".join(f"{k} {v:.1f} ms" for k, v in cpu.items())
    )
    print(f"{'':>5} TTFT p50 by computed prompt tokens: {sizes}{cpu_text}", flush=True)


def like_for_like(runs: list[dict], policies: tuple[str, ...]) -> dict[str, dict]:
    """Per policy, the median over its rounds of each size class's TTFT p50 (`ttft_by_size`,
    rounds without requests of the class left out) and of each CPU figure per request."""
    out: dict[str, dict] = {}
    for policy in policies:
        mine = [r for r in runs if r["policy"] == policy]
        sizes = [r["ttft_by_size"] for r in mine]
        cpus = [r["cpu_ms_per_request"] for r in mine if r["cpu_ms_per_request"] is not None]
        p50s = {
            name: [s[name]["p50_ms"] for s in sizes if s[name]["requests"]] for name in sizes[0]
        }
        out[policy] = {
            "ttft_p50_ms_by_size": {
                k: statistics.median(v) if v else None for k, v in p50s.items()
            },
            "requests_by_size": {k: sum(s[k]["requests"] for s in sizes) for k in sizes[0]},
            "cpu_ms_per_request": (
                {k: statistics.median(c[k] for c in cpus) for k in cpus[0]} if cpus else None
            ),
        }
    return out


def print_like_for_like(alike: dict[str, dict], baseline: str) -> None:
    base = alike[baseline]
    for policy, mine in alike.items():
        if policy == baseline:
            continue
        sizes = []
        for name, ms in mine["ttft_p50_ms_by_size"].items():
            theirs = base["ttft_p50_ms_by_size"][name]
            if ms is None or theirs is None:
                continue
            n, m = mine["requests_by_size"][name], base["requests_by_size"][name]
            sizes.append(f"{name} {ms:.0f} / {theirs:.0f} ms ({n} / {m} requests)")
        print(
            f"like for like, {policy} / {baseline}, TTFT p50 by computed prompt tokens: "
            + ", ".join(sizes)
        )
        if mine["cpu_ms_per_request"] is not None and base["cpu_ms_per_request"] is not None:
            cpu = ", ".join(
                f"{k} {v:.1f} / {base['cpu_ms_per_request'][k]:.1f}"
                for k, v in mine["cpu_ms_per_request"].items()
            )
            print(f"  CPU ms per request, {policy} / {baseline}: {cpu}")


def summarize(runs: list[dict], policies: tuple[str, ...]) -> dict[str, dict]:
    """Per policy, the median over its rounds of each figure."""
    keys = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "cached_share", "wall_s", "same_worker_share")
    return medians(runs, "policy", policies, keys)


def parse_policies(text: str) -> tuple[str, ...]:
    return tuple(parse_variants(text, POLICIES, "policy", "policies"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = workload_parser(__doc__, tokens_flag="--max-new-tokens", tokens_help="per turn")
    parser.add_argument(
        "--policies",
        type=parse_policies,
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated routing policies, the first the baseline (default: %(default)s)",
    )
    parser.add_argument(
        "--router-config",
        type=json.loads,
        default={},
        help="RouterConfig fields for every policy but the baseline, as JSON: "
        "'{\"prefix_load_weight\": 0.5}'",
    )
    parser.add_argument(
        "--engine-config",
        type=json.loads,
        default={},
        help="EngineConfig fields for every run, as JSON: '{\"stream_interval_ms\": 0}'",
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="fit bench/cluster_sim.py to these runs and print its predictions beside them",
    )
    parser.add_argument("--sim-repeats", type=int, default=5, help="simulations per policy")
    parser.add_argument(
        "--session-rate",
        type=float,
        default=None,
        help="open loop: sessions start at this rate (per s, Poisson, drawn from --seed) "
        "however many are in flight, instead of --concurrency clients taking them in turn",
    )
    args = parse_workload_args(parser, argv, tokens_dest="max_new_tokens", min_system=0)
    if args.session_rate is not None:
        if not args.session_rate > 0:
            parser.error("--session-rate must be above 0")
        if args.simulate:
            parser.error("--simulate replays the closed loop (--concurrency), not --session-rate")
    return args


def run_on_ray(work: Workload, args: argparse.Namespace) -> tuple[list[dict], dict | None]:
    """Every run, on a local Ray started here (and shut down) unless one is up already; with
    `--simulate`, then the simulator's predictions (`predict`)."""
    with local_ray(num_cpus=max(8, args.replicas + 4)), tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_model(tmp, args))
        runs = asyncio.run(run_all(model_dir, work, args))
        predicted = predict(runs, model_dir, work, args) if args.simulate else None
    for run in runs:  # the calibration's inputs; too long to print
        for key in ("steps", "hops", "answers"):
            run.pop(key)
    return runs, predicted


def clients_of(args: argparse.Namespace) -> str:
    if args.session_rate is None:
        return f"{args.concurrency} clients"
    return f"open loop: {args.session_rate:g} sessions/s"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = make_workload(args)
    load_before = os.getloadavg()[0]
    print(
        f"cluster_load: {args.replicas} replicas × TP 1 (CPU), {args.sessions} sessions × "
        f"{args.turns} turns, {clients_of(args)}, system prompt {args.system_tokens} "
        f"tokens, user ~{args.user_tokens}, answers "
        f"{answers_text(args.max_new_tokens, args.fixed_answers)}; model hidden "
        f"{args.hidden}, {args.layers} layers, W = {args.window}; {work.prompt_tokens} prompt "
        f"tokens per run (load average {load_before:.2f})"
    )
    runs, predicted = run_on_ray(work, args)
    load_after = os.getloadavg()[0]
    median = summarize(runs, args.policies)
    baseline = args.policies[0]
    ratios = {p: ratios_to(median[baseline], median[p]) for p in args.policies[1:]}
    spreads = {p: round_ratios(runs, "policy", baseline, p) for p in args.policies[1:]}
    agree = min(r["answers_equal_first_run"] for r in runs)
    for policy, ratio in ratios.items():
        print(
            f"median of {args.repeats}: {policy} / {baseline}: throughput {ratio['tok_s']:.2f}x, "
            f"TTFT p50 {ratio['ttft_p50']:.2f}x, p99 {ratio['ttft_p99']:.2f}x, wall "
            f"{ratio['wall']:.2f}x; cached share {median[policy]['cached_share']:.3f} vs "
            f"{median[baseline]['cached_share']:.3f}; {round_ratios_text(spreads[policy])}"
        )
    alike = like_for_like(runs, args.policies)
    print_like_for_like(alike, baseline)
    print(
        f"answers equal to the first run's: {agree:.0%} of requests in the worst run (load "
        f"average {load_before:.2f} before, {load_after:.2f} after)"
    )
    if predicted is not None:
        print_predictions(median, predicted)
    if args.json:
        report = {
            "replicas": args.replicas,
            "policies": list(args.policies),
            "sessions": args.sessions,
            "turns": args.turns,
            "concurrency": args.concurrency,
            "session_rate": args.session_rate,
            "max_new_tokens": args.max_new_tokens,
            "fixed_answers": args.fixed_answers,
            "repeats": args.repeats,
            "workload_requests": work.num_requests,
            "workload_prompt_tokens": work.prompt_tokens,
            "workload_answer_tokens": sum(map(sum, work.answers)),
            "load_average_before": load_before,
            "load_average_after": load_after,
            "median": median,
            "ratios": ratios,
            "round_ratios": spreads,
            "like_for_like": alike,
            "answers_equal_first_run": agree,
            "runs": runs,
        }
        if predicted is not None:
            report |= {
                "predicted": predicted["policies"],
                "prediction_error": prediction_errors(median, predicted),
                "calibration": predicted["calibration"],
                "step_cost_error": predicted["step_cost_error"],
                "step_logs": predicted["step_logs"],
                "workload": predicted["workload"],
                "model": {"layers": args.layers, "window": args.window, "hidden": args.hidden},
                "max_total_tokens": args.max_total_tokens,
            }
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
