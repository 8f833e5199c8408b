"""Workloads of `bench/router_sim.py` that put the SWA pool under pressure (the chat and
independent ones are in `router_sim.py` itself). Drawn once per seed, replayed for every
policy; token ids only.

- Agentic fan-out (`agentic_runs`): runs start as a Poisson stream; each shares one long
  system prompt (4096 tokens) with every other run, adds its task (256-1024), and fans out
  `fan_out` sub-requests at once (system + task + a 64-256-token instruction, a 64-256-token
  reply); when all have answered, a join request (system + task + every sub-reply + a
  64-token instruction) asks for a 128-512-token answer.
- One skewed tenant (`skewed_requests`): 8 tenants, each with its own 2048-token system
  prompt; tenant 0 sends half of the requests, the others share the rest evenly; each
  request is the tenant's system prompt + a 64-512-token message, Poisson arrivals.

Many requests decode at once over long shared prefixes: their windows and the cached
prefixes' window checkpoints compete for the small SWA pool, so cached prefixes lose their
SWA KV (tombstones) while their full KV stays.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB = range(50_000)


def tokens(rng: random.Random, n: int) -> list[int]:
    return rng.choices(VOCAB, k=n)


@dataclass(frozen=True, slots=True)
class PressureWorkload:
    agent_runs_per_worker: int = 12
    agent_rate_per_worker_s: float = 0.25
    agent_system_tokens: int = 4096
    agent_task_tokens: tuple[int, int] = (256, 1024)
    fan_out: int = 8
    agent_instruction_tokens: tuple[int, int] = (64, 256)
    agent_reply_tokens: tuple[int, int] = (64, 256)
    join_reply_tokens: tuple[int, int] = (128, 512)
    tenants: int = 8
    tenant_system_tokens: int = 2048
    skewed_share: float = 0.5
    skewed_per_worker: int = 120
    skewed_rate_per_worker_s: float = 4.0
    skewed_user_tokens: tuple[int, int] = (64, 512)
    skewed_reply_tokens: tuple[int, int] = (64, 256)


QUICK_PRESSURE = PressureWorkload(agent_runs_per_worker=2, fan_out=4, skewed_per_worker=12)


@dataclass(frozen=True, slots=True)
class AgentRun:
    start_s: float
    prefix: list[int]  # system + task
    subs: list[tuple[list[int], list[int]]]  # (instruction, reply)
    join: tuple[list[int], list[int]]  # (instruction, answer)


def agentic_runs(rng: random.Random, work: PressureWorkload, workers: int) -> list[AgentRun]:
    system = tokens(rng, work.agent_system_tokens)
    now, runs = 0.0, []
    for _ in range(work.agent_runs_per_worker * workers):
        now += rng.expovariate(work.agent_rate_per_worker_s * workers)
        prefix = system + tokens(rng, rng.randint(*work.agent_task_tokens))
        subs = [
            (
                tokens(rng, rng.randint(*work.agent_instruction_tokens)),
                tokens(rng, rng.randint(*work.agent_reply_tokens)),
            )
            for _ in range(work.fan_out)
        ]
        join = (tokens(rng, 64), tokens(rng, rng.randint(*work.join_reply_tokens)))
        runs.append(AgentRun(now, prefix, subs, join))
    return runs


def skewed_requests(
    rng: random.Random, work: PressureWorkload, workers: int
) -> list[tuple[float, int, list[int], list[int]]]:
    """(arrival s, tenant, prompt, reply) in arrival order."""
    systems = [tokens(rng, work.tenant_system_tokens) for _ in range(work.tenants)]
    others = (1 - work.skewed_share) / (work.tenants - 1)
    weights = [work.skewed_share] + [others] * (work.tenants - 1)
    now, out = 0.0, []
    for _ in range(work.skewed_per_worker * workers):
        now += rng.expovariate(work.skewed_rate_per_worker_s * workers)
        tenant = rng.choices(range(work.tenants), weights)[0]
        prompt = systems[tenant] + tokens(rng, rng.randint(*work.skewed_user_tokens))
        out.append((now, tenant, prompt, tokens(rng, rng.randint(*work.skewed_reply_tokens))))
    return out
