"""Multi-turn chat over the OpenAI API against the Ray Serve app (`swaserve.cluster.serve`,
`--replicas` worker replicas, default 2, × TP 1): the routings of `--routings` (the last the
candidate) in the same process; by default swaserve's router with its default policy
placing the requests (`routing="swaserve"`) against the same router's round robin
(`router_policy="round_robin"`, the baseline of bench/cluster_load.py) and against Serve's
default power-of-two routing (`routing="serve"`).

Workload (drawn once per seed, replayed for every run): S sessions share a system message;
turn k of a session sends the messages of turns 1..k-1, each followed by the assistant's
answer as streamed back, plus a new user message (random lowercase words, 1/2 to 3/2 of
`--user-tokens` characters; the tiny model's tokenizer has one token per byte), so that each
prompt extends the previous one through the chat template. N clients (the stock `openai`
AsyncOpenAI, one event loop) each take the next session and send its turns one after another
(`stream=True`, `stream_options={"include_usage": True}`, `user=<session id>`, greedy,
`ignore_eos`, `max_tokens` drawn per turn from 1/2 to 3/2 of `--max-tokens`, or that many with
`--fixed-answers`, as in bench/cluster_load.py): at most N requests are in flight.

Each run deploys the app fresh as its own Serve application (cold prefix caches, the decode
step compiled before serving as in bench/cluster_load.py; its own name and route prefix,
deleted after the run) on one Serve instance, sends one warm-up request per worker (a system
message no workload prompt shares beyond the template's first 2 tokens), then the workload.
Runs alternate the routings (by default round_robin, serve, swaserve) for `--repeats` rounds, so that
a busy machine slows them alike; the median of each figure over the rounds counts, and the
candidate's ratio to each other routing is printed.

Per run: completion tokens / s over the run, TTFT p50 / p99 (send → first chunk with a
content delta), cached-token share (Σ usage.prompt_tokens_details.cached_tokens / Σ
usage.prompt_tokens), wall time; also "hist hit" (of the turns k >= 2, those whose cached
tokens cover all of turn k-1's prompt: they found the session's history, in effect on the
worker that served turn k-1), requests per worker (the app's /metrics: the ingress's
end-to-end latency count per worker, warm-up excluded) and whether every answer equals the
first run's (greedy: neither cache hits nor the worker may change the text). Below each run,
where the first tokens went, as means per request: the client's TTFT, the ingress's (from the
request's arrival there: the rest is Serve's HTTP proxy and the client), and its parts from
/metrics (`swaserve:request_{route,queue,prefill,transport}_time_seconds`; "before routing" is
the chat template and the tokenizer).

Read the figures with two effects in mind: Serve's power-of-two routing takes the less loaded
of two replicas drawn at random for every request, and in a closed loop the replica that just finished a
session's turn is often the less loaded one when that session's next turn comes, so it keeps
more of a session's turns together than round robin does by chance (see "hist hit"); it
balances the requests, which sticky sessions do not (see "requests per worker"). Round robin
and swaserve pay the same hop to the router; Serve's routing does not take it. And the tiny random model's answers are
random bytes, mostly invalid UTF-8: they come back as U+FFFD, which the next turn's prompt
encodes as 3 other bytes, so an answer's own KV is seldom reused, only the history before it
(a real model's text round-trips).

    python bench/serve_load.py [--json] [--sessions 10] [--turns 6] [--concurrency 5]
        [--max-tokens 16] [--fixed-answers] [--repeats 3] [--app-config JSON]
        [--routings round_robin,serve,swaserve] [--hidden 256] [--layers 4] [--window 32] ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import string
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
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
from openai.types import CompletionUsage
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from swaserve.cluster.metrics import TTFT_PARTS
from swaserve.cluster.serve import build_app
from swaserve.router import POLICIES

SERVE, SWASERVE = "serve", "swaserve"
DEFAULT_ROUTINGS = ("round_robin", SERVE, SWASERVE)
REQUEST_TIMEOUT_S = 600.0
E2E_COUNT = "swaserve:e2e_request_latency_seconds_count"
MODEL_NAME = "tiny-gpt-oss"  # the model dir in the temp dir; the app serves it by this name


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    system: str
    users: list[list[str]]  # [session][turn] -> the new user message of that turn
    answers: list[list[int]]  # [session][turn] -> that turn's max_tokens (its answer's length)

    @property
    def num_requests(self) -> int:
        return sum(len(turns) for turns in self.users)


def words(rng: random.Random, num_chars: int) -> str:
    """Random lowercase words, `num_chars` characters (one token each for the tiny model)."""
    out = ""
    while len(out) < num_chars:
        out += "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) + " "
    return out[:num_chars]


def make_workload(args: argparse.Namespace) -> ChatWorkload:
    rng = random.Random(args.seed)
    low, high = max(1, args.user_tokens // 2), args.user_tokens + args.user_tokens // 2
    return ChatWorkload(
        system=words(rng, args.system_tokens),
        users=[
            [words(rng, rng.randint(low, high)) for _ in range(args.turns)]
            for _ in range(args.sessions)
        ],
        answers=answer_lengths(
            args.seed, args.sessions, args.turns, args.max_tokens, args.fixed_answers
        ),
    )


@dataclass(frozen=True, slots=True)
class TurnResult:
    session: int
    turn: int
    prompt_tokens: int  # usage.prompt_tokens
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens
    completion_tokens: int  # usage.completion_tokens
    answer: str
    finish_reason: str | None
    ttft_s: float
    latency_s: float


async def send(
    client: openai.AsyncOpenAI, messages: list[dict[str, str]], user: str, max_tokens: int
) -> tuple[str, CompletionUsage, str | None, float, float]:
    """One streamed chat completion: the answer, the usage, the finish reason, TTFT and
    end-to-end seconds."""
    start = time.perf_counter()
    first_s: float | None = None
    parts: list[str] = []
    usage, finish_reason = None, None
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        user=user,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content is not None:
                if first_s is None:
                    first_s = time.perf_counter() - start
                parts.append(choice.delta.content)
            finish_reason = choice.finish_reason or finish_reason
    if usage is None or first_s is None:
        raise RuntimeError(f"{user}: the stream ended without content or usage")
    return "".join(parts), usage, finish_reason, first_s, time.perf_counter() - start


async def client_loop(
    client: openai.AsyncOpenAI, work: ChatWorkload, sessions: list[int], out: list[TurnResult]
) -> None:
    """Take sessions from `sessions` (shared by the clients) until none is left."""
    while sessions:
        i = sessions.pop(0)
        messages = [{"role": "system", "content": work.system}]
        for k, user in enumerate(work.users[i]):
            messages.append({"role": "user", "content": user})
            answer, usage, reason, ttft_s, latency_s = await send(
                client, messages, f"session-{i}", work.answers[i][k]
            )
            details = usage.prompt_tokens_details
            out.append(
                TurnResult(
                    i,
                    k,
                    usage.prompt_tokens,
                    details.cached_tokens if details is not None else 0,
                    usage.completion_tokens,
                    answer,
                    reason,
                    ttft_s,
                    latency_s,
                )
            )
            messages.append({"role": "assistant", "content": answer})


async def warm_up(client: openai.AsyncOpenAI, replicas: int) -> None:
    """One request per worker, sent together; their system message ("warm-up", with capitals
    and a dash) starts no workload prompt beyond the template's first tokens."""
    await asyncio.gather(
        *(
            send(client, [{"role": "system", "content": f"Warm-up {i}"}], f"warmup-{i}", 4)
            for i in range(replicas)
        )
    )


async def drive(
    client: openai.AsyncOpenAI, work: ChatWorkload, concurrency: int
) -> tuple[list[TurnResult], float]:
    """The workload on `concurrency` clients: its results and wall seconds."""
    results: list[TurnResult] = []
    sessions = list(range(len(work.users)))
    start = time.perf_counter()
    await asyncio.gather(
        *(client_loop(client, work, sessions, results) for _ in range(concurrency))
    )
    return results, time.perf_counter() - start


TTFT = "swaserve:time_to_first_token_seconds"
Scrape = tuple[dict[str, float], dict[str, float]]  # requests per worker, histogram totals


def scrape(base_url: str) -> Scrape:
    """The app's /metrics: requests its ingress saw end, per worker, and each histogram's
    `_sum` and `_count` summed over its labels."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    per_worker: dict[str, float] = {}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == E2E_COUNT:
                worker = sample.labels.get("worker", "")
                per_worker[worker] = per_worker.get(worker, 0.0) + sample.value
            if sample.name.endswith(("_sum", "_count")):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return per_worker, totals


def ttft_parts(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds per request between two scrapes: the ingress's time to first token
    (from the request's arrival) and its parts from asking the router (`route`, the engine's
    `queue`, `prefill`, `transport`); `before_route` is what the ingress did first (the chat
    template, tokenizing), about: a retried request's parts are its last attempt's. One ingress
    replica's view (the app's default). Empty where no request had its parts."""

    def mean_ms(name: str) -> float | None:
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if count <= 0:
            return None
        return 1e3 * (after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / count

    means = {"ingress": mean_ms(TTFT)}
    means |= {part: mean_ms(f"swaserve:request_{part}_time_seconds") for part in TTFT_PARTS}
    out = {name: mean for name, mean in means.items() if mean is not None}
    if len(out) < len(means):
        return {}
    out["before_route"] = out["ingress"] - sum(out[part] for part in TTFT_PARTS)
    return out


def routing_args(routing: str) -> dict[str, str]:
    """The Serve app's arguments for one of `--routings`: `serve` (Serve's power-of-two),
    `swaserve` (swaserve's router, its default policy or --app-config's `router_policy`), or
    a router policy's name (swaserve's router with that policy)."""
    if routing in (SERVE, SWASERVE):
        return {"routing": routing}
    return {"routing": SWASERVE, "router_policy": routing}


def run_routing(
    routing: str,
    app_name: str,
    http_port: int,
    model_dir: str,
    work: ChatWorkload,
    args: argparse.Namespace,
) -> tuple[list[TurnResult], float, dict[str, int], dict[str, float]]:
    """A fresh Serve application for one run, deleted whatever happens; the results, the wall
    seconds, the requests per worker and the TTFT parts (`ttft_parts`) over the workload
    (warm-up excluded)."""
    app_args = {
        "model": model_dir,
        "tp_size": 1,
        "device": "cpu",
        "max_total_tokens": args.max_total_tokens,
        "seed": 0,
        "compile": workers_compile(),
        **args.app_config,
        **routing_args(routing),
        "replicas": args.replicas,  # --app-config's would not reach the warm-up and the report
    }
    serve.run(build_app(app_args), name=app_name, route_prefix=f"/{app_name}")
    try:
        base_url = f"http://127.0.0.1:{http_port}/{app_name}"

        async def go() -> tuple[list[TurnResult], float, Scrape, Scrape]:
            client = openai.AsyncOpenAI(
                base_url=f"{base_url}/v1",
                api_key="unused",
                max_retries=0,
                timeout=REQUEST_TIMEOUT_S,
            )
            async with client:
                await warm_up(client, args.replicas)
                before = await asyncio.to_thread(scrape, base_url)
                results, wall_s = await drive(client, work, args.concurrency)
                after = await asyncio.to_thread(scrape, base_url)
            return results, wall_s, before, after

        results, wall_s, before, after = asyncio.run(go())
    finally:
        serve.delete(app_name)
    (workers_before, totals_before), (workers_after, totals_after) = before, after
    per_worker = {
        w: round(n - workers_before.get(w, 0.0))
        for w, n in sorted(workers_after.items())
        if n > workers_before.get(w, 0)
    }
    return results, wall_s, per_worker, ttft_parts(totals_before, totals_after)


def metrics(
    results: list[TurnResult],
    wall_s: float,
    per_worker: dict[str, int],
    reference: dict[tuple[int, int], str] | None,
) -> dict:
    """The figures of one run; `reference`: (session, turn) -> answer of the first run."""
    by_turn = {(r.session, r.turn): r for r in results}
    followups = [r for r in results if r.turn > 0]
    history = sum(
        r.cached_tokens >= by_turn[r.session, r.turn - 1].prompt_tokens for r in followups
    )
    prompt_tokens = sum(r.prompt_tokens for r in results)
    cached_tokens = sum(r.cached_tokens for r in results)
    completion_tokens = sum(r.completion_tokens for r in results)
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
        "cached_tokens": cached_tokens,
        "completion_tokens": completion_tokens,
        "cached_share": cached_tokens / max(prompt_tokens, 1),
        "tok_s": completion_tokens / wall_s,
        "ttft_p50_ms": percentile(ttft_ms, 0.50),
        "ttft_p99_ms": percentile(ttft_ms, 0.99),
        "latency_p50_ms": percentile([1e3 * r.latency_s for r in results], 0.50),
        "wall_s": wall_s,
        "history_hit_share": history / max(len(followups), 1),
        "requests_per_worker": per_worker,
        "answers_equal_first_run": agree,
    }


def run_all(
    http_port: int, model_dir: str, work: ChatWorkload, args: argparse.Namespace
) -> list[dict]:
    runs: list[dict] = []
    reference: dict[tuple[int, int], str] | None = None
    print(HEADER, flush=True)
    for round_ in range(args.repeats):
        for routing in args.routings:
            app_name = f"{routing.replace('_', '-')}-{round_ + 1}"
            results, wall_s, per_worker, parts = run_routing(
                routing, app_name, http_port, model_dir, work, args
            )
            m = metrics(results, wall_s, per_worker, reference)
            if reference is None:
                reference = {(r.session, r.turn): r.answer for r in results}
            ttft_mean_ms = 1e3 * sum(r.ttft_s for r in results) / len(results)
            runs.append(
                {
                    "round": round_ + 1,
                    "routing": routing,
                    **m,
                    "ttft_mean_ms": ttft_mean_ms,
                    "ttft_parts_ms": parts,
                }
            )
            print_row(runs[-1])
    return runs


HEADER = (
    f"{'round':>5} {'routing':<11} {'wall s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
    f"{'cached':>7} {'hist hit':>8} {'done':>5}  requests per worker"
)


def print_row(run: dict) -> None:
    per_worker = " ".join(str(n) for n in run["requests_per_worker"].values())
    print(
        f"{run['round']!s:>5} {run['routing']:<11} {run['wall_s']:>7.2f} {run['tok_s']:>7.1f} "
        f"{run['ttft_p50_ms']:>7.0f}ms {run['ttft_p99_ms']:>7.0f}ms "
        f"{run['cached_share']:>7.3f} {run['history_hit_share']:>8.2f} {run['finished']:>5}  "
        f"{per_worker}",
        flush=True,
    )
    parts = run["ttft_parts_ms"]
    if parts:
        print(
            f"      TTFT means: client {run['ttft_mean_ms']:.0f} ms, ingress {parts['ingress']:.0f} "
            f"ms: before routing {parts['before_route']:.0f}, route {parts['route']:.0f}, engine "
            f"queue {parts['queue']:.0f}, prefill {parts['prefill']:.0f}, transport "
            f"{parts['transport']:.0f} ms",
            flush=True,
        )


def summarize(runs: list[dict], routings: list[str]) -> dict[str, dict]:
    """Per routing, the median over its rounds of each figure."""
    keys = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "cached_share", "wall_s", "history_hit_share")
    return medians(runs, "routing", routings, keys)


def parse_routings(text: str) -> list[str]:
    return parse_variants(text, {SERVE, SWASERVE, *POLICIES}, "routing", "routings")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = workload_parser(
        __doc__, tokens_flag="--max-tokens", tokens_help="answer tokens per turn"
    )
    parser.add_argument(
        "--app-config",
        type=json.loads,
        default={},
        help="Serve app arguments for every routing, as JSON: '{\"stream_interval_ms\": 0}'",
    )
    parser.add_argument(
        "--routings",
        type=parse_routings,
        default=list(DEFAULT_ROUTINGS),
        help="comma-separated, the last the candidate, each run once per round: serve "
        "(Serve's power-of-two), swaserve (swaserve's router, its default policy or "
        "--app-config's router_policy) or a router "
        f"policy (swaserve's router with it; default: {','.join(DEFAULT_ROUTINGS)})",
    )
    return parse_workload_args(parser, argv, tokens_dest="max_tokens", min_system=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_serve(work: ChatWorkload, args: argparse.Namespace) -> list[dict]:
    """Every run, on a local Ray and a Serve instance started here and shut down whatever
    happens (Serve's gRPC proxy stays off: no servicer functions)."""
    with local_ray(num_cpus=max(8, args.replicas + 4)):
        http_port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        try:
            with tempfile.TemporaryDirectory() as tmp:
                model_dir = make_model(Path(tmp) / MODEL_NAME, args)
                return run_all(http_port, str(model_dir), work, args)
        finally:
            serve.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = make_workload(args)
    load_before = os.getloadavg()[0]
    print(
        f"serve_load: Serve app, {args.replicas} worker replicas × TP 1 (CPU), {args.sessions} "
        f"sessions × {args.turns} turns, {args.concurrency} clients (openai, streaming chat), "
        f"system message {args.system_tokens} tokens, user ~{args.user_tokens}, answers "
        f"{answers_text(args.max_tokens, args.fixed_answers)}; model hidden {args.hidden}, "
        f"{args.layers} layers, W = {args.window} (load average {load_before:.2f})",
        flush=True,
    )
    runs = run_on_serve(work, args)
    load_after = os.getloadavg()[0]
    median = summarize(runs, args.routings)
    candidate = args.routings[-1]
    ratios = {base: ratios_to(median[base], median[candidate]) for base in args.routings[:-1]}
    spreads = {base: round_ratios(runs, "routing", base, candidate) for base in args.routings[:-1]}
    agree = min(r["answers_equal_first_run"] for r in runs)
    for base, ratio in ratios.items():
        print(
            f"median of {args.repeats}: {candidate} / {base}: throughput "
            f"{ratio['tok_s']:.2f}x, TTFT p50 {ratio['ttft_p50']:.2f}x, p99 "
            f"{ratio['ttft_p99']:.2f}x, wall {ratio['wall']:.2f}x; cached share "
            f"{median[candidate]['cached_share']:.3f} vs {median[base]['cached_share']:.3f} "
            f"({ratio['cached_share']:.2f}x); {round_ratios_text(spreads[base])}",
            flush=True,
        )
    print(
        f"answers equal to the first run's: {agree:.0%} of requests in the worst run (load "
        f"average {load_before:.2f} before, {load_after:.2f} after)",
        flush=True,
    )
    if args.json:
        report = {
            "replicas": args.replicas,
            "sessions": args.sessions,
            "turns": args.turns,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "fixed_answers": args.fixed_answers,
            "repeats": args.repeats,
            "routings": args.routings,
            "workload_requests": work.num_requests,
            "workload_answer_tokens": sum(map(sum, work.answers)),
            "load_average_before": load_before,
            "load_average_after": load_after,
            "median": median,
            "ratios": ratios,
            "round_ratios": spreads,
            "answers_equal_first_run": agree,
            "runs": runs,
        }
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
