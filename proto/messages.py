"""Messages between a worker and the router: plain dataclasses, standard library only.

Both `swaserve.worker` and `swaserve.router` import this module; neither imports the other
(architecture §3). Over the network (gRPC `GetLoad`) the same fields travel as protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Headroom:
    """What a worker can still take, in tokens of each pool, plus its queue and cache counters.

    "free" slots are unallocated; "evictable" slots hold prefix-cache KV that no running request
    locks (the worker frees them on demand); "protected" slots hold cache KV locked by running
    requests. In single-pool mode (`hybrid=False`) the SWA fields mirror the full ones.
    """

    full_total_tokens: int
    full_free_tokens: int
    full_evictable_tokens: int
    swa_total_tokens: int
    swa_free_tokens: int
    swa_evictable_tokens: int
    num_running: int
    num_waiting: int
    full_protected_tokens: int = 0
    swa_protected_tokens: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens of waiting requests not yet prefilled
    prefilling_tokens: int = 0  # prompt tokens admitted requests have still to compute
    full_reserved_tokens: int = 0  # full tokens promised to running requests' decode still to come
    swa_reserved_tokens: int = 0  # SWA tokens promised to running requests (to W + I + P each)
    prompt_tokens_total: int = 0  # counters since start: prompt tokens admitted ...
    cached_tokens_total: int = 0  # ... and how many of them came from the prefix cache
    window_repair_tokens_total: int = 0  # ... tokens recomputed to repair cached windows
    prefill_tokens_total: int = 0  # ... prompt tokens the model computed (prefill chunks) ...
    prefill_s_total: float = 0.0  # ... and the forward seconds of the steps that computed them
    decode_steps_total: int = 0  # ... steps that only decoded ...
    decode_s_total: float = 0.0  # ... and their seconds (a first token waits for one step)
    spec_verifies_total: int = 0  # ... a decode's verify of its drafts (speculative decoding) ...
    spec_draft_tokens_total: int = 0  # ... drafts proposed ...
    spec_accepted_tokens_total: int = 0  # ... and accepted
    spec_method: str = ""  # the drafter of those counters ("ngram", "mtp"); "": none
    sliding_window_size: int = 0
    attention_chunk_size: int = 0  # C of chunked local layers (W = C - 1); 0: a sliding window
    window_repair_tokens: int = 0  # R of a window repair (architecture §6); 0: it does not repair
    page_size: int = 1
    chunked_prefill_size: int = 0
    hybrid: bool = True

    @property
    def full_available_tokens(self) -> int:
        return self.full_free_tokens + self.full_evictable_tokens

    @property
    def swa_available_tokens(self) -> int:
        return self.swa_free_tokens + self.swa_evictable_tokens


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """One periodic report of a worker's rank 0 to the router.

    `instance_id` changes when the worker restarts (its cache is then empty); `seq` counts an
    instance's reports from 1, so a lost report is detected. `events` are the KV cache events
    since the previous report, in order. `timestamp_s` is the worker's clock when it was made:
    informational only (the router times reports by its own clock at receipt).

    `admitted_request_ids`: the requests the engine took since the previous report, so the
    router knows exactly which of the requests it routed this report already counts.

    `snapshot=True`: the router asked for a resync (`Router.update` answered True). `events`
    are then `KVCleared` and the whole cache as `KVStored` events, parents before children
    (what the event stream so far would have built), and `admitted_request_ids` lists every
    request open on the worker. The events after it continue from the snapshot.
    """

    worker_id: str
    instance_id: str
    seq: int
    timestamp_s: float
    headroom: Headroom
    events: list[Any] = field(default_factory=list)
    admitted_request_ids: tuple[str, ...] = ()
    snapshot: bool = False
