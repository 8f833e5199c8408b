"""Fuzz both serving APIs from their own schemas, on a real local cluster.

A local cluster (1 replica, a tiny harmony GPT-OSS model, one local Ray) serves gRPC and the
OpenAI HTTP API, with caps small enough that valid requests stay short (`IngressLimits`:
max_tokens 8, prompt 512 tokens, n 2). Then:

- **HTTP**: schemathesis reads the server's own OpenAPI document (`GET /openapi.json`) and
  generates requests for every operation, half valid by the schema, half not (its positive and
  negative modes);
- **gRPC**: hypothesis strategies built from the `swaserve.v1` message descriptors (every
  field by its type, presence, oneof and map; token ids mostly inside the vocabulary) drive
  `Generate`, `Abort`, `GetModelInfo` and `GetLoad`.

Each answer must be a status its interface documents (HTTP: the document's statuses for the
operation, never a 5xx, never a reset connection, never an `error` event in a 200 stream; gRPC:
OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED, never a hung call), while a canary stream in another
thread repeats one greedy request and must get the same tokens every time. At the end the
cluster must be whole: no request open in the ingress, every worker idle with its KV free or
cached (`GetLoad`), the engine's own checks passed (`check_on_idle`), and the ingress's memory
(RSS) is printed before and after.

    python bench/api_fuzz.py [--examples 2000] [--seed 0] [--json]

Prints per interface: inputs tried, answers by status, failures (with the first few inputs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import requests
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from multiturn import local_ray

from swaserve.cluster.ingress_limits import IngressLimits
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc

GRPC_DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""What a fuzzed call may end with while the cluster is up and nothing is draining (the gRPC
module docstring lists when the others come)."""
CALL_TIMEOUT_S = 120.0  # a call still open after this is a hung stream
FUZZ_LIMITS = IngressLimits(max_tokens=8, max_prompt_tokens=512, max_n=2)
FAILURES_SHOWN = 5


@dataclass
class FuzzReport:
    interface: str
    tried: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failures.append(what[:2000])

    def summary(self) -> dict[str, Any]:
        return {
            "tried": self.tried,
            "statuses": dict(sorted(self.statuses.items())),
            "failures": len(self.failures),
            "first_failures": self.failures[:FAILURES_SHOWN],
        }


def _run_examples(
    strategy: st.SearchStrategy[Any], examples: int, seed: int, one: Callable
) -> None:
    """Draw `examples` inputs from `strategy` (no shrinking, no database) and call `one` on each;
    `one` records, never raises."""

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(value: Any) -> None:
        one(value)

    hypothesis_seed(seed)(run)()


# ---- HTTP ------------------------------------------------------------------------------------
def fuzz_http(base_url: str, examples: int, seed: int) -> FuzzReport:
    """`examples` requests that schemathesis generates from the server's OpenAPI document."""
    import schemathesis
    from schemathesis.generation import GenerationMode

    document = requests.get(f"{base_url}/openapi.json", timeout=60).json()
    schema = schemathesis.openapi.from_dict(document)
    strategy = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE)
    )
    documented = {
        (method.upper(), path): {int(s) for s in operation["responses"]}
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
    }
    report = FuzzReport("http")
    session = requests.Session()

    def one(case: Any) -> None:
        report.tried += 1
        what = f"{case.method} {case.formatted_path} body={_short(getattr(case, 'body', None))}"
        try:
            response = case.call(base_url=base_url, session=session, timeout=CALL_TIMEOUT_S)
        except requests.RequestException as exc:
            report.statuses["no answer"] += 1
            report.fail(f"{what}: {type(exc).__name__}: {exc}")
            return
        status = response.status_code
        report.statuses[str(status)] += 1
        allowed = documented[(case.method.upper(), case.path)]
        if status >= 500 or status not in allowed:
            report.fail(f"{what}: undocumented {status}: {response.text[:300]}")
        elif status == 200 and "text/event-stream" in response.headers.get("content-type", ""):
            for line in response.text.splitlines():
                if line.startswith("data: {") and '"server_error"' in line:
                    report.fail(f"{what}: an error event in a 200 stream: {line[:300]}")
                    break

    _run_examples(strategy, examples, seed, one)
    return report


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if value is not None else "-"
    return text if len(text) <= 400 else text[:400] + "..."


# ---- gRPC ------------------------------------------------------------------------------------
_INTS = {
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
}


def scalar_strategy(fd: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Any value of the field's type, small values more often (they reach deeper checks)."""
    if fd.type in _INTS:
        low, high = _INTS[fd.type]
        return st.one_of(st.integers(max(low, -4), 40), st.integers(low, high))
    if fd.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True))
    if fd.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if fd.type == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.text(max_size=40), st.text(alphabet="abcxyz-_.:0123", max_size=12))
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=40)
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in fd.enum_type.values])
    raise TypeError(f"no strategy for {fd.full_name}")


def message_strategy(
    descriptor: Descriptor,
    overrides: dict[str, st.SearchStrategy[Any]],
    depth: int = 0,
) -> st.SearchStrategy[Any]:
    """Messages of `descriptor`'s type: each field set or left unset (presence), repeated and
    map fields of a few items, at most one member of each oneof, nested messages to depth 3.
    `overrides`: a strategy for a field's value (its full name), used half the time."""
    message_class = _class_of(descriptor)
    parts: dict[str, st.SearchStrategy[Any]] = {}
    oneofs: dict[str, list[FieldDescriptor]] = {}
    for fd in descriptor.fields:
        oneof = fd.containing_oneof
        if oneof is not None and not (fd.has_presence and len(oneof.fields) == 1):
            oneofs.setdefault(oneof.name, []).append(fd)
            continue
        parts[fd.name] = st.one_of(st.none(), _field_value(fd, overrides, depth))
    for members in oneofs.values():
        choices = [st.tuples(st.just(m.name), _field_value(m, overrides, depth)) for m in members]
        parts["\0" + members[0].containing_oneof.name] = st.one_of(st.none(), *choices)

    def build(values: dict[str, Any]) -> Any:
        kwargs: dict[str, Any] = {}
        for name, value in values.items():
            if value is None:
                continue
            if name.startswith("\0"):
                kwargs[value[0]] = value[1]
            else:
                kwargs[name] = value
        return message_class(**kwargs)

    if depth > 3:
        return st.builds(message_class)
    return st.fixed_dictionaries(parts).map(build)


def _field_value(
    fd: FieldDescriptor, overrides: dict[str, st.SearchStrategy[Any]], depth: int
) -> st.SearchStrategy[Any]:
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        key_fd, value_fd = (
            fd.message_type.fields_by_name["key"],
            fd.message_type.fields_by_name["value"],
        )
        keys = overrides.get(key_fd.full_name, scalar_strategy(key_fd))
        return st.dictionaries(keys, scalar_strategy(value_fd), max_size=4)
    if fd.message_type is not None:
        one: st.SearchStrategy[Any] = message_strategy(fd.message_type, overrides, depth + 1)
    else:
        one = scalar_strategy(fd)
    if fd.full_name in overrides:
        one = st.one_of(overrides[fd.full_name], one)
    if fd.is_repeated:
        return st.lists(one, max_size=6)
    return one


def _class_of(descriptor: Descriptor) -> Any:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def grpc_strategy(vocab_size: int) -> st.SearchStrategy[tuple[str, Any]]:
    """(method, request) pairs: mostly `Generate`, with token ids mostly in the vocabulary, a
    few sampling values in range, and real JSON schemas among the arbitrary ones."""
    name = "swaserve.v1."
    in_vocab = st.integers(0, vocab_size + 4)
    overrides: dict[str, st.SearchStrategy[Any]] = {
        name + "GenerateRequest.token_ids": in_vocab,
        name + "SamplingParams.stop_token_ids": in_vocab,
        name + "SamplingParams.max_new_tokens": st.integers(0, 10),
        name + "SamplingParams.temperature": st.floats(0, 2),
        name + "SamplingParams.top_p": st.floats(0, 1),
        name + "SamplingParams.logprobs": st.integers(0, 22),
        name + "SamplingParams.num_speculative_tokens": st.integers(0, 4),
        name + "SamplingParams.logit_bias.key": in_vocab,
        name + "StructuredOutputs.json_schema": st.sampled_from(
            ['{"type": "object"}', '{"type": "string", "maxLength": 3}', '{"enum": [1, 2]}', "{"]
        ),
        name + "StructuredOutputs.regex": st.sampled_from(["[ab]{1,3}", "(", "a|b", ".*"]),
    }
    generate = message_strategy(pb.GenerateRequest.DESCRIPTOR, overrides)
    return st.one_of(
        st.tuples(st.just("Generate"), generate),
        st.tuples(st.just("Generate"), generate),
        st.tuples(st.just("Generate"), generate),
        st.tuples(st.just("Abort"), message_strategy(pb.AbortRequest.DESCRIPTOR, overrides)),
        st.tuples(st.just("GetModelInfo"), st.just(pb.GetModelInfoRequest())),
        st.tuples(st.just("GetLoad"), st.just(pb.GetLoadRequest())),
    )


def fuzz_grpc(address: str, examples: int, seed: int, vocab_size: int) -> FuzzReport:
    report = FuzzReport("grpc")
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.InferenceStub(channel)

    def one(call: tuple[str, Any]) -> None:
        method, request = call
        report.tried += 1
        try:
            if method == "Generate":
                for _ in stub.Generate(request, timeout=CALL_TIMEOUT_S):
                    pass
            else:
                getattr(stub, method)(request, timeout=CALL_TIMEOUT_S)
            code = grpc.StatusCode.OK
            details = ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        report.statuses[code.name] += 1
        if code not in GRPC_DOCUMENTED:
            text = str(request).replace("\n", " ")[:400]
            report.fail(f"{method}({text}): {code.name}: {details[:300]}")

    try:
        _run_examples(grpc_strategy(vocab_size), examples, seed, one)
    finally:
        channel.close()
    return report


# ---- the canary and the cluster --------------------------------------------------------------
class Canary:
    """Repeats one greedy gRPC request in its own thread while the fuzz runs: every answer must
    be the first one's tokens."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.request = pb.GenerateRequest(
            token_ids=[5, 6, 7, 8, 9],
            sampling_params=pb.SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True),
        )
        self.reference = self._tokens()
        self.runs = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tokens(self) -> list[int]:
        stream = self.stub.Generate(self.request, timeout=CALL_TIMEOUT_S)
        return [t for item in stream for t in item.token_ids]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                tokens = self._tokens()
            except grpc.RpcError as exc:
                self.failures.append(f"{exc.code().name}: {exc.details()}")
                continue
            self.runs += 1
            if tokens != self.reference:
                self.failures.append(f"tokens {tokens} != {self.reference}")

    def __enter__(self) -> Canary:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(CALL_TIMEOUT_S)
        self.channel.close()


def rss_mb() -> float:
    """This process's peak resident memory (MB): the ingress runs here (and the fuzzers)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def process_rss_mb(pid: int) -> float:
    """A local process's resident memory now (MB), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class LoopThread:
    """An asyncio loop in a daemon thread: the cluster and its servers run there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout_s: float = 600.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Served:
    """A running cluster with both servers: the gRPC address, the HTTP base URL."""

    loop: LoopThread
    cluster: Any
    address: str
    base_url: str

    @property
    def vocab_size(self) -> int:
        return int(self.cluster.model_info.vocab_size)

    def worker_rss_mb(self) -> float:
        """The engine process's resident memory (MB): each live worker's rank 0, summed."""
        import ray

        groups = [self.cluster.groups[w] for w in self.cluster.live_workers]
        pids = [ray.get(group.engine.pid.remote(), timeout=60) for group in groups]
        return sum(process_rss_mb(pid) for pid in pids)

    def settled(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Wait until the ingress holds no request and every worker reports itself idle with
        its KV free or cached; what it found (its `whole` is False when the wait ran out)."""
        deadline = time.monotonic() + timeout_s
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            loads = self.loop.run(self.cluster.load())
            state = {
                "open_requests": self.cluster.num_open,
                "workers": len(loads),
                "kv_held": [
                    (
                        s.headroom.full_total_tokens
                        - s.headroom.full_free_tokens
                        - s.headroom.full_evictable_tokens
                    )
                    for s in loads
                    if s.headroom is not None
                ],
                "running": [
                    s.headroom.num_running + s.headroom.num_waiting for s in loads if s.headroom
                ],
            }
            state["whole"] = (
                state["open_requests"] == 0
                and state["workers"] >= 1
                and not any(state["kv_held"])
                and not any(state["running"])
            )
            if state["whole"]:
                break
            time.sleep(0.05)
        return state


@contextlib.contextmanager
def serving(model_dir: str) -> Iterator[Served]:
    """One replica of the model with both servers on free 127.0.0.1 ports; stopped after."""
    from swaserve.cluster.cluster import Cluster, ClusterConfig
    from swaserve.cluster.grpc_server import GrpcServer, GrpcServerConfig
    from swaserve.cluster.http_server import HttpServer
    from swaserve.cluster.metrics import ServingMetrics
    from swaserve.worker import EngineConfig

    config = ClusterConfig(
        engine=EngineConfig(
            model=model_dir,
            device="cpu",
            max_total_tokens=4096,
            chunked_prefill_size=256,
            check_on_idle=True,
        ),
        replicas=1,
        report_interval_s=0.05,
        limits=FUZZ_LIMITS,
    )
    loop = LoopThread()
    cluster = loop.run(Cluster.start(config))
    servers: list[Any] = []
    try:
        metrics = ServingMetrics("fuzz")
        grpc_server = GrpcServer(cluster, GrpcServerConfig(port=0), metrics)
        http_server = HttpServer(cluster, port=0, metrics=metrics)
        servers += [grpc_server, http_server]
        grpc_port, http_port = (loop.run(server.start()) for server in servers)
        yield Served(loop, cluster, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}")
    finally:
        try:
            for server in servers:
                loop.run(server.stop())
            loop.run(cluster.shutdown(timeout_s=10))
        finally:
            loop.close()


def run(model_dir: str, examples: int, seed: int) -> dict[str, Any]:
    with serving(model_dir) as served:
        rss_before = rss_mb()
        with Canary(served.address) as canary:
            worker_before = served.worker_rss_mb()  # after the canary's first request
            started = time.monotonic()
            http = fuzz_http(served.base_url, examples, seed)
            http_s = time.monotonic() - started
            started = time.monotonic()
            grpc_report = fuzz_grpc(served.address, examples, seed, served.vocab_size)
            grpc_s = time.monotonic() - started
        state = served.settled()
        worker_after = served.worker_rss_mb()
        alive = requests.get(f"{served.base_url}/health", timeout=60).status_code == 200
        return {
            "http": {**http.summary(), "seconds": round(http_s, 1)},
            "grpc": {**grpc_report.summary(), "seconds": round(grpc_s, 1)},
            "canary": {
                "runs": canary.runs,
                "failures": len(canary.failures),
                "first_failures": canary.failures[:FAILURES_SHOWN],
            },
            "after": {**state, "serving": alive},
            "ingress_peak_rss_mb": {"before": round(rss_before), "after": round(rss_mb())},
            "worker_rss_mb": {"before": round(worker_before), "after": round(worker_after)},
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--examples", type=int, default=2000, help="inputs per interface")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from swaserve.worker.models.tiny import make_tiny_model

    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, local_ray(num_cpus=4):
        model = make_tiny_model(
            tmp, arch="gpt-oss", num_layers=args.layers, sliding_window_size=8, harmony=True
        )
        result = run(str(model), args.examples, args.seed)
    for name in ("http", "grpc"):
        r = result[name]
        print(
            f"{name}: {r['tried']} inputs tried in {r['seconds']} s, {r['failures']} failures; "
            f"answers {r['statuses']}"
        )
        for failure in r["first_failures"]:
            print(f"  {failure}")
    canary = result["canary"]
    print(
        f"canary: {canary['runs']} runs, {canary['failures']} failures {canary['first_failures']}"
    )
    print(f"after: {result['after']}")
    print(
        f"memory (MB): worker RSS {result['worker_rss_mb']}, ingress (and fuzzers) peak RSS "
        f"{result['ingress_peak_rss_mb']}"
    )
    if args.json:
        print(json.dumps(result))
    bad = result["http"]["failures"] + result["grpc"]["failures"] + canary["failures"]
    sys.exit(1 if bad or not result["after"]["whole"] else 0)


if __name__ == "__main__":
    main()
