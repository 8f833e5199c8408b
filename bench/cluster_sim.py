"""bench/cluster_load.py's cluster in simulated time: the same workload, the same router (a
real `Router`, fed the reports its workers would send) and, in each worker, the engine's own
host side (`build_host_state`: its scheduler, KV manager, pools and prefix cache, deciding
admission and batching as they do in the engine). Only the model is not run: a step takes the
time a cost model fitted to the real engine's steps gives it (`StepCost`, from
`Engine.step_log`), and the hops between client, router and worker take times drawn from
those measured on the real cluster (`Hops`, from `RoutedCluster.breakdowns`). The answers are
the real model's (greedy: the first real run's), so the prompts are the real ones.

    client ─ ingress/2 ─► router decides ─ route/2 + hop/2 ─► engine loop takes it between
    steps ─ steps ─► first token ─ hop/2 + ingress/2 ─► client

The engine loop is the real one's: it takes what arrived, runs a step (schedule, the step's
cost, process the results), reports to the router (when something changed, as
`EngineLoop._report` does; the router has it `REPORT_DELAY_S` later), hands out the outputs,
and spends its own measured time between steps (`StepCost.loop_s`) before the next.

`bench/cluster_load.py --simulate` measures, fits and prints the simulator's predictions next
to the measurements; `simulate` is the entry point for a tuner with a saved calibration:

    python bench/cluster_load.py --simulate --json > run.json
    python bench/cluster_sim.py --calibration run.json [--policies ...] [--router-config JSON]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from multiturn import make_model, percentile
from sim_calibration import Calibration, Hop, StepCost

from swaserve.proto.messages import WorkerReport
from swaserve.proto.sampling_params import SamplingParams
from swaserve.router import Outcome, RouteDecision, Router, RouterConfig
from swaserve.worker import EngineConfig
from swaserve.worker.engine.builder import HostState, build_host_state
from swaserve.worker.engine.engine import CALIBRATION_TOKENS
from swaserve.worker.engine.request import Request
from swaserve.worker.engine.scheduler import ScheduledBatch
from swaserve.worker.models.config import load_model_config
from swaserve.worker.runner.model_runner import resolve_dtype

REPORT_DELAY_S = 0.001
"""A report's way from the engine loop to the router actor (one Ray call, not awaited)."""


@dataclass(slots=True)
class SimTurn:
    session: int
    turn: int
    request_id: str
    prompt: list[int]
    answer: Sequence[int]
    hop: Hop
    sent_s: float = 0.0
    delivered_s: float = 0.0  # at its worker's loop
    taken_s: float = 0.0  # added to its engine (the loop's next iteration)
    engine_first_s: float = 0.0  # the end of the step that sampled its first token
    prefill_step_tokens: int = 0  # prompt tokens of that step (its own and others')
    first_token_s: float = 0.0  # at the client
    done_s: float = 0.0  # the last token at the client
    cached_tokens: int = 0
    worker_id: str = ""


@dataclass(slots=True)
class Sim:
    """The event queue and the router's clock."""

    now: float = 0.0
    _events: list = field(default_factory=list)
    _order: itertools.count = field(default_factory=itertools.count)

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def run(self) -> None:
        while self._events:
            when, _, action = heapq.heappop(self._events)
            self.now = when
            action()


class SimWorker:
    """One worker: the engine's host side and its serving loop, in simulated time."""

    def __init__(
        self,
        worker_id: str,
        host: HostState,
        cost: StepCost,
        sim: Sim,
        cluster: SimCluster,
        rng: random.Random,
    ) -> None:
        self.worker_id = worker_id
        self.rng = rng
        self.host = host
        self.cost = cost
        self.sim = sim
        self.cluster = cluster
        self.inbox: list[SimTurn] = []
        self.turns: dict[str, SimTurn] = {}
        self.busy = False  # a loop iteration is scheduled or under way
        self._arrivals = itertools.count()
        self._seq = 0
        self._admitted: list[str] = []
        self._last_counts = (0, 0)
        # the engine times one prefill at start, so its first report carries its speed
        stats = host.stats
        stats.prefill_tokens += CALIBRATION_TOKENS
        stats.prefill_s += cost.fixed_s + cost.prefill_request_s
        stats.prefill_s += cost.prefill_token_s * CALIBRATION_TOKENS

    def deliver(self, turn: SimTurn) -> None:
        turn.delivered_s = self.sim.now
        self.inbox.append(turn)
        if not self.busy:
            self.busy = True
            self.sim.at(self.sim.now, self._iteration)

    def _iteration(self) -> None:
        """`EngineLoop._run`: take what arrived, then one step (or idle)."""
        scheduler = self.host.scheduler
        for turn in self.inbox:
            params = SamplingParams(
                max_new_tokens=len(turn.answer), temperature=0.0, ignore_eos=True
            )
            req = Request(turn.request_id, turn.prompt, params, arrival=next(self._arrivals))
            scheduler.add(req)
            turn.taken_s = self.sim.now
            self.turns[turn.request_id] = turn
            self._admitted.append(turn.request_id)
        self.inbox = []
        batch = scheduler.schedule()
        if batch is None:
            self._report()
            self.busy = False
            return
        seconds = self.cost.seconds(batch, self.rng)
        self.sim.at(self.sim.now + seconds, lambda: self._step_done(batch, seconds))

    def _step_done(self, batch: ScheduledBatch, seconds: float) -> None:
        scheduler, stats = self.host.scheduler, self.host.stats
        tokens: list[int | None] = []
        for req, samples in zip(batch.reqs, batch.samples, strict=True):
            answer = self.turns[req.request_id].answer
            tokens.append(answer[len(req.output_ids)] if samples else None)
        stats.count_step(batch.prefill_tokens, batch.pure_decode, seconds)  # as `Engine.step`
        firsts = [
            r for r, t in zip(batch.reqs, tokens, strict=True) if t is not None and not r.output_ids
        ]
        finished = scheduler.process_results(batch, tokens)
        stats.steps += 1
        self._report()
        for req in firsts:
            turn = self.turns[req.request_id]
            turn.engine_first_s, turn.prefill_step_tokens = self.sim.now, batch.prefill_tokens
            self.cluster.first_token(turn, req.cached_tokens)
        for req in finished:
            self.cluster.finished(self.turns.pop(req.request_id))
        self.sim.at(self.sim.now + self.cost.loop_s, self._iteration)

    def _report(self, force: bool = False, delay_s: float = REPORT_DELAY_S) -> None:
        """`EngineLoop._report`: after a step that changed the cache or the queues; the
        router has it `delay_s` later."""
        tree = self.host.tree
        events = tree.take_events() if tree is not None else []
        scheduler = self.host.scheduler
        counts = (len(scheduler.running), len(scheduler.waiting))
        if not (force or events or self._admitted or counts != self._last_counts):
            return
        self._seq += 1
        report = WorkerReport(
            self.worker_id,
            "sim",
            self._seq,
            self.sim.now,
            self.host.headroom(),
            events,
            admitted_request_ids=tuple(self._admitted),
        )
        self._admitted, self._last_counts = [], counts
        self.sim.at(self.sim.now + delay_s, lambda: self.cluster.take_report(report))


class SimCluster:
    """Router + workers + clients of one simulated run."""

    def __init__(
        self,
        router_config: RouterConfig,
        engine_config: EngineConfig,
        calibration: Calibration,
        replicas: int,
        seed: int,
    ) -> None:
        self.sim = Sim()
        self.router = Router(router_config, clock=lambda: self.sim.now)
        shape = load_model_config(engine_config.model)
        dtype = resolve_dtype(engine_config.dtype, torch.device("cpu"))
        self.workers: dict[str, SimWorker] = {}
        for i in range(replicas):
            worker_id = f"worker-{i}"
            host = build_host_state(engine_config, shape, None, dtype)
            rng = random.Random(f"{seed}/{worker_id}")
            cost = calibration.cost
            self.workers[worker_id] = SimWorker(worker_id, host, cost, self.sim, self, rng)
            self.router.add_worker(worker_id)
        self.rng = random.Random(seed)
        self.hops = calibration.hops
        self.routing: dict[str, SimTurn] = {}
        self.done: list[SimTurn] = []
        self.on_done: Callable[[SimTurn], None] = lambda turn: None

    def start(self) -> None:
        """Every worker's first report (the cluster serves once it has them)."""
        for worker in self.workers.values():
            worker._report(force=True, delay_s=0.0)

    def send(self, turn: SimTurn) -> None:
        turn.sent_s = self.sim.now
        self.sim.at(
            self.sim.now + (turn.hop.ingress_s + turn.hop.route_s) / 2, lambda: self._route(turn)
        )

    def hop(self) -> Hop:
        return self.rng.choice(self.hops)

    def _route(self, turn: SimTurn) -> None:
        decision = self.router.route(
            turn.request_id, turn.prompt, len(turn.answer), session_key=f"session-{turn.session}"
        )
        self.routing[turn.request_id] = turn
        self._handle(decision)

    def _handle(self, decision: RouteDecision) -> None:
        if decision.outcome == Outcome.QUEUED:
            return
        turn = self.routing.pop(decision.request_id)
        if decision.outcome != Outcome.ROUTED or decision.worker_id is None:
            raise RuntimeError(f"{turn.request_id}: {decision.outcome}")
        turn.worker_id = decision.worker_id
        worker = self.workers[decision.worker_id]
        delay = (turn.hop.route_s + turn.hop.wire_s) / 2
        self.sim.at(self.sim.now + delay, lambda: worker.deliver(turn))

    def take_report(self, report: WorkerReport) -> None:
        if self.router.update(report):
            raise RuntimeError(f"{report.worker_id}: the router lost track of a lossless stream")
        self._poll()

    def _poll(self) -> None:
        while decisions := self.router.poll():
            for decision in decisions:
                self._handle(decision)

    def first_token(self, turn: SimTurn, cached_tokens: int) -> None:
        turn.cached_tokens = cached_tokens
        turn.first_token_s = self.sim.now + (turn.hop.wire_s + turn.hop.ingress_s) / 2

    def finished(self, turn: SimTurn) -> None:
        back = (turn.hop.wire_s + turn.hop.ingress_s) / 2
        turn.done_s = self.sim.now + back

        def end() -> None:
            self.router.finish(turn.request_id, len(turn.answer))
            self._poll()
            self.done.append(turn)
            self.on_done(turn)

        self.sim.at(self.sim.now + turn.hop.wire_s / 2, end)


def simulate(
    policy: str,
    router_config: dict,
    model_dir: str,
    max_total_tokens: int,
    system: Sequence[int],
    users: Sequence[Sequence[Sequence[int]]],
    answers: dict[tuple[int, int], Sequence[int]],
    concurrency: int,
    calibration: Calibration,
    replicas: int = 2,
    seed: int = 0,
    engine_config: dict | None = None,
) -> dict:
    """One run of the workload (`system` prompt, `users[session][turn]`, the model's
    `answers`) on `concurrency` clients, as bench/cluster_load.py drives it: its figures."""
    engine = EngineConfig(
        model=model_dir,
        device="cpu",
        max_total_tokens=max_total_tokens,
        **(engine_config or {}),
    )
    cluster = SimCluster(
        RouterConfig(policy=policy, **router_config), engine, calibration, replicas, seed
    )
    sessions = list(range(len(users)))  # taken in order by the clients, as the bench's do

    def send(session: int, turn: int, history: list[int]) -> None:
        prompt = history + list(users[session][turn])
        request_id = f"s{session}-t{turn}"
        hop = cluster.hop()
        cluster.send(SimTurn(session, turn, request_id, prompt, answers[session, turn], hop))

    def start_session() -> None:
        if sessions:
            send(sessions.pop(0), 0, list(system))

    def on_done(turn: SimTurn) -> None:
        """The client has the whole answer at `done_s`: its next turn, or its next session."""

        def client_next() -> None:
            if turn.turn + 1 < len(users[turn.session]):
                send(turn.session, turn.turn + 1, turn.prompt + list(turn.answer))
            else:
                start_session()

        cluster.sim.at(turn.done_s, client_next)

    cluster.on_done = on_done
    cluster.start()
    cluster.sim.run()  # the first reports
    for _ in range(concurrency):
        cluster.sim.at(0.0, start_session)
    cluster.sim.run()
    for worker in cluster.workers.values():
        worker.host.scheduler.check()
    done = cluster.done
    ttft_ms = [1e3 * (t.first_token_s - t.sent_s) for t in done]
    span_s = max(t.done_s for t in done) - min(t.sent_s for t in done)
    prompt_tokens = sum(len(t.prompt) for t in done)
    per_worker: dict[str, int] = dict.fromkeys(cluster.workers, 0)
    for t in done:
        per_worker[t.worker_id] += 1

    def ms(values: list[float]) -> dict[str, float]:
        return {"p50": percentile(values, 0.5) * 1e3, "p99": percentile(values, 0.99) * 1e3}

    parts = {
        "engine_ms": ms([t.engine_first_s - t.taken_s for t in done]),
        "loop_wait_ms": ms([t.taken_s - t.delivered_s for t in done]),
        "prompt_tokens_per_prefill_step": statistics.mean(t.prefill_step_tokens for t in done),
    }
    by_turn = sorted(done, key=lambda t: (t.session, t.turn))
    return {
        "requests": len(done),
        "ttft_ms": [1e3 * (t.first_token_s - t.sent_s) for t in by_turn],
        "cached_tokens": sum(t.cached_tokens for t in done),
        "ttft_parts": parts,
        "tok_s": sum(len(t.answer) for t in done) / span_s,
        "ttft_p50_ms": percentile(ttft_ms, 0.50),
        "ttft_p99_ms": percentile(ttft_ms, 0.99),
        "cached_share": sum(t.cached_tokens for t in done) / max(prompt_tokens, 1),
        "wall_s": span_s,
        "requests_per_worker": per_worker,
    }


def simulate_median(repeats: int, **kwargs) -> dict:
    """`simulate` over `repeats` seeds of the hop draws: the median of each figure."""
    runs = [simulate(seed=seed, **kwargs) for seed in range(repeats)]
    keys = ("requests", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "cached_share", "wall_s")
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["requests_per_worker"] = runs[0]["requests_per_worker"]
    out["ttft_parts"] = runs[0]["ttft_parts"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", required=True, help="cluster_load.py --simulate --json")
    parser.add_argument("--policies", default=None, help="default: the calibration run's")
    parser.add_argument("--router-config", type=json.loads, default={})
    parser.add_argument(
        "--engine-config",
        type=json.loads,
        default={},
        help="EngineConfig fields for every policy's workers (their step cost stays the fit)",
    )
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5, help="hop draws per policy")
    args = parser.parse_args(argv)
    with open(args.calibration) as f:
        report = json.loads(next(line for line in f if line.startswith("{")))
    calibration = Calibration.from_json(report["calibration"])
    if "step_logs" in report:  # refit: the step cost as this version models it
        logs = [log for per_run in report["step_logs"].values() for log in per_run.values()]
        calibration = Calibration(StepCost.fit(logs), calibration.hops)
    workload = report["workload"]
    answers = {(s, t): a for s, t, a in workload["answers"]}
    policies = args.policies.split(",") if args.policies else report["policies"]
    concurrency = args.concurrency or report["concurrency"]
    base = policies[0]
    c = calibration.cost
    print(
        f"cluster_sim: {concurrency} clients; step {1e3 * c.fixed_s:.2f} ms + "
        f"{1e3 * c.decode_row_s:.3f} ms/decode row + {1e3 * c.prefill_request_s:.2f} ms/prefill "
        f"+ {1e6 * c.prefill_token_s:.0f} us/prompt token + {1e6 * c.context_s:.1f} us/token/1k "
        f"context, times one of {len(c.noise)} measured / fitted ratios (median "
        f"{statistics.median(c.noise):.2f})"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_model(tmp, argparse.Namespace(**report["model"])))
        results = {}
        for policy in policies:
            results[policy] = simulate_median(
                args.repeats,
                policy=policy,
                router_config=args.router_config if policy != base else {},
                model_dir=model_dir,
                max_total_tokens=report["max_total_tokens"],
                system=workload["system"],
                users=workload["users"],
                answers=answers,
                concurrency=concurrency,
                calibration=calibration,
                engine_config=args.engine_config,
                replicas=report.get("replicas", 2),
            )
            r = results[policy]
            print(
                f"{policy:<12} tok/s {r['tok_s']:7.1f}  TTFT p50 {r['ttft_p50_ms']:5.0f} ms  "
                f"p99 {r['ttft_p99_ms']:5.0f} ms  cached {r['cached_share']:.3f}  "
                f"per worker {' '.join(map(str, r['requests_per_worker'].values()))}"
            )
            parts = r["ttft_parts"]
            print(
                f"{'':<12} queue + prefill p50/p99 {parts['engine_ms']['p50']:.0f}/"
                f"{parts['engine_ms']['p99']:.0f} ms, step under way "
                f"{parts['loop_wait_ms']['p50']:.0f}/{parts['loop_wait_ms']['p99']:.0f} ms, "
                f"{parts['prompt_tokens_per_prefill_step']:.0f} prompt tokens per prefill step"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
