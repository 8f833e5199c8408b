"""RouterConfig: every knob of the router, validated at the edge (architecture §5 router).

Defaults and why:

- `policy="ttft"`: send each request where its first token comes soonest, by the work ahead
  of it there (queued prefill, one step of the running decodes, its own uncached tokens) over
  the worker's speed; a hit counts as the prefill it saves. On bench/cluster_load.py (2
  workers, 5 and 12 chat clients; README, "On the real cluster") it has the lowest TTFT of our
  policies, and on bench/router_sim.py's fleet traces its median TTFT p99 is within 4 % of the best
  (docs/benchmarks.md). `prefix`, the default before, balanced by a request-count gate
  (SGLang's rule, `max(least + 4, 1.5 × least)` requests): with 5 clients on 2 workers it
  never tripped and one worker took 45-60 of the 60 turns, TTFT p50 1.3-2.3× round robin's.
- `report_timeout_s=5.0`: workers report every ~0.1-1 s; five seconds of silence means a dead or
  wedged worker, well before the client's own timeout.
- `max_queue_len=1024`, `queue_timeout_s=30.0`: bursts of a few seconds wait in the router
  rather than fail; past that the client is better served by `RESOURCE_EXHAUSTED` now.
- `max_hold_s=0.05`: `ttft` keeps a request in the queue rather than hand it to a worker at
  most 1/1.25 as fast as one that lacks room now but would serve it sooner (a fast worker's
  decodes free room within tens of ms under load); past 50 ms it takes the worker that has
  room. On bench/router_sim.py's agentic fan-out this keeps bursts off the slow worker
  (TTFT p99 469 → 320 ms at 0 ms reports, seed 0); waiting longer costs the skewed-tenant
  trace more than it gains (p99 120 / 133 / 128 ms at 0.05 / 0.1 / 0.2 s).
- `ttft_balance_tokens=1024`: when the cheapest worker's full pool is less than half free
  (`policies.BALANCE_FREE_SHARE`), `ttft` may send the request to a worker whose predicted
  prefill is within 1024 tokens of the cheapest where that spares at least as much cached KV
  from eviction as it recomputes (the one that evicts least, then the freest), so that new
  sessions fill the emptiest pools instead of evicting other sessions' histories. On
  bench/router_sim.py's chat trace (reports 100 ms late, one slow worker, seeds 0-2; with
  the earlier freest-pool rule) it lifted reuse from 0.75-0.80 to 0.84-0.88 and cut TTFT p99
  from 168-195 ms to 134-183. Without the pressure gate (tuned first): 0 (the cheapest
  alone) and 256 change little, 512 / 768 gain less or less evenly, and 1536 / 2048 / 4096
  give up too much of the hits (reuse 0.74 / 0.68 / 0.43). A slack relative to the cost
  (×1.2-1.5) does not help: it is the short requests, whose cost is small, that must be free
  to move. The same slack places a new session (a session key
  `ttft` has not placed) where the workers within it do not all hold the same prefix of its
  first request: the least loaded of them gets it (`policies.TTFTPolicy`). On
  bench/cluster_load.py's open loop (`--session-rate 3`, seeds 4242 and 9) that took the
  turns per worker from 83 / 37, 85 / 35, 46 / 74 and 11 / 109 to 53 / 67 - 64 / 56.
- `prefix_load_weight=1.0`: `prefix` adds to `ttft`'s cost the delay the request's own prefill
  adds to each request already on the worker (its uncached tokens × the worker's load ×
  the weight, over its speed). Three other rules were measured before it on the calibrated
  simulator (bench/cluster_sim.py) and bench/router_sim.py: the least cost within a slack,
  then the longest hit, needs a slack small enough to split 5 clients over 2 workers (128
  tokens) and then moves fleet sessions off their caches (chat reuse 0.80 → 0.66), or one
  large enough for the fleet (2048) and then puts every session of the small cluster on one
  worker; charging the cached tokens a worker lacks (× 1) kept the fleet's reuse but sent all
  60 turns of the 5-client cluster to one worker, which alone held the shared system prompt.
  With the load as the multiplier an idle worker costs only the request's own wait.
- `inflight_prefixes=True`: a prompt routed to an event-sending worker counts as that worker's
  hit until its report shows the prompt cached (`router/inflight_view.py`). SGLang's and Ray
  Serve's text trees insert a prompt when they route it, so they have this by construction;
  an exact view alone learns of a prefix a report later, and on bench/router_sim.py's
  agentic fan-out (reports 0-500 ms late) its predictions matched the workers' real hits for
  only 0.53-0.55 of requests, against 1.00 with the records.
- `cache_view="exact"`: the prefix view comes from the workers' KV events (`exact_view.py`);
  `"approx"` records the prompts routed to each worker instead (`approx_view.py`) and ignores
  the events: SGLang's cache_aware router works so, without knowing what a worker evicted.
- `approx_max_tokens=2**20`: the approximate view (workers without KV events) records at most
  ~1 M prompt tokens over all such workers, about the prefix cache of a few workers. It costs
  ~40 bytes per token at P = 16 (40 MB) and ~440 at P = 1 (440 MB), measured.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from swaserve.router.policies import POLICIES


class RouterConfig(BaseModel):
    """Router knobs (see the module docstring for the defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str = Field(
        "ttft",
        description="routing policy: one of POLICIES",
        json_schema_extra={"enum": sorted(POLICIES)},  # the chart's schema offers the registry
    )
    report_timeout_s: float = Field(5.0, gt=0, description="older reports take a worker out")
    max_queue_len: int = Field(1024, ge=0, description="queued requests before Overloaded")
    queue_timeout_s: float = Field(30.0, gt=0, description="default deadline of a queued request")
    cache_view: Literal["exact", "approx"] = Field(
        "exact",
        description="exact: mirror each worker's prefix cache from its KV events (tombstones, "
        "windows); approx: track only the prompts routed to each worker, as SGLang's "
        "cache_aware router does, and ignore the events",
    )
    approx_max_tokens: int = Field(1 << 20, ge=0, description="approximate view cap, all workers")
    seed: int = Field(0, description="seed of randomized policies (power_of_two)")
    max_hold_s: float = Field(0.05, ge=0, description="ttft: longest wait for a faster worker")
    ttft_balance_tokens: int = Field(
        1024,
        ge=0,
        description="ttft: prefill a placement may add to evict less cached KV (or, for a "
        "new session, to go to the least loaded worker)",
    )
    prefix_load_weight: float = Field(
        1.0,
        ge=0,
        description="prefix: weight of the delay a prefill adds to each request on its worker",
    )
    inflight_prefixes: bool = Field(
        True, description="count prompts routed to a worker as its hits until it reports them"
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name not in POLICIES:
            raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
        return name
