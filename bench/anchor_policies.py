"""The routing rules of the routers a team would compare ours with, as baselines for
`bench/router_sim.py` (not for production use). Each sees only what its router sees:

- `SGLangCacheAware`: SGLang's gateway `cache_aware` policy (sgl-router
  `src/policies/cache_aware.rs`, `src/tree.rs`). One approximate tree of the request texts
  it sent, per worker; loads are its own counts of requests in flight. Imbalanced when
  `max − min > balance_abs (64)` and `max > min × balance_rel (1.5)`: least loaded. Else the
  longest match in the tree; its rate (matched / text length) above `cache_threshold (0.3)`
  sends the request to the most recently used worker at the deepest node reached, otherwise
  to the worker whose tree holds the fewest characters. Either way the text is inserted
  under the chosen worker.
- `RayPrefixAffinity`: Ray Serve's `PrefixCacheAffinityRouter` (ray.llm
  `request_router/prefix_aware/`). Queue lengths are the replicas' requests in flight.
  Imbalanced when `max − min > imbalanced_threshold (10)`: power of two choices. Else the
  longest match among the candidates' texts; a rate below `match_rate_threshold (0.1)`
  picks the tenants with the fewest characters, otherwise the tenants at the deepest node
  reached; of those, the shortest queue. The prompt is inserted when the request is routed.
- `ExactKVRouter`: an exact KV-event router for full-attention models (Dynamo's KV router;
  llm-d's precise prefix scorer is alike): the workers' KV events, matched without the
  window rule, so a tombstoned page counts as a hit. Cost per worker, lower is better
  (`overlap_score_weight` 1, temperature 0):
      (prefill tokens it has in flight + prompt − overlap) / P + blocks it would hold
  where prefill tokens leave at the request's first token and blocks at its finish.

Texts are token ids here, one id per character (the sim's tokens are ids); the match rates
are ratios, so the thresholds mean what they mean on text. Neither tree evicts: SGLang's cap
(2^26 characters per worker) and Ray's (off by default) are far above what a run inserts.

Each router offers what `router_sim.Simulation` calls: `route`, `poll` (nothing ever
queues: the worker queues what it cannot take yet), `finish`, `update(report)`, and
`prefilled(request_id)` at the first token.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from swaserve.proto.messages import WorkerReport
from swaserve.router import ExactCacheView, Outcome, RouteDecision

CHUNK = 16  # tree node width in ids (a node holds up to CHUNK ids; matches are per id)


@dataclass(eq=False, slots=True)
class _TreeNode:
    key: tuple[int, ...]
    children: dict[tuple[int, ...], _TreeNode] = field(default_factory=dict)
    last_access: dict[str, float] = field(default_factory=dict)  # tenant -> time


class TextTree:
    """A multi-tenant prefix tree of sent texts (the approximate tree of SGLang and Ray).
    Nodes hold up to `CHUNK` ids; a match may end inside a node (a partial match reaches
    that node, as both trees' `prefix_match` does)."""

    def __init__(self, tenants: Sequence[str]) -> None:
        self.root = _TreeNode(())
        self.chars = dict.fromkeys(tenants, 0)
        for t in tenants:
            self.root.last_access[t] = 0.0

    def insert(self, text: Sequence[int], tenant: str, now: float) -> None:
        node = self.root
        node.last_access[tenant] = now
        for start in range(0, len(text), CHUNK):
            key = tuple(text[start : start + CHUNK])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _TreeNode(key)
            if tenant not in child.last_access:
                self.chars[tenant] += len(key)
            child.last_access[tenant] = now
            node = child

    def match(
        self, text: Sequence[int], tenants: Sequence[str] | None = None
    ) -> tuple[int, _TreeNode]:
        """(matched ids, deepest node reached). With `tenants`, the walk only enters nodes
        one of them holds (Ray); without, any node (SGLang)."""
        node, matched = self.root, 0
        while matched < len(text):
            key = tuple(text[matched : matched + CHUNK])
            child = node.children.get(key)
            if child is not None and _held(child, tenants):
                node, matched = child, matched + len(key)
                if len(key) < CHUNK:
                    break
                continue
            best, best_len = None, 0  # a partial match inside a child
            for k, c in node.children.items():
                n = _common(k, key)
                if n > best_len and _held(c, tenants):
                    best, best_len = c, n
            if best is not None:
                node, matched = best, matched + best_len
            break
        return matched, node

    def smallest(self, tenants: Sequence[str] | None = None) -> list[str]:
        pool = list(self.chars) if tenants is None else [t for t in tenants if t in self.chars]
        least = min(self.chars[t] for t in pool)
        return [t for t in pool if self.chars[t] == least]


def _held(node: _TreeNode, tenants: Sequence[str] | None) -> bool:
    return tenants is None or any(t in node.last_access for t in tenants)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class _Config:
    queue_timeout_s: float = 30.0


class AnchorRouter:
    """What the simulation needs of a front end; `choose` is the rule."""

    name: ClassVar[str]

    def __init__(
        self, worker_ids: Sequence[str], clock: Callable[[], float], seed: int = 0
    ) -> None:
        self.worker_ids = list(worker_ids)
        self.clock = clock
        self.config = _Config()
        self.rng = random.Random(seed)
        self.inflight = dict.fromkeys(self.worker_ids, 0)
        self._owner: dict[str, str] = {}

    def route(
        self,
        request_id: str,
        token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        session_key: str | None = None,
    ) -> RouteDecision:
        worker, predicted = self.choose(request_id, token_ids)
        self.inflight[worker] += 1
        self._owner[request_id] = worker
        return RouteDecision(request_id, Outcome.ROUTED, worker, self.name, predicted)

    def choose(self, request_id: str, token_ids: Sequence[int]) -> tuple[str, int]:
        """(worker, the prompt tokens it believes that worker has cached)."""
        raise NotImplementedError

    def poll(self) -> list[RouteDecision]:
        return []

    def finish(self, request_id: str) -> bool:
        worker = self._owner.pop(request_id, None)
        if worker is None:
            return False
        self.inflight[worker] -= 1
        return True

    def update(self, report: WorkerReport) -> bool:
        return False

    def prefilled(self, request_id: str) -> None:
        """The request's first token came back."""


class TextTreeRouter(AnchorRouter):
    """An anchor that knows only what it sent: its own approximate tree of routed prompts."""

    def __init__(
        self, worker_ids: Sequence[str], clock: Callable[[], float], seed: int = 0
    ) -> None:
        super().__init__(worker_ids, clock, seed)
        self.tree = TextTree(self.worker_ids)


class SGLangCacheAware(TextTreeRouter):
    name = "sglang_cache_aware"
    cache_threshold = 0.3
    balance_abs_threshold = 64
    balance_rel_threshold = 1.5

    def choose(self, request_id: str, token_ids: Sequence[int]) -> tuple[str, int]:
        loads = [self.inflight[w] for w in self.worker_ids]
        most, least = max(loads), min(loads)
        now = self.clock()
        matched, node = self.tree.match(token_ids)
        if most - least > self.balance_abs_threshold and most > least * self.balance_rel_threshold:
            worker = min(self.worker_ids, key=lambda w: self.inflight[w])
        elif matched / len(token_ids) > self.cache_threshold:
            worker = max(node.last_access, key=lambda t: node.last_access[t])
        else:
            worker = self.tree.smallest()[0]
        believed = self.tree.match(token_ids, [worker])[0]
        self.tree.insert(token_ids, worker, now)
        return worker, believed


class RayPrefixAffinity(TextTreeRouter):
    name = "ray_prefix_affinity"
    imbalanced_threshold = 10
    match_rate_threshold = 0.1

    def choose(self, request_id: str, token_ids: Sequence[int]) -> tuple[str, int]:
        queue = self.inflight
        matched, node = self.tree.match(token_ids, self.worker_ids)
        if max(queue.values()) - min(queue.values()) > self.imbalanced_threshold:
            pair = (
                self.rng.sample(self.worker_ids, 2) if len(self.worker_ids) > 1 else self.worker_ids
            )
            chosen = pair
        elif matched / len(token_ids) < self.match_rate_threshold:
            chosen = self.tree.smallest()
        else:
            chosen = [w for w in self.worker_ids if w in node.last_access]
        shortest = min(queue[w] for w in chosen)
        worker = self.rng.choice([w for w in chosen if queue[w] == shortest])
        believed = self.tree.match(token_ids, [worker])[0]
        self.tree.insert(token_ids, worker, self.clock())
        return worker, believed


class ExactKVRouter(AnchorRouter):
    name = "exact_kv"
    overlap_score_weight = 1.0

    def __init__(
        self, worker_ids: Sequence[str], clock: Callable[[], float], seed: int = 0
    ) -> None:
        super().__init__(worker_ids, clock, seed)
        self.bit = {w: i for i, w in enumerate(self.worker_ids)}
        self.view: ExactCacheView | None = None
        self.page_size = 1
        self.prefill_tokens = dict.fromkeys(self.worker_ids, 0)
        self.blocks = dict.fromkeys(self.worker_ids, 0)
        self._active: dict[str, tuple[str, int, int]] = {}  # id -> (worker, prefill, blocks)

    def update(self, report: WorkerReport) -> bool:
        if self.view is None:
            self.page_size = report.headroom.page_size
            self.view = ExactCacheView(self.page_size)
        self.view.apply(self.bit[report.worker_id], report.events)
        return False

    def choose(self, request_id: str, token_ids: Sequence[int]) -> tuple[str, int]:
        p, n = self.page_size, len(token_ids)
        windows = {b: 0 for b in self.bit.values()}  # no window rule: tombstones are hits
        overlap = self.view.match(token_ids[:-1], windows) if self.view is not None else {}
        blocks = -(-n // p)
        cost = {}
        for w in self.worker_ids:
            new = n - overlap.get(self.bit[w], 0)
            cost[w] = self.overlap_score_weight * (self.prefill_tokens[w] + new) / p + (
                self.blocks[w] + blocks
            )
        best = min(cost.values())
        worker = self.rng.choice([w for w in self.worker_ids if cost[w] == best])
        hit = overlap.get(self.bit[worker], 0)
        self.prefill_tokens[worker] += n - hit
        self.blocks[worker] += blocks
        self._active[request_id] = (worker, n - hit, blocks)
        return worker, hit

    def prefilled(self, request_id: str) -> None:
        worker, prefill, blocks = self._active[request_id]
        self.prefill_tokens[worker] -= prefill
        self._active[request_id] = (worker, 0, blocks)

    def finish(self, request_id: str) -> bool:
        active = self._active.pop(request_id, None)
        if active is not None:
            worker, prefill, blocks = active
            self.prefill_tokens[worker] -= prefill
            self.blocks[worker] -= blocks
        return super().finish(request_id)


ANCHORS: dict[str, type[AnchorRouter]] = {
    cls.name: cls for cls in (SGLangCacheAware, RayPrefixAffinity, ExactKVRouter)
}
"""The anchors' rules by name (baseline policies of `bench/router_sim.py`)."""
