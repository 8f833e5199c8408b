"""Agents in a tool loop over the OpenAI API of a local cluster (4 replicas × TP 1, CPU): how
much of each turn's prompt comes from the prefix cache on the hybrid engine, against a one-pool
engine (`disable_hybrid_swa_memory`: every layer keeps every token, the reuse ceiling) and
against round-robin routing, in the same process.

Workload (drawn once per seed, replayed for every variant): A agents, each with its own
instructions, run T turns at once with the stock `openai` async client. A turn is a user
message, then a request that reasons and calls the `run` tool, the tool's result, then a
request that reasons and answers:

    turn t:  user → [reasoning, call run({"cmd": ...})] → tool result → [reasoning, answer]

The tiny random model is made to act so by a whole-output grammar in its own chat format
(GPT-OSS: harmony's channels; MiMo-V2-Flash: `<think>` and its XML call), and the swaserve
parser turns its output back into `reasoning_content`, `tool_calls` and `content`, which the
agent sends back as an agent would. The templates drop a finished turn's reasoning, so each
new turn's prompt diverges inside the previous turn's sequences, where the hybrid engine's
SWA KV may have been freed: the window checkpoints and window repair keep it reusable.

Per variant and turn: the cached share of prompt tokens (Σ cached_tokens / Σ prompt_tokens over
the turn's requests of every agent). Printed: the table, and from turn 2 on the hybrid engine's
share against the one-pool engine's and against round robin's. Variants run in order
hybrid, one-pool, round-robin for `--repeats` rounds; each starts its own cluster (cold
caches; the decode step compiled before serving, as in bench/cluster_load.py).

    python bench/agent_loop.py [--json] [--arch gpt-oss|mimo-v2-flash] [--replicas 4] [--agents 16]
        [--turns 8] [--repeats 1] [--reasoning-chars 24] [--answer-chars 24]
        [--user-chars 96] [--result-chars 96] [--hidden 64] [--layers 4] [--window 16]
        [--max-total-tokens 32768]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import string
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import openai
from multiturn import local_ray, workers_compile

from swaserve.cluster.cluster import Cluster, ClusterConfig
from swaserve.cluster.http_server import HttpServer
from swaserve.router import RouterConfig
from swaserve.worker import EngineConfig
from swaserve.worker.models.tiny import make_tiny_model

VARIANTS = {
    "hybrid": ({}, "ttft"),
    "one-pool": ({"disable_hybrid_swa_memory": True}, "ttft"),
    "round-robin": ({}, "round_robin"),
}
"""name → (EngineConfig overrides, router policy)."""
TOOL = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "maxLength": 8}},
            "required": ["cmd"],
        },
    },
}


def grammars(arch: str, reasoning: int, answer: int) -> tuple[str, str]:
    """(a call's, an answer's) whole-output grammars in the model's chat format."""
    think = f"/[b-z ]{{{reasoning}}}/"
    text = f"/[b-z ]{{{answer}}}/"
    if arch == "gpt-oss":
        analysis = f'<|channel|> "analysis" <|message|> {think} <|end|> <|start|> "assistant"'
        call = (
            f'start: {analysis} <|channel|> "commentary to=functions.run " <|constrain|> '
            '"json" <|message|> "{\\"cmd\\":\\"" /[a-z]{8}/ "\\"}" <|call|>'
        )
        final = f'start: {analysis} <|channel|> "final" <|message|> {text} <|return|>'
        return call, final
    call = (
        f'start: {think} </think> <tool_call> "\\n<function=run>\\n<parameter=cmd>" /[a-z]{{8}}/ '
        '"</parameter>\\n</function>\\n" </tool_call> <|im_end|>'
    )
    return call, f"start: {think} </think> {text} <|im_end|>"


@dataclass
class Workload:
    instructions: list[str]  # per agent
    users: list[list[str]]  # per agent, per turn
    results: list[list[str]]  # per agent, per turn: the tool's output


def words(rng: random.Random, chars: int) -> str:
    out = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8))))
    return " ".join(out)[:chars]


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    return Workload(
        [f"You are agent {a}. " + words(rng, args.instruction_chars) for a in range(args.agents)],
        [[words(rng, args.user_chars) for _ in range(args.turns)] for _ in range(args.agents)],
        [[words(rng, args.result_chars) for _ in range(args.turns)] for _ in range(args.agents)],
    )


@dataclass
class Turn:
    prompt: int = 0
    cached: int = 0
    calls: int = 0  # requests that came back as a parsed call (finish_reason tool_calls)
    answers: int = 0  # requests that came back as an answer (finish_reason stop)


@dataclass
class Run:
    variant: str
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0


async def agent(
    client: openai.AsyncOpenAI,
    model: str,
    index: int,
    work: Workload,
    call_grammar: str,
    answer_grammar: str,
    thinking: dict[str, Any],
    turns: list[Turn],
) -> None:
    """One agent's whole session; adds its requests' usage to `turns`."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": work.instructions[index]}]
    common: dict[str, Any] = {
        "model": model,
        "tools": [TOOL],
        "temperature": 0,
        "max_tokens": 200,
        "user": f"agent-{index}",
    }

    async def ask(grammar: str, turn: Turn) -> Any:
        out = await client.chat.completions.create(
            messages=messages,  # type: ignore[arg-type]
            extra_body={"structured_outputs": {"grammar": grammar}, **thinking},
            **common,
        )
        add_usage(turn, out)
        return out.choices[0]

    for t, user in enumerate(work.users[index]):
        messages.append({"role": "user", "content": user})
        choice = await ask(call_grammar, turns[t])
        turns[t].calls += choice.finish_reason == "tool_calls"
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls or []:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": work.results[index][t]}
            )
        choice = await ask(answer_grammar, turns[t])
        turns[t].answers += choice.finish_reason == "stop"
        messages.append({"role": "assistant", "content": choice.message.content or ""})


def add_usage(turn: Turn, out: Any) -> None:
    usage = out.usage
    turn.prompt += usage.prompt_tokens
    details = usage.prompt_tokens_details
    turn.cached += (details.cached_tokens or 0) if details is not None else 0


async def run_variant(
    variant: str, model_dir: str, work: Workload, args: argparse.Namespace
) -> Run:
    """A fresh cluster and HTTP server for one variant, both stopped whatever happens."""
    overrides, policy = VARIANTS[variant]
    config = ClusterConfig(
        engine=EngineConfig(
            model=model_dir,
            device="cpu",
            max_total_tokens=args.max_total_tokens,
            seed=0,
            compile=workers_compile(),
            **overrides,
        ),
        router=RouterConfig(policy=policy),
        replicas=args.replicas,
        report_interval_s=0.1,
    )
    call_grammar, answer_grammar = grammars(args.arch, args.reasoning_chars, args.answer_chars)
    thinking = {"chat_template_kwargs": {"enable_thinking": True}} if args.arch != "gpt-oss" else {}
    run = Run(variant, [Turn() for _ in range(args.turns)])
    cluster = await Cluster.start(config)
    try:
        server = HttpServer(cluster, port=0)
        port = await server.start()
        try:
            assert cluster.model_info is not None
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
            )
            start = time.perf_counter()
            await asyncio.gather(
                *(
                    agent(
                        client,
                        cluster.model_info.model_name,
                        a,
                        work,
                        call_grammar,
                        answer_grammar,
                        thinking,
                        run.turns,
                    )
                    for a in range(args.agents)
                )
            )
            run.wall_s = time.perf_counter() - start
            await client.close()
        finally:
            await server.stop()
    finally:
        await cluster.shutdown(timeout_s=10)
    return run


def shares(run: Run) -> list[float]:
    return [t.cached / t.prompt if t.prompt else 0.0 for t in run.turns]


def summarize(runs: list[Run], turns: int) -> dict[str, list[float]]:
    """Per variant and turn, the median cached share over the rounds."""
    return {
        v: [statistics.median(shares(r)[t] for r in runs if r.variant == v) for t in range(turns)]
        for v in VARIANTS
    }


def from_turn_2(runs: list[Run], variant: str) -> float:
    """The variant's cached share over turns 2.. (Σ cached / Σ prompt), median over rounds."""
    values = []
    for r in runs:
        if r.variant == variant:
            later = r.turns[1:]
            prompt = sum(t.prompt for t in later)
            values.append(sum(t.cached for t in later) / prompt if prompt else 0.0)
    return statistics.median(values)


async def run_all(model_dir: str, work: Workload, args: argparse.Namespace) -> list[Run]:
    runs = []
    for _ in range(args.repeats):
        for variant in VARIANTS:
            run = await run_variant(variant, model_dir, work, args)
            print(
                f"  {variant:>11}: cached share per turn "
                + " ".join(f"{s:.2f}" for s in shares(run))
                + f"  ({run.wall_s:.1f} s; {sum(t.calls for t in run.turns)} calls and "
                f"{sum(t.answers for t in run.turns)} answers parsed)",
                flush=True,
            )
            runs.append(run)
    return runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", choices=["gpt-oss", "mimo-v2-flash"], default="gpt-oss")
    parser.add_argument("--replicas", type=int, default=4, help="workers (TP 1 each)")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--reasoning-chars", type=int, default=24)
    parser.add_argument("--answer-chars", type=int, default=24)
    parser.add_argument("--user-chars", type=int, default=96)
    parser.add_argument("--result-chars", type=int, default=96)
    parser.add_argument("--instruction-chars", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--window", type=int, default=16, help="W of the sliding layers")
    parser.add_argument("--max-total-tokens", type=int, default=32768, help="KV per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    for name in ("replicas", "agents", "turns", "repeats", "reasoning_chars", "answer_chars"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = make_workload(args)
    load_before = os.getloadavg()[0]
    print(
        f"agent_loop: {args.replicas} replicas × TP 1 (CPU), {args.arch} (its own chat format), "
        f"{args.agents} agents × {args.turns} turns (call → result → answer), W = "
        f"{args.window}, {args.layers} layers, hidden {args.hidden} (load average "
        f"{load_before:.2f})",
        flush=True,
    )
    with local_ray(max(8, args.replicas + 2)), tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(
            tmp,
            arch=args.arch,
            num_layers=args.layers,
            sliding_window_size=args.window,
            hidden_size=args.hidden,
            num_heads=8,
            num_kv_heads=2,
            native_chat=True,
        )
        runs = asyncio.run(run_all(str(model_dir), work, args))
    load_after = os.getloadavg()[0]
    table = summarize(runs, args.turns)
    print("turn  " + "  ".join(f"{v:>11}" for v in VARIANTS))
    for t in range(args.turns):
        print(f"{t + 1:>4}  " + "  ".join(f"{table[v][t]:>11.3f}" for v in VARIANTS))
    later = {v: from_turn_2(runs, v) for v in VARIANTS}
    vs_one_pool = later["hybrid"] / later["one-pool"] if later["one-pool"] else 0.0
    vs_rr = later["hybrid"] / later["round-robin"] if later["round-robin"] else 0.0
    print(
        f"from turn 2: cached share hybrid {later['hybrid']:.3f}, one-pool "
        f"{later['one-pool']:.3f}, round-robin {later['round-robin']:.3f}; hybrid / one-pool "
        f"{vs_one_pool:.3f}x, hybrid / round-robin {vs_rr:.2f}x (load average "
        f"{load_before:.2f} before, {load_after:.2f} after)"
    )
    if args.json:
        report = {
            "arch": args.arch,
            "replicas": args.replicas,
            "agents": args.agents,
            "turns": args.turns,
            "repeats": args.repeats,
            "per_turn": table,
            "from_turn_2": later,
            "hybrid_vs_one_pool": vs_one_pool,
            "hybrid_vs_round_robin": vs_rr,
            "runs": [
                {
                    "variant": r.variant,
                    "wall_s": r.wall_s,
                    "turns": [vars(t) for t in r.turns],
                }
                for r in runs
            ],
            "load_average_before": load_before,
            "load_average_after": load_after,
        }
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
