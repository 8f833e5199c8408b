"""Prometheus metrics of a serving cluster (prometheus-client), named as SGLang / vLLM users
know them, with labels `model_name` and `worker`.

Three sources, one registry per ingress process:

- per request, measured in the ingress (gRPC and HTTP alike): time to first token,
  inter-token latency, end-to-end latency (histograms), and where the first token's time went
  (`watch(cluster)`: the `RoutedCluster`'s `TTFTBreakdown` of each request, in four parts:
  routing, the engine's queue, prefill, and the transport between them);
- per worker, read at scrape time from the router's view (`Cluster.load()`: each worker's last
  headroom report) and the router's own counters (`Cluster.router_stats()`): running and
  waiting requests, full and SWA pool usage, prefix-cache queries and hits (tokens), tombstoned
  tokens, speculative decoding's drafts, draft tokens and accepted tokens (vLLM's
  `spec_decode_*` names), and routing decisions by policy and outcome;
- the ingress's cluster's fault counters: requests migrated mid-stream, worker groups recreated,
  requests refused by their client's rate or open-request limit (`IngressLimits`).

`await metrics.render(cluster)` refreshes the second part and returns the text exposition.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from swaserve.cluster.routed import RoutedCluster, TTFTBreakdown
    from swaserve.cluster.router_actor import WorkerStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "swaserve:"
LATENCY_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TTFT_PARTS = {  # where a first token's time went (`TTFTBreakdown`); they add up to it
    "route": "time from asking the router to its answer: its decision and its admission queue",
    "queue": "time a request waited in its worker's engine queue before it was admitted",
    "prefill": "time from a request's admission to its first token: the steps that computed "
    "its prompt",
    "transport": "the rest of the time to first token: to the worker and back, and the wait "
    "for its engine loop to take the request (the step under way)",
}
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


def tombstoned_tokens(headroom: Any) -> int:
    """Tokens the prefix cache holds with full KV but no SWA KV any more (tombstones)."""
    full = headroom.full_evictable_tokens + headroom.full_protected_tokens
    swa = headroom.swa_evictable_tokens + headroom.swa_protected_tokens
    return max(0, full - swa) if headroom.hybrid else 0


class ClusterSnapshotCollector(Collector):
    """Yields the per-worker and router metrics of the last `update` (a scrape refreshes it)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.workers: list[WorkerStatus] = []
        self.router: dict[str, Any] = {}
        self.faults: dict[str, int] = {}

    def update(
        self,
        workers: list[WorkerStatus],
        router: dict[str, Any],
        faults: dict[str, int] | None = None,
    ) -> None:
        self.workers, self.router, self.faults = workers, router, faults or {}

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "worker"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, labels=labels)

        running = gauge("num_requests_running", "requests running on the worker")
        waiting = gauge("num_requests_waiting", "requests waiting on the worker")
        usage = gauge("token_usage", "full pool: share of tokens neither free nor evictable")
        swa_usage = gauge("swa_token_usage", "SWA pool: share of tokens neither free nor evictable")
        tombstoned = gauge("swa_tombstoned_tokens", "cached tokens whose SWA KV was freed")
        queries = CounterMetricFamily(
            PREFIX + "prefix_cache_queries",
            "prompt tokens looked up in the prefix cache",
            labels=labels,
        )
        hits = CounterMetricFamily(
            PREFIX + "prefix_cache_hits",
            "prompt tokens served from the prefix cache (a repaired hit counts its match less R)",
            labels=labels,
        )
        repairs = CounterMetricFamily(
            PREFIX + "window_repair_tokens",
            "prompt tokens recomputed to repair the SWA window of a cached prefix",
            labels=labels,
        )
        prefill_tokens = CounterMetricFamily(
            PREFIX + "prefill_tokens",
            "prompt tokens the model computed (with the prefill timed at start)",
            labels=labels,
        )
        prefill_seconds = CounterMetricFamily(
            PREFIX + "prefill_seconds",
            "seconds of the steps that computed them: tokens / seconds is the prefill speed",
            labels=labels,
        )
        spec = {  # by drafter too: "ngram", "mtp" ("none" on a worker without one)
            name: CounterMetricFamily(PREFIX + name, doc, labels=[*labels, "method"])
            for name, doc in (
                ("spec_decode_num_drafts", "verifies of a request's drafts (one per step)"),
                ("spec_decode_num_draft_tokens", "draft tokens proposed and verified"),
                ("spec_decode_num_accepted_tokens", "draft tokens the target accepted"),
            )
        }
        for status in self.workers:
            h = status.headroom
            if h is None:
                continue
            values = [self.model_name, status.worker_id]
            running.add_metric(values, h.num_running)
            waiting.add_metric(values, h.num_waiting)
            usage.add_metric(values, _used_share(h.full_available_tokens, h.full_total_tokens))
            swa_usage.add_metric(values, _used_share(h.swa_available_tokens, h.swa_total_tokens))
            tombstoned.add_metric(values, tombstoned_tokens(h))
            queries.add_metric(values, h.prompt_tokens_total)
            hits.add_metric(values, h.cached_tokens_total)
            repairs.add_metric(values, h.window_repair_tokens_total)
            prefill_tokens.add_metric(values, h.prefill_tokens_total)
            prefill_seconds.add_metric(values, h.prefill_s_total)
            drafter = [*values, h.spec_method or "none"]
            spec["spec_decode_num_drafts"].add_metric(drafter, h.spec_verifies_total)
            spec["spec_decode_num_draft_tokens"].add_metric(drafter, h.spec_draft_tokens_total)
            spec["spec_decode_num_accepted_tokens"].add_metric(
                drafter, h.spec_accepted_tokens_total
            )
        yield from (running, waiting, usage, swa_usage, tombstoned, queries, hits, repairs)
        yield from (prefill_tokens, prefill_seconds, *spec.values())
        decisions = CounterMetricFamily(
            PREFIX + "router_decisions",
            "routing decisions by policy and outcome (routed, queued, expired, overloaded)",
            labels=["model_name", "policy", "outcome"],
        )
        for key, count in sorted(self.router.get("decisions", {}).items()):
            policy, outcome = key.split("/", 1)
            decisions.add_metric([self.model_name, policy, outcome], count)
        yield decisions
        queue = GaugeMetricFamily(
            PREFIX + "router_queue_len", "requests waiting in the router", labels=["model_name"]
        )
        queue.add_metric([self.model_name], self.router.get("queue_len", 0))
        yield queue
        for key, name, doc in (
            ("migrations", "request_migrations", "requests moved to another worker mid-stream"),
            ("recreated", "worker_groups_recreated", "lost worker groups recreated"),
        ):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], self.faults.get(key, 0))
            yield family
        limited = CounterMetricFamily(
            PREFIX + "requests_rate_limited",
            "requests refused because their client was over its rate or open-request limit",
            labels=["model_name", "reason"],
        )
        for reason in ("rate", "concurrency"):
            limited.add_metric([self.model_name, reason], self.faults.get(f"limited_{reason}", 0))
        yield limited


def _used_share(available: int, total: int) -> float:
    return 1.0 - available / total if total else 0.0


class ServingMetrics:
    """The registry of one ingress process and its request histograms."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name,
                doc,
                ["model_name", "worker"],
                buckets=buckets,
                registry=self.registry,
            )

        self.ttft = histogram(
            "time_to_first_token_seconds",
            "time from request arrival to its first token",
            LATENCY_BUCKETS_S,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "time between two tokens of a request's stream",
            LATENCY_BUCKETS_S,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "time from request arrival to its last token",
            E2E_BUCKETS_S,
        )
        # The parts of the first token's time (`TTFTBreakdown`), vLLM's queue and prefill times
        # among them: `swaserve:request_<part>_time_seconds`.
        self.ttft_parts = {
            part: histogram(f"request_{part}_time_seconds", doc, LATENCY_BUCKETS_S)
            for part, doc in TTFT_PARTS.items()
        }
        self.snapshot = ClusterSnapshotCollector(model_name)
        self.registry.register(self.snapshot)

    def watch(self, cluster: RoutedCluster) -> None:
        """Record where each first token of `cluster` went. Idempotent: the ingresses of one
        process (gRPC and HTTP) share a registry and both call it; a cluster reports to one
        registry, the last that watched it."""
        cluster.on_ttft_breakdown = self.observe_ttft_parts

    def observe_ttft_parts(self, breakdown: TTFTBreakdown) -> None:
        """One request's `TTFTBreakdown`: its route, and the worker's parts when it sent them."""
        seconds = {"route": breakdown.route_s}
        timings, transport_s = breakdown.worker, breakdown.transport_s
        if timings is not None and transport_s is not None:
            seconds |= {
                "queue": timings.queued_s,
                "prefill": timings.prefill_s,
                "transport": max(0.0, transport_s),
            }
        for part, value in seconds.items():
            self.ttft_parts[part].labels(self.model_name, breakdown.worker_id).observe(value)

    def tracker(self, arrival_s: float) -> RequestTimer:
        return RequestTimer(self, arrival_s)

    async def render(self, cluster: Any) -> bytes:
        """Refresh the per-worker part from the cluster, then the text exposition."""
        faults = {"migrations": cluster.migrations, "recreated": getattr(cluster, "recreated", 0)}
        clients = getattr(cluster, "clients", None)  # a RoutedCluster's ClientLimiter
        if clients is not None:
            faults |= {f"limited_{k}": v for k, v in clients.refused.items()}
        self.snapshot.update(await cluster.load(), await cluster.router_stats(), faults)
        return generate_latest(self.registry)


class RequestTimer:
    """Feeds one request's stream into the histograms: `tokens(n, worker, now)` per chunk,
    `finish(now)` at the end (a request that produced no token records only its e2e). Every
    token after a request's first is one inter-token sample, however the stream merged them
    into chunks (a busy ingress reads several at once): a request of N tokens gives N - 1."""

    def __init__(self, metrics: ServingMetrics, arrival_s: float) -> None:
        self.metrics = metrics
        self.arrival_s = arrival_s
        self.worker = ""
        self._last_s: float | None = None

    def tokens(self, num_tokens: int, worker: str, now_s: float) -> None:
        if num_tokens <= 0:
            return
        self.worker = worker
        labels = (self.metrics.model_name, worker)
        histogram = self.metrics.itl.labels(*labels)
        if self._last_s is None:
            self.metrics.ttft.labels(*labels).observe(now_s - self.arrival_s)
            for _ in range(num_tokens - 1):  # came with the first token: no gap seen
                histogram.observe(0.0)
        else:
            # a chunk of n tokens after a gap: n tokens at gap / n each (a merged chunk)
            gap = (now_s - self._last_s) / num_tokens
            for _ in range(num_tokens):
                histogram.observe(gap)
        self._last_s = now_s

    def finish(self, now_s: float) -> None:
        self.metrics.e2e.labels(self.metrics.model_name, self.worker).observe(
            now_s - self.arrival_s
        )
