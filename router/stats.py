"""RouterStats: plain counters of a router since it started (the cluster exports them)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class RouterStats:
    """`decisions[(policy, outcome)]`: outcomes are "routed", "queued", "expired" and
    "overloaded"; a request queued and later routed counts once as each. Prompt tokens
    and predicted hit tokens (those a hit saves, `RouteDecision.predicted_hit_tokens`) are
    summed over routed requests. Queue waits are those of requests that left the
    queue (routed or expired); `queue_len` is the current length."""

    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)
    prompt_tokens: int = 0
    predicted_hit_tokens: int = 0
    queue_len: int = 0
    queue_wait_s_total: float = 0.0
    queue_wait_s_max: float = 0.0
    queue_waits: int = 0
    stale_skips: int = 0  # (route attempt, worker) pairs skipped for a stale or missing report
    reports: int = 0
    lost_reports: int = 0  # sequence gaps of an instance
    out_of_order_reports: int = 0  # older than the latest one: ignored
    restarts: int = 0  # a new instance_id: the worker's view was dropped
    event_mismatches: int = 0  # KV events that did not fit the exact view
    resyncs_requested: int = 0  # a worker fell out of sync (gap, or a start this router missed)
    snapshots: int = 0  # snapshot reports applied (each replaces a worker's exact view)

    def record_wait(self, waited_s: float) -> None:
        self.queue_wait_s_total += waited_s
        self.queue_wait_s_max = max(self.queue_wait_s_max, waited_s)
        self.queue_waits += 1
