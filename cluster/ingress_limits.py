"""Limits that protect the fleet from one client: caps on what a request may ask for, and each
client's rate and concurrency. Every ingress checks them the same way (gRPC, the OpenAI HTTP
API, the Serve app's two): the caps through `RoutedCluster.check_request` (plus `n` and `tools`,
which only the HTTP API has), the client's budget through `RoutedCluster.admit`.

    caps       max_tokens, prompt tokens, stop strings, schema / grammar bytes  → 400 /
               INVALID_ARGUMENT naming the field; n, tools (HTTP)               → 400
    per client requests per second (a token bucket of `burst`), open requests
               (`max_concurrent`)  → 429 + Retry-After / RESOURCE_EXHAUSTED + retry-after-s

A client is the credential it presents when the server requires one (its key or token: each
key has its own budget), else its address. The budgets live in the ingress process: with
several ingress replicas (the Serve app's `ingress_replicas`) each keeps its own.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swaserve.proto.sampling_params import MAX_GRAMMAR_CHARS, MAX_STOP_STRINGS, SamplingParams

MAX_CHOICES = 16
"""The most choices (`n`) any request may ask for; `IngressLimits.max_n` may lower it."""
MAX_TOOLS = 128  # OpenAI's own bound on a request's tools
MAX_CLIENTS_KEPT = 100_000
"""Client budgets kept at most: past it, the idle ones (bucket full, nothing open) are dropped
(they start full again), so clients that come and go cannot grow the table."""


class IngressLimits(BaseModel):
    """The limits of one serving cluster (flags `--limit-<name>`, Serve args `limit_<name>`,
    Helm `limits.<name>`). None: no limit beyond the model's own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_second: float | None = Field(
        None, gt=0, description="per client: requests started per second, on average"
    )
    burst: int | None = Field(
        None, ge=1, description="per client: requests it may start at once (default: 1 s's worth)"
    )
    max_concurrent: int | None = Field(
        None, ge=1, description="per client: requests open at once (a stream counts until it ends)"
    )
    max_n: int = Field(MAX_CHOICES, ge=1, le=MAX_CHOICES, description="choices per request (n)")
    max_tokens: int | None = Field(
        None, ge=1, description="max_tokens a request may ask for (and its default)"
    )
    max_prompt_tokens: int | None = Field(None, ge=1, description="prompt tokens per request")
    max_tools: int = Field(MAX_TOOLS, ge=0, le=MAX_TOOLS, description="tools per request")
    max_schema_bytes: int = Field(
        MAX_GRAMMAR_CHARS,
        ge=1,
        le=MAX_GRAMMAR_CHARS,
        description="a response format's or a tool's JSON schema, a regex or grammar (UTF-8 bytes)",
    )
    max_stop: int = Field(
        MAX_STOP_STRINGS, ge=0, le=MAX_STOP_STRINGS, description="stop strings per request"
    )

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> IngressLimits:
        if self.burst is not None and self.requests_per_second is None:
            raise ValueError("burst needs requests_per_second")
        return self

    @property
    def bucket_size(self) -> float:
        if self.burst is not None:
            return float(self.burst)
        return float(max(1, math.ceil(self.requests_per_second or 1.0)))

    @property
    def per_client(self) -> bool:
        return self.requests_per_second is not None or self.max_concurrent is not None

    def refusal(
        self, prompt_tokens: int, params: SamplingParams, *, max_new_name: str = "max_new_tokens"
    ) -> tuple[str, str] | None:
        """(the field at fault, why) for the first cap the request breaks, else None."""
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return "prompt", (
                f"the prompt has {prompt_tokens} tokens; this server takes at most "
                f"{self.max_prompt_tokens}"
            )
        if self.max_tokens is not None and params.max_new_tokens > self.max_tokens:
            return max_new_name, (
                f"{max_new_name} is {params.max_new_tokens}; this server allows at most "
                f"{self.max_tokens}"
            )
        if len(params.stop) > self.max_stop:
            return (
                "stop",
                f"{len(params.stop)} stop strings; this server takes at most {self.max_stop}",
            )
        if params.structured_outputs is not None:
            size = len(params.structured_outputs.key.encode())
            if size > self.max_schema_bytes:
                return "structured_outputs", (
                    f"the {params.structured_outputs.kind} is {size} bytes; this server takes at "
                    f"most {self.max_schema_bytes}"
                )
        return None

    def default_max_tokens(self, default: int) -> int:
        """What a request that leaves max_tokens unset gets: `default`, at most the cap."""
        return default if self.max_tokens is None else min(default, self.max_tokens)

    def n_refusal(self, n: int) -> str | None:
        if n > self.max_n:
            return f"n is {n}; this server allows at most {self.max_n} choices"
        return None

    def tools_refusal(self, schemas: list[str]) -> str | None:
        """`schemas`: each tool's parameters as JSON text."""
        if len(schemas) > self.max_tools:
            return f"{len(schemas)} tools; this server takes at most {self.max_tools}"
        for i, text in enumerate(schemas):
            size = len(text.encode())
            if size > self.max_schema_bytes:
                return (
                    f"tools[{i}]'s parameters schema is {size} bytes; this server takes at most "
                    f"{self.max_schema_bytes}"
                )
        return None


def client_key(credential: str | None, peer: str | None) -> str:
    """Who a request counts against: the credential it presented (hashed: the table never holds
    a key), else its address (`peer`: a host, or gRPC's `ipv4:host:port` form)."""
    if credential:
        return "key:" + hashlib.sha256(credential.encode()).hexdigest()[:16]
    return "peer:" + peer_host(peer or "")


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (`ipv4:1.2.3.4:5`, `ipv6:[::1]:5`, `unix:/path`) or of a
    plain host; the port is dropped (one client opens many connections)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6", "unix", "unix-abstract"):
        return peer or "unknown"
    if kind == "ipv6" and rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return rest or kind


@dataclass(frozen=True, slots=True)
class Refusal:
    """A client over its budget: why, and when to try again."""

    message: str
    retry_after_s: float


@dataclass(slots=True)
class _Budget:
    tokens: float
    updated: float
    open: int = 0


@dataclass(slots=True)
class Lease:
    """One admitted request's place in its client's budget; `release()` once it ended (again:
    nothing)."""

    _limiter: ClientLimiter | None
    client: str
    _released: bool = field(default=False)

    def release(self) -> None:
        if not self._released and self._limiter is not None:
            self._released = True
            self._limiter._release(self.client)


class ClientLimiter:
    """Each client's token bucket (`requests_per_second`, `burst`) and open-request count
    (`max_concurrent`). Thread-safe: the Serve ingress and the gRPC server call it from more
    than one thread. `check()` states its invariants."""

    def __init__(
        self,
        limits: IngressLimits,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = MAX_CLIENTS_KEPT,
    ) -> None:
        self.limits, self._clock, self.max_clients = limits, clock, max_clients
        self._budgets: dict[str, _Budget] = {}
        self._lock = threading.Lock()
        self.refused = {"rate": 0, "concurrency": 0}

    def acquire(self, client: str) -> Lease | Refusal:
        limits = self.limits
        if not limits.per_client:
            return Lease(None, client)
        with self._lock:
            now = self._clock()
            budget = self._budgets.get(client)
            if budget is None:
                if len(self._budgets) >= self.max_clients:
                    self._forget_idle(now)
                budget = self._budgets[client] = _Budget(limits.bucket_size, now)
            rate = limits.requests_per_second
            if rate is not None:
                budget.tokens = min(
                    limits.bucket_size, budget.tokens + (now - budget.updated) * rate
                )
            budget.updated = now
            if limits.max_concurrent is not None and budget.open >= limits.max_concurrent:
                self.refused["concurrency"] += 1
                return Refusal(
                    f"too many open requests: this client may have {limits.max_concurrent} at once",
                    1.0,
                )
            if rate is not None:
                if budget.tokens < 1.0:
                    self.refused["rate"] += 1
                    return Refusal(
                        f"rate limit: this client may start {rate:g} requests per second",
                        (1.0 - budget.tokens) / rate,
                    )
                budget.tokens -= 1.0
            budget.open += 1
            return Lease(self, client)

    def _release(self, client: str) -> None:
        with self._lock:
            budget = self._budgets.get(client)
            if budget is not None:
                budget.open -= 1

    def _forget_idle(self, now: float) -> None:
        rate = self.limits.requests_per_second
        full = self.limits.bucket_size
        for client, b in list(self._budgets.items()):
            refilled = rate is None or b.tokens + (now - b.updated) * rate >= full
            if b.open == 0 and refilled:
                del self._budgets[client]

    def open_requests(self, client: str) -> int:
        with self._lock:
            budget = self._budgets.get(client)
            return 0 if budget is None else budget.open

    def check(self) -> None:
        with self._lock:
            for client, b in self._budgets.items():
                assert b.open >= 0, f"{client}: {b.open} open requests"
                assert b.tokens <= self.limits.bucket_size + 1e-9, f"{client}: bucket overfull"
                if self.limits.max_concurrent is not None:
                    assert b.open <= self.limits.max_concurrent, f"{client}: over max_concurrent"
