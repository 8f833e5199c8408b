"""Routing policies: which of the workers that fit a request gets it. A registry (`POLICIES`,
name → class) so that the config names one.

The router hands a policy only the workers that are fresh and have room for the request
(`Candidate`s, in the order the workers were added, never empty); the policy only chooses.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from swaserve.router.config import RouterConfig


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker that can take the request now. `order`: its rank among the workers by
    `add_worker` order (stable tie-break); `load`: its requests (running, waiting, in flight);
    `hit_tokens`: prompt tokens its prefix cache saves it from computing (a repaired hit:
    its match less the tokens the repair recomputes); `queued_prefill_tokens`: prompt tokens
    it has still to prefill before this request, as far as the router knows: the waiting
    prompts of its last report plus the uncached tokens of the requests routed to it since
    (not listed by a report yet); `speed`: its observed seconds per generated token over the
    fastest worker's, inverted (1.0: as fast as the fastest, or not observed yet);
    `free_tokens`: the unallocated full-pool KV slots of its last report: room it can fill
    without evicting cached prefixes (not less what was routed since: that is in
    `queued_prefill_tokens`, and subtracting it too lowered the chat trace's reuse), of
    `total_tokens` in its full pool."""

    worker_id: str
    order: int
    load: int
    hit_tokens: int
    queued_prefill_tokens: int = 0
    speed: float = 1.0
    free_tokens: int = 0
    total_tokens: int = 0


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
    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        """Pick one of `candidates` (non-empty). May update the policy's own state only."""

    def hold(self, request: RouteRequest, chosen: Candidate, waiting: Sequence[Candidate]) -> bool:
        """Keep the request in the router's queue rather than send it to `chosen`, because
        one of `waiting` (fresh workers that do not fit it now but would when idle) is
        expected to serve it sooner once it has room. A query; default: never."""
        return False


class PrefixPolicy(Policy):
    """Most reusable tokens among the near-least-loaded workers.

    SGLang's cache-aware gate calls the cluster imbalanced when `max - least > abs` and
    `max > least × rel`, and then drops affinity altogether (least loaded wins). Here a worker
    is eligible exactly when it alone would not trip that gate, `load <= max(least + abs,
    least × rel)`, and the eligible worker with the longest hit wins (ties: lower load, then
    add order). A balanced cluster keeps full affinity; an imbalanced one keeps it among the
    workers close to the least loaded.
    """

    name = "prefix"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        least = min(c.load for c in candidates)
        limit = max(
            least + self.config.balance_abs_threshold, least * self.config.balance_rel_threshold
        )
        eligible = [c for c in candidates if c.load <= limit]
        return max(eligible, key=lambda c: (c.hit_tokens, -c.load, -c.order))


BALANCE_FREE_SHARE = 0.5
"""`ttft` weighs memory only when the cheapest worker's full pool is less than this share free:
below it, new KV soon evicts cached histories there; above it, moving a request to a freer
worker only scatters sessions (on bench/cluster_load.py's small cluster, where no pool fills,
weighing memory always moved 62-80 % of the turns and cut reuse from 0.84 to 0.70-0.73). On
bench/router_sim.py's chat trace 0.5 keeps reuse at 0.84-0.88 (0.25: 0.79-0.87, 0.75:
0.83-0.84)."""

HOLD_SPEEDUP = 1.25
"""How much faster than the chosen worker one without room must be for `ttft` to wait for it
(observed speeds of alike workers differ by a few percent)."""


class TTFTPolicy(Policy):
    """Least predicted time to first token: a worker prefills its queue in order at its own
    speed, so this request's first token waits for the tokens queued before it plus its own
    uncached ones,

        cost = (queued_prefill_tokens + len(prompt) − hit_tokens) / speed

    Reuse counts only as the prefill it saves, so a long hit on a busy worker loses to a cold
    idle one once the queue there is longer than the hit. No balance gate: the queue is the
    load signal.

    Memory is the other thing a placement spends: KV written where the full pool is full
    evicts cached prefixes that later turns would have hit. So when the cheapest worker's pool
    is less than `BALANCE_FREE_SHARE` free, the workers whose cost is within
    `ttft_balance_tokens` of the cheapest are taken as equal for this request, and of those
    the one with the most free KV wins (ties: lower cost, longer hit, lower load, add
    order). New sessions and short histories then fill the emptiest pools, as SGLang's
    gateway sends low-match requests to its smallest tree, and long histories stay where
    they are cached (moving one costs more than the slack).
    """

    name = "ttft"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        costs = [(_ttft(request, c), -c.hit_tokens, c.load, c.order, c) for c in candidates]
        cost, *_, best = min(costs, key=lambda x: x[:4])
        if best.free_tokens >= BALANCE_FREE_SHARE * best.total_tokens:
            return best  # no memory pressure there: no reason to move
        limit = cost + self.config.ttft_balance_tokens
        near = [x for x in costs if x[0] <= limit]
        return min(near, key=lambda x: (-x[-1].free_tokens, *x[:4]))[-1]

    def hold(self, request: RouteRequest, chosen: Candidate, waiting: Sequence[Candidate]) -> bool:
        """Wait while a faster worker that lacks room now is cheaper than `chosen` even
        before its wait for room: its decodes free KV as they finish, and the next report
        that shows room places the request there (or `chosen` has become the cheapest by
        then). Only for a faster one: a slower worker frees its room slower, and a burst
        that only the slow worker has room for would queue up behind itself there."""
        cost, speed = _ttft(request, chosen), chosen.speed * HOLD_SPEEDUP
        return any(c.speed >= speed and _ttft(request, c) < cost for c in waiting)


def _ttft(request: RouteRequest, c: Candidate) -> float:
    """The `ttft` policy's cost: tokens to prefill before the first token, over the speed."""
    return (c.queued_prefill_tokens + len(request.token_ids) - c.hit_tokens) / c.speed


class RoundRobinPolicy(Policy):
    """The next worker in add order after the previous choice that fits."""

    name = "round_robin"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._next_order = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        chosen = next((c for c in candidates if c.order >= self._next_order), candidates[0])
        self._next_order = chosen.order + 1
        return chosen


class LeastLoadPolicy(Policy):
    """Lowest load (ties: longer hit, then add order)."""

    name = "least_load"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        return min(candidates, key=lambda c: (c.load, -c.hit_tokens, c.order))


class PowerOfTwoPolicy(Policy):
    """The less loaded of two candidates drawn at random (seeded by `config.seed`)."""

    name = "power_of_two"

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._rng = random.Random(config.seed)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        pair = self._rng.sample(list(candidates), 2)
        return min(pair, key=lambda c: (c.load, -c.hit_tokens, c.order))


class SessionPolicy(Policy):
    """Consistent hashing on `session_key`: rendezvous (highest random weight) hashing, so a
    session stays on its worker while that worker fits, and adding or removing a worker moves
    only the sessions that hash to it. Without a session key: least load."""

    name = "session"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate:
        key = request.session_key
        if key is None:
            return min(candidates, key=lambda c: (c.load, -c.hit_tokens, c.order))
        return max(candidates, key=lambda c: _weight(key, c.worker_id))


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
