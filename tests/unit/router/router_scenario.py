"""Small fixtures for router tests: a settable clock, roomy headroom, reports with their
sequence numbers, and KV events made from token lists."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from swaserve.proto.kv_events import KVEvent, KVStored, page_hashes
from swaserve.proto.messages import Headroom, WorkerReport
from swaserve.router import Router, RouterConfig

W, P = 4, 2  # window and page size of the scenario workers

ROOMY = Headroom(
    full_total_tokens=10_000,
    full_free_tokens=10_000,
    full_evictable_tokens=0,
    swa_total_tokens=10_000,
    swa_free_tokens=10_000,
    swa_evictable_tokens=0,
    num_running=0,
    num_waiting=0,
    sliding_window_size=W,
    page_size=P,
)


class Clock:
    """`clock()` returns `now`; tests move it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Cluster:
    """A router with a settable clock, and the reports of its workers (seq counted here)."""

    def __init__(self, *workers: str, kv_events: bool | None = None, **config: object) -> None:
        self.clock = Clock()
        self.router = Router(RouterConfig(**config), clock=self.clock)  # type: ignore[arg-type]
        self.seq: dict[str, int] = {}
        self.instance: dict[str, str] = {}
        for worker_id in workers:
            self.router.add_worker(worker_id, kv_events=kv_events)

    def report(
        self,
        worker_id: str,
        events: Sequence[KVEvent] = (),
        *,
        instance: str | None = None,
        skip: int = 0,
        admitted: Sequence[str] = (),
        snapshot: bool = False,
        timestamp_s: float = -1e6,
        **headroom: object,
    ) -> bool:
        """Send `worker_id`'s next report now (seq counted from 1): roomy headroom with
        `headroom` overrides; `instance` restarts the worker; `skip` loses that many reports
        before this one; `admitted`: the requests the worker took since its last report.
        The worker's own clock (`timestamp_s`) is far off the router's: the router must
        not read it. Returns the router's answer (True: send a snapshot)."""
        if instance is not None and instance != self.instance.get(worker_id):
            self.instance[worker_id], self.seq[worker_id] = instance, 0
        self.seq[worker_id] = self.seq.get(worker_id, 0) + 1 + skip
        return self.router.update(
            WorkerReport(
                worker_id,
                self.instance.setdefault(worker_id, "i0"),
                self.seq[worker_id],
                timestamp_s,
                replace(ROOMY, **headroom),  # type: ignore[arg-type]
                list(events),
                admitted_request_ids=tuple(admitted),
                snapshot=snapshot,
            )
        )


def stored(tokens: Sequence[int], parent: Sequence[int] = (), tombstone: bool = False) -> KVStored:
    """The event of storing the whole pages of `tokens` under the pages of `parent`."""
    parent_hash = page_hashes(parent, P)[-1] if parent else None
    hashes = page_hashes(tokens, P, parent_hash)
    return KVStored(tuple(hashes), parent_hash, tuple(tokens[: len(hashes) * P]), P, tombstone)


def pages_of(tokens: Sequence[int], first: int, last: int) -> tuple[int, ...]:
    """Hashes of pages `[first, last)` of `tokens` (chained from the root)."""
    return tuple(page_hashes(tokens, P)[first:last])
