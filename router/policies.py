"""Routing policies: which of the workers that fit a request gets it. A registry (`POLICIES`,
name → class) so that the config names one.

The router hands a policy only the workers that are fresh and have room for the request, in
the order the workers were added, never empty, as columns (`Candidates`: one array per field,
so that a policy over hundreds of workers is a few array operations); the policy only
chooses. `Policy.choose` takes them as a list of `Candidate`s instead.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    from swaserve.router.config import RouterConfig


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker that can take the request now. `order`: its rank among the workers by
    `add_worker` order (stable tie-break); `load`: its requests (running, waiting, in flight);
    `hit_tokens`: prompt tokens its prefix cache saves it from computing (a repaired hit:
    its match less the tokens the repair recomputes); `queued_prefill_tokens`: prompt tokens
    it has still to prefill before this request, as far as the router knows: the rest of the
    prefills under way and the waiting prompts of its last report plus the uncached tokens of
    the requests routed to it since (not listed by a report yet); `speed`: the fastest
    worker's seconds per token over its own (`WorkerTable.speeds`: the prefill speed its
    reports measure, else the speed observed per finished request; 1.0: as fast as the
    fastest, or not known yet);
    `free_tokens`: the unallocated full-pool KV slots of its last report: room it can fill
    without evicting cached prefixes (not less what was routed since: that is in
    `queued_prefill_tokens`, and subtracting it too lowered the chat trace's reuse), of
    `total_tokens` in its full pool; `decode_tokens`: its running decodes as work, the
    seconds of its decode step in its own prompt tokens (`WorkerState.decode_tokens`: the
    step a first token shares with them; 0 when nothing runs)."""

    worker_id: str
    order: int
    load: int
    hit_tokens: int
    queued_prefill_tokens: int = 0
    speed: float = 1.0
    free_tokens: int = 0
    total_tokens: int = 0
    decode_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Candidates:
    """`Candidate`s as columns: each field an array with an entry per candidate (`worker_id`
    an object array of str; `speed` float; the others int)."""

    worker_id: np.ndarray
    order: np.ndarray
    load: np.ndarray
    hit_tokens: np.ndarray
    queued_prefill_tokens: np.ndarray
    speed: np.ndarray
    free_tokens: np.ndarray
    total_tokens: np.ndarray
    decode_tokens: np.ndarray

    @classmethod
    def of(cls, candidates: Sequence[Candidate]) -> Candidates:
        columns = {f.name: [getattr(c, f.name) for c in candidates] for f in fields(Candidate)}
        ids = np.empty(len(candidates), object)
        ids[:] = columns.pop("worker_id")
        speed = np.array(columns.pop("speed"), np.float64)
        ints = {name: np.array(v, np.int64) for name, v in columns.items()}
        return cls(worker_id=ids, speed=speed, **ints)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> Candidate:
        return Candidate(
            str(self.worker_id[i]),
            int(self.order[i]),
            int(self.load[i]),
            int(self.hit_tokens[i]),
            int(self.queued_prefill_tokens[i]),
            float(self.speed[i]),
            int(self.free_tokens[i]),
            int(self.total_tokens[i]),
            int(self.decode_tokens[i]),
        )


def first_min(keys: Sequence[np.ndarray], among: np.ndarray | None = None) -> int:
    """The index of the least entry by `keys` (the first key first, then the next on ties;
    last ties: the lower index, as `lexsort` is stable), among the indices where `among` is
    True (None: all)."""
    if among is None:
        return int(np.lexsort(keys[::-1])[0])
    at = np.flatnonzero(among)
    return int(at[np.lexsort([k[at] for k in keys[::-1]])[0]])


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may look at besides the candidates."""

    request_id: str
    token_ids: Sequence[int]
    max_new_tokens: int
    session_key: str | None = None


class Policy(ABC):
    name: ClassVar[str]

    def __init__(self, config: RouterConfig) -> None:
        self.config = config

    @abstractmethod
    def pick(self, request: RouteRequest, candidates: Candidates) -> int:
        """The index of the chosen one of `candidates` (non-empty). May update the policy's
        own state only."""

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        """`pick` over a list."""
        return candidates[self.pick(request, Candidates.of(candidates))]

    def hold(self, request: RouteRequest, chosen: Candidate, waiting: Candidates) -> bool:
        """Keep the request in the router's queue rather than send it to `chosen`, because
        one of `waiting` (fresh workers that do not fit it now but would when idle) is
        expected to serve it sooner once it has room. A query; default: never."""
        return False

    def placed(self, request: RouteRequest, chosen: Candidate) -> None:
        """The router sent `request` to `chosen` (after `pick` and `hold`, which may see a
        queued request more than once): where a policy records its placements. Default:
        nothing."""
        return None


class PrefixPolicy(Policy):
    """Least time the request costs everyone on a worker: its own wait for the first token
    plus what its prefill delays the requests already there,

        score = (queued_prefill + decode step + uncached × (1 + prefix_load_weight × load))
                / speed

    (ties: longer hit, lower load, add order). The first three terms are `ttft`'s cost; the
    last charges each of the worker's `load` requests (running, waiting, routed since) the
    step time this request's uncached prompt adds to theirs. A hit is worth its tokens
    times the worker's load, so a session keeps its worker while that worker is about as
    busy as the others, and a worker with nothing on it costs a request only its own wait:
    a history, or a shared system prompt that only one worker holds yet, does not keep every
    new session away from an idle worker. The load that balances is work, the delay a
    placement adds, not a request count: SGLang's cache-aware gate (`max - least > abs` and
    `max > least × rel` requests) never trips at the few requests per worker of a small
    cluster, where sessions whose turns arrive together pile up on one worker and each first
    token waits for all their prefills (issue: prefix routing on the real cluster).
    """

    name = "prefix"

    def pick(self, request: RouteRequest, candidates: Candidates) -> int:
        c = candidates
        uncached = _uncached(request, c)
        score = _ttft(request, c) + self.config.prefix_load_weight * uncached * c.load / c.speed
        return first_min((score, -c.hit_tokens, c.load, c.order))


BALANCE_FREE_SHARE = 0.5
"""`ttft` weighs memory only when the cheapest worker's full pool is less than this share free:
below it, new KV soon evicts cached histories there; above it, moving a request to a freer
worker only scatters sessions (on bench/cluster_load.py's small cluster, where no pool fills,
weighing memory always moved 62-80 % of the turns and cut reuse from 0.84 to 0.70-0.73). On
bench/router_sim.py's chat trace 0.5 keeps reuse at 0.84-0.88 (0.25: 0.79-0.87, 0.75:
0.83-0.84)."""

SESSION_MEMORY = 1 << 16
"""Session keys `ttft` remembers having placed (the least recently placed are forgotten
first; a forgotten session's next turn is placed as a new one)."""

HOLD_SPEEDUP = 1.25
"""How much faster than the chosen worker one without room must be for `ttft` to wait for it
(observed speeds of alike workers differ by a few percent)."""


class TTFTPolicy(Policy):
    """Least predicted time to first token: a worker prefills its queue in order at its own
    speed, in steps that also carry its running decodes, so this request's first token waits
    for the tokens queued before it, about one decode step, and its own uncached tokens,

        cost = (queued_prefill_tokens + decode_tokens + len(prompt) − hit_tokens) / speed

    Reuse counts only as the prefill it saves, so a long hit on a busy worker loses to a cold
    idle one once the queue there is longer than the hit. No balance gate: the queue is the
    load signal.

    A session's first request places the session: its later turns follow their cached
    history there. The cost of that first turn does not see the turns the worker's other
    sessions will send next, so where one worker alone held a prefix that new sessions share
    (a system prompt), new sessions went there while its queue was short, and stayed (an open
    loop on the 2-worker cluster: 74-109 of 120 turns on one worker).
    So a request whose `session_key` this policy has not placed yet, where the workers
    whose cost is within `ttft_balance_tokens` of the cheapest do not all hold the same
    prefix of it, goes to the least loaded of them (`load / speed`: requests, each running
    one a session whose next turn will follow, a slower worker's counting for more; ties:
    the keys below); a shared prefix shorter than the slack is then computed once more, on
    the second worker, and the sessions split. Where they all hold the same prefix, only
    the queues differ now, but the queue is a moment's: a worker whose sessions are between
    two turns (no request in flight) looks emptier than one whose sessions all have a
    request in flight. So the new session goes to the near worker holding the fewest of
    the sessions this policy placed (per unit of speed), then the cheapest of those: its
    first token waits at most `ttft_balance_tokens` longer than at the cheapest, and the
    workers take the sessions, hence their later turns, in turn. Placed by the queue alone,
    the 10 sessions of bench/cluster_load.py's 5 clients split 6 / 4 or 7 / 3 in about a
    third of the runs (36-42 of 60 turns on one worker); now 5 / 5. Placing them by load
    (`load / speed`) instead raised bench/router_sim.py's agentic TTFT p99 at 500 ms-late
    reports from 268 / 863 ms to 513 / 1089 on seeds 0 / 1: its fan-outs each open a
    session, all at once, and the loads they see lag. Requests without a key are placed by
    cost alone, and memory pressure (below) comes first.

    A known session's turn goes to the cheapest like any request, but where that is not its
    session's worker (its queue is longer just now), the turn takes the session's later turns
    along: so it leaves only for a near worker, no dearer than its own, that holds fewer
    sessions (the fewest of those, then the cheapest), and stays where none does, unless its
    own worker's cost is past the slack. Moved by cost alone, a turn whose history saved ~100
    tokens left for a worker 1 token cheaper that held as many sessions as its own, and that
    session's turns then made it 23 of 60 on one of 4 workers (bench/serve_load.py
    --replicas 4; the simulator gave it 1 run in 30, none after).

    Where workers tie (a new session's least loaded, or the cheapest by cost, hit and load:
    an idle cluster), the one holding the fewest of the sessions this policy placed (per
    unit of speed) wins, then add order: a lone client's sessions, one at a time, took
    every idle worker's place in turn on worker 0 (bench/cluster_load.py, 1 client: 36 of
    36 turns there); now they alternate (18 / 18), the shared system prompt computed once
    on each worker.

    Memory is the other thing a placement spends: KV written beyond a pool's unallocated
    room evicts cached prefixes that later turns may hit. So when the cheapest worker's pool
    is less than `BALANCE_FREE_SHARE` free, a worker within `ttft_balance_tokens` of the
    cheapest may take the request instead where the move spares at least as much cached KV
    from eviction as it costs in recomputed prompt: (evicted on the cheapest − evicted
    there) ≥ (uncached there − uncached on the cheapest), evicted being the uncached prompt
    tokens beyond the free slots of the worker's last report. Of those, the one that evicts
    the least wins, then the freest (then lower cost, longer hit, lower load, add order).
    So a request that every pool would prefill alike (a new session on a system prompt
    they all hold) fills the emptiest pool rather than evict, as SGLang's gateway sends
    low-match requests to its smallest tree, while a history stays where it is cached: its
    turn writes fewer tokens than moving it would recompute. Once every pool is full of
    cached KV (a server's steady state: a prefix cache keeps what it may evict), every
    placement evicts what it writes, and memory moves a request only to a worker where it
    writes no more. The rule before (the freest pool of those within the slack) drew turns
    to whichever pool a report showed a few more free slots in: bench/cluster_load.py with
    60 sessions, whose caches fill after the first dozen, kept 0.70-0.79 of the turns on
    their worker and a cached share of 0.80; now 0.97-0.98 and 0.84. On
    bench/router_sim.py's chat trace (seeds 0-2) the median reuse at 0 / 100 / 500 ms-late
    reports went from 0.801 / 0.777 / 0.785 to 0.803 / 0.816 / 0.795.
    """

    name = "ttft"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        # placed keys -> the worker of their latest placement, oldest first
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._held: Counter[str] = Counter()  # worker -> its sessions in `_sessions`

    def pick(self, request: RouteRequest, candidates: Candidates) -> int:
        c = candidates
        cost = _ttft(request, c)
        keys = (cost, -c.hit_tokens, c.load, c.order)
        best = first_min(keys)
        near = cost <= cost[best] + self.config.ttft_balance_tokens
        if c.free_tokens[best] < BALANCE_FREE_SHARE * c.total_tokens[best]:
            # Memory pressure: a move off the cheapest pays where it spares at least as much
            # cached KV from eviction as it recomputes.
            writes = _uncached(request, c)  # the KV its prompt adds there
            evicted = np.maximum(writes - c.free_tokens, 0)  # beyond the free slots
            spares = near & (evicted[best] - evicted >= writes - writes[best])
            if np.count_nonzero(spares) > 1:
                return first_min((evicted, -c.free_tokens, *keys), spares)
        key = request.session_key
        if key is not None and key not in self._sessions:
            # A new session: of the near workers, the fewest sessions, then the cheapest; of
            # the least loaded of them where it is drawn by a prefix that not all of them hold.
            among = near
            if c.hit_tokens[near].max() > c.hit_tokens[near].min():
                load = c.load / c.speed
                among = near & (load == load[near].min())
            return self._fewest_sessions(c, among, keys)
        if key is not None and c.worker_id[best] != self._sessions[key]:
            # A turn that leaves its session's worker takes the later turns along: it leaves
            # only for a near worker holding fewer sessions (the fewest of them), unless the
            # queue there is past the slack.
            home = np.flatnonzero(c.worker_id == self._sessions[key])
            among = near.copy()
            if len(home):
                h = home[0]
                among[h] = False
                if near[h]:
                    held = self._held_per_speed(c, near)
                    among &= (cost <= cost[h]) & (held < held[h])
                    if not among.any():
                        return int(h)
                    return first_min((held, *keys), among)
            return self._fewest_sessions(c, among, keys)
        tied = (
            (cost == cost[best]) & (c.hit_tokens == c.hit_tokens[best]) & (c.load == c.load[best])
        )
        if np.count_nonzero(tied) > 1:
            return self._fewest_sessions(c, tied, (c.order,))
        return best

    def _held_per_speed(self, c: Candidates, among: np.ndarray) -> np.ndarray:
        """The sessions this policy placed on each of `among`, per unit of its speed (0 for
        the other candidates: a decision reads only those it chooses from)."""
        held = np.zeros(len(c))
        at = np.flatnonzero(among)
        held[at] = [self._held[w] for w in c.worker_id[at]]
        return held / c.speed

    def _fewest_sessions(self, c: Candidates, among: np.ndarray, keys: Sequence[np.ndarray]) -> int:
        """Of `among`, the one holding the fewest placed sessions per unit of speed, then by
        `keys`."""
        return first_min((self._held_per_speed(c, among), *keys), among)

    def placed(self, request: RouteRequest, chosen: Candidate) -> None:
        key = request.session_key
        if key is None:
            return
        before = self._sessions.pop(key, None)
        if before is not None:
            self._release(before)
        self._sessions[key] = chosen.worker_id
        self._held[chosen.worker_id] += 1
        if len(self._sessions) > SESSION_MEMORY:
            self._release(self._sessions.popitem(last=False)[1])

    def _release(self, worker_id: str) -> None:
        self._held[worker_id] -= 1
        if not self._held[worker_id]:
            del self._held[worker_id]

    def hold(self, request: RouteRequest, chosen: Candidate, waiting: Candidates) -> bool:
        """Wait while a faster worker that lacks room now is cheaper than `chosen` even
        before its wait for room: its decodes free KV as they finish, and the next report
        that shows room places the request there (or `chosen` has become the cheapest by
        then). Only for a faster one: a slower worker frees its room slower, and a burst
        that only the slow worker has room for would queue up behind itself there."""
        cost, speed = _ttft(request, chosen), chosen.speed * HOLD_SPEEDUP
        return bool(np.any((waiting.speed >= speed) & (_ttft(request, waiting) < cost)))


def _uncached(request: RouteRequest, c: Candidate | Candidates) -> Any:
    """The prompt tokens a worker would compute (and write KV for): the prompt less its hit."""
    return len(request.token_ids) - c.hit_tokens


def _ttft(request: RouteRequest, c: Candidate | Candidates) -> Any:
    """The `ttft` policy's cost: the work before the first token (the queued prefill, the
    running decodes' step, the uncached prompt), in prompt tokens, over the speed (one
    figure for a `Candidate`, an array for `Candidates`)."""
    work = c.queued_prefill_tokens + c.decode_tokens + _uncached(request, c)
    return work / c.speed


class RoundRobinPolicy(Policy):
    """The next worker in add order after the previous choice that fits."""

    name = "round_robin"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._next_order = 0

    def pick(self, request: RouteRequest, candidates: Candidates) -> int:
        later = np.flatnonzero(candidates.order >= self._next_order)
        chosen = int(later[0]) if later.size else 0
        self._next_order = int(candidates.order[chosen]) + 1
        return chosen


class LeastLoadPolicy(Policy):
    """Lowest load (ties: longer hit, then add order)."""

    name = "least_load"

    def pick(self, request: RouteRequest, candidates: Candidates) -> int:
        return _least_loaded(candidates)


class PowerOfTwoPolicy(Policy):
    """The less loaded of two candidates drawn at random (seeded by `config.seed`)."""

    name = "power_of_two"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._rng = random.Random(config.seed)

    def pick(self, request: RouteRequest, candidates: Candidates) -> int:
        if len(candidates) == 1:
            return 0
        pair = np.array(self._rng.sample(range(len(candidates)), 2))
        c = candidates
        return int(pair[first_min((c.load[pair], -c.hit_tokens[pair], c.order[pair]))])


class SessionPolicy(Policy):
    """Consistent hashing on `session_key`: rendezvous (highest random weight) hashing, so a
    session stays on its worker while that worker fits, and adding or removing a worker moves
    only the sessions that hash to it. Without a session key: least load."""

    name = "session"

    def pick(self, request: RouteRequest, candidates: Candidates) -> int:
        key = request.session_key
        if key is None:
            return _least_loaded(candidates)
        ids = candidates.worker_id
        return max(range(len(ids)), key=lambda i: _weight(key, str(ids[i])))


def _least_loaded(c: Candidates) -> int:
    """Lowest load (ties: longer hit, then add order)."""
    return first_min((c.load, -c.hit_tokens, c.order))


def _weight(session_key: str, worker_id: str) -> int:
    data = f"{len(session_key)}:{session_key}{worker_id}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        PrefixPolicy,
        TTFTPolicy,
        RoundRobinPolicy,
        LeastLoadPolicy,
        PowerOfTwoPolicy,
        SessionPolicy,
    )
}
"""Routing policies by name (`RouterConfig.policy`)."""
