"""What `Router.route` and `Router.poll` answer (`RouteDecision`), and `Overloaded`."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Outcome(enum.StrEnum):
    ROUTED = "routed"  # send the request to `worker_id` now
    QUEUED = "queued"  # no worker fits yet: it waits in the router; `poll()` answers later
    EXPIRED = "expired"  # its deadline passed while queued: fail it (RESOURCE_EXHAUSTED)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """`worker_id` is set exactly when `outcome` is ROUTED; `predicted_hit_tokens`: prompt
    tokens the worker's prefix cache should save it from computing (its `cached_tokens`; a
    repaired hit: the match less R); `queued_s`: time spent in the queue."""

    request_id: str
    outcome: Outcome
    worker_id: str | None = None
    policy: str = ""
    predicted_hit_tokens: int = 0
    queued_s: float = 0.0


class Overloaded(Exception):
    """No worker has room for the request and the router's queue is full."""

    def __init__(self, request_id: str, queue_len: int) -> None:
        super().__init__(
            f"request {request_id!r}: no worker has KV headroom and the queue is full "
            f"({queue_len} waiting)"
        )
        self.request_id = request_id
        self.queue_len = queue_len
