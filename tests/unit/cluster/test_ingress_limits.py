"""`IngressLimits` and `ClientLimiter`: the caps on a request and each client's rate and open
requests, alone (a fake clock) and on real servers (uvicorn, grpc.aio) over a `FakeCluster`:
the stock `openai` client and a gRPC stub meet the same caps and one shared budget."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import requests
from pydantic import ValidationError
from routed_fakes import FakeCluster, LoopThread

from swaserve.cluster.grpc_server import GrpcServer, GrpcServerConfig
from swaserve.cluster.http_server import HttpServer
from swaserve.cluster.ingress_limits import (
    ClientLimiter,
    IngressLimits,
    Lease,
    Refusal,
    client_key,
    peer_host,
)
from swaserve.cluster.metrics import ServingMetrics
from swaserve.cluster.serve import ServeAppArgs
from swaserve.proto.engine_request import EngineRequest
from swaserve.proto.sampling_params import SamplingParams, StructuredOutputs
from swaserve.proto.stream import GenerateChunk
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc
from swaserve.proto.text.tokenizer import TextTokenizer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- the limiter alone ---------------------------------------------------------------------
def test_a_token_bucket_admits_its_burst_then_one_request_per_interval() -> None:
    clock = Clock()
    limiter = ClientLimiter(IngressLimits(requests_per_second=2, burst=3), clock)
    leases = [limiter.acquire("a") for _ in range(3)]
    assert all(isinstance(lease, Lease) for lease in leases)
    refused = limiter.acquire("a")
    assert isinstance(refused, Refusal)
    assert refused.retry_after_s == pytest.approx(0.5)
    assert isinstance(limiter.acquire("b"), Lease)  # another client has its own bucket
    clock.now += 0.25
    again = limiter.acquire("a")
    assert isinstance(again, Refusal) and again.retry_after_s == pytest.approx(0.25)
    clock.now += 0.25
    assert isinstance(limiter.acquire("a"), Lease)
    clock.now += 100  # refills to the burst, never past it
    assert sum(isinstance(limiter.acquire("a"), Lease) for _ in range(5)) == 3
    assert limiter.refused == {"rate": 4, "concurrency": 0}
    limiter.check()


def test_open_requests_are_capped_per_client_and_a_lease_releases_once() -> None:
    limiter = ClientLimiter(IngressLimits(max_concurrent=2), Clock())
    first, second = limiter.acquire("a"), limiter.acquire("a")
    assert isinstance(first, Lease) and isinstance(second, Lease)
    assert isinstance(limiter.acquire("a"), Refusal)
    assert isinstance(limiter.acquire("b"), Lease)
    first.release()
    first.release()  # a second release changes nothing
    assert limiter.open_requests("a") == 1
    third = limiter.acquire("a")
    assert isinstance(third, Lease)
    assert isinstance(limiter.acquire("a"), Refusal)
    assert limiter.refused == {"rate": 0, "concurrency": 2}
    limiter.check()
    second.release()
    third.release()
    assert limiter.open_requests("a") == 0
    limiter.check()


def test_without_per_client_limits_nothing_is_counted() -> None:
    limiter = ClientLimiter(IngressLimits(), Clock())
    leases = [limiter.acquire("a") for _ in range(1000)]
    assert all(isinstance(lease, Lease) for lease in leases)
    assert limiter.open_requests("a") == 0


def test_the_client_table_forgets_idle_clients_past_its_bound() -> None:
    clock = Clock()
    limiter = ClientLimiter(IngressLimits(requests_per_second=1), clock, max_clients=3)
    held = limiter.acquire("busy")
    assert isinstance(held, Lease)
    for name in ("x", "y"):
        lease = limiter.acquire(name)
        assert isinstance(lease, Lease)
        lease.release()
    clock.now += 10  # x and y refilled; "busy" still has a request open
    assert isinstance(limiter.acquire("z"), Lease)
    assert set(limiter._budgets) == {"busy", "z"}
    limiter.check()


def test_limits_validate_their_values() -> None:
    with pytest.raises(ValidationError, match="burst needs requests_per_second"):
        IngressLimits(burst=4)
    for bad in ({"max_n": 0}, {"max_n": 17}, {"requests_per_second": 0}, {"max_stop": 17}):
        with pytest.raises(ValidationError):
            IngressLimits(**bad)
    assert IngressLimits(requests_per_second=2.5).bucket_size == 3
    assert IngressLimits(requests_per_second=0.1).bucket_size == 1


def test_each_cap_names_its_field() -> None:
    limits = IngressLimits(max_tokens=8, max_prompt_tokens=10, max_stop=1, max_schema_bytes=20)
    ok = SamplingParams(max_new_tokens=8, stop=("a",))
    assert limits.refusal(10, ok) is None
    assert limits.refusal(11, ok)[0] == "prompt"  # type: ignore[index]
    many = SamplingParams(max_new_tokens=9)
    assert limits.refusal(3, many, max_new_name="max_tokens")[0] == "max_tokens"  # type: ignore[index]
    assert limits.refusal(3, SamplingParams(max_new_tokens=1, stop=("a", "b")))[0] == "stop"  # type: ignore[index]
    schema = StructuredOutputs(json_schema={"type": "object", "properties": {"x": {}}})
    refused = limits.refusal(3, SamplingParams(max_new_tokens=1, structured_outputs=schema))
    assert refused is not None and refused[0] == "structured_outputs"
    assert IngressLimits(max_n=2).n_refusal(3) is not None and limits.n_refusal(16) is None
    assert IngressLimits(max_tools=1).tools_refusal(["{}", "{}"]) is not None
    assert limits.tools_refusal(["{}", '{"type": "object", "properties": {}}']) is not None


def test_a_client_is_its_credential_else_its_host() -> None:
    assert peer_host("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert peer_host("ipv6:[::1]:51234") == "::1"
    assert peer_host("unix:/tmp/sock") == "/tmp/sock"
    assert peer_host("10.0.0.7") == "10.0.0.7"
    assert client_key(None, "ipv4:10.0.0.7:1") == client_key(None, "10.0.0.7") == "peer:10.0.0.7"
    keyed = client_key("Bearer k1", "10.0.0.7")
    assert keyed.startswith("key:") and "k1" not in keyed
    assert keyed == client_key("Bearer k1", "10.0.0.8") != client_key("Bearer k2", "10.0.0.7")


def test_the_serve_app_takes_limit_arguments() -> None:
    args = ServeAppArgs(limit_max_tokens=64, limit_requests_per_second=5)
    args.check_extra()
    assert args.limits() == IngressLimits(max_tokens=64, requests_per_second=5)
    with pytest.raises(ValueError, match="limit_max_token"):
        ServeAppArgs(limit_max_token=64).check_extra()


def test_swaserve_serve_flags_set_the_limits(tiny_model_factory: Callable[..., Path]) -> None:
    import argparse

    from swaserve.cluster.serve_command import add_arguments, build_configs

    model = tiny_model_factory(arch="gpt-oss", num_layers=1)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--model", str(model), "--limit-max-tokens", "64", "--limit-max-concurrent", "2"]
    config, _ = build_configs(parser.parse_args(argv))
    assert config.limits == IngressLimits(max_tokens=64, max_concurrent=2)
    with pytest.raises(ValidationError):
        build_configs(parser.parse_args(["--model", str(model), "--limit-max-n", "0"]))


# ---- on real servers -------------------------------------------------------------------------
class HeldCluster(FakeCluster):
    """Streams hold after their first token until `go` is set (a request stays open)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert self.model_info is not None
        self.model_info = replace(self.model_info, vocab_size=288)  # the harmony tokenizer's
        self.go = threading.Event()
        self.go.set()
        self.holding = threading.Semaphore(0)

    async def _stream(
        self, worker_id: str, request: EngineRequest
    ) -> AsyncIterator[GenerateChunk | Exception]:
        first = True
        async for chunk in super()._stream(worker_id, request):
            yield chunk
            if first and chunk.token_ids:
                first = False
                if not self.go.is_set():
                    self.holding.release()
                    await asyncio.to_thread(self.go.wait, 60)


@dataclass
class Servers:
    cluster: HeldCluster
    http_port: int
    grpc_port: int

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key="x", max_retries=0
        )

    def stub(self) -> tuple[grpc.Channel, pb_grpc.InferenceStub]:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        return channel, pb_grpc.InferenceStub(channel)

    @property
    def model(self) -> str:
        assert self.cluster.model_info is not None
        return self.cluster.model_info.model_name


@contextlib.contextmanager
def serving(
    model_dir: Path, limits: IngressLimits, api_key: str | None = None
) -> Iterator[Servers]:
    tokenizer = TextTokenizer(str(model_dir))
    cluster = HeldCluster(model_dir, tokenizer, ["w0"], limits=limits)
    loop = LoopThread()
    servers: list[Any] = []
    try:
        metrics = ServingMetrics(model_dir.name)
        servers.append(HttpServer(cluster, port=0, metrics=metrics, api_key=api_key))
        servers.append(GrpcServer(cluster, GrpcServerConfig(port=0), metrics))
        ports = [loop.run(server.start()) for server in servers]
        yield Servers(cluster, *ports)
    finally:
        cluster.go.set()
        try:
            for server in servers:
                loop.run(server.stop())
        finally:
            loop.close()
    cluster.clients.check()


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("gpt-oss", num_layers=1, harmony=True)


def grpc_generate(stub: pb_grpc.InferenceStub, **params: Any) -> list[int]:
    request = pb.GenerateRequest(token_ids=[1, 2], sampling_params=pb.SamplingParams(**params))
    return [t for item in stub.Generate(request, timeout=60) for t in item.token_ids]


def test_caps_refuse_the_field_over_them_on_http_and_grpc(model_dir: Path) -> None:
    limits = IngressLimits(
        max_tokens=4, max_prompt_tokens=300, max_n=2, max_tools=1, max_stop=1, max_schema_bytes=64
    )
    with serving(model_dir, limits) as s:
        client, model = s.client(), s.model
        hello = [{"role": "user", "content": "hi"}]
        refused = {
            "max_tokens": lambda: client.completions.create(model=model, prompt=[1], max_tokens=5),
            "prompt": lambda: client.completions.create(
                model=model, prompt=[1] * 301, max_tokens=1
            ),
            "n": lambda: client.completions.create(model=model, prompt=[1], max_tokens=1, n=3),
            "stop": lambda: client.completions.create(
                model=model, prompt=[1], max_tokens=1, stop=["a", "b"]
            ),
            "max_completion_tokens": lambda: client.chat.completions.create(
                model=model, messages=hello, max_completion_tokens=5
            ),
            "tools": lambda: client.chat.completions.create(
                model=model,
                messages=hello,
                max_tokens=1,
                tools=[
                    {"type": "function", "function": {"name": f"f{i}", "parameters": {}}}
                    for i in range(2)
                ],
            ),
            "response_format": lambda: client.chat.completions.create(
                model=model,
                messages=hello,
                max_tokens=1,
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "big",
                        "schema": {"type": "object", "properties": {"x" * 80: {}}},
                    },
                },
            ),
        }
        for param, call in refused.items():
            with pytest.raises(openai.BadRequestError) as err:
                call()
            assert err.value.status_code == 400
            assert err.value.body["param"] == param, (param, err.value.body)  # type: ignore[index]
            assert "this server" in err.value.body["message"]  # type: ignore[index]
        # Within the caps: served; a chat without max_tokens gets the cap as its default.
        client.completions.create(model=model, prompt=[1] * 300, max_tokens=4, n=2)
        client.chat.completions.create(model=model, messages=hello)
        assert s.cluster.params[-1].max_new_tokens == 4
        channel, stub = s.stub()
        with channel:
            for params in ({"max_new_tokens": 5}, {"max_new_tokens": 1, "stop": ["a", "b"]}):
                with pytest.raises(grpc.RpcError) as rpc:
                    grpc_generate(stub, **params)
                assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "this server" in (rpc.value.details() or "")
            schema = pb.StructuredOutputs(json_schema='{"properties": {"' + "x" * 80 + '": {}}}')
            with pytest.raises(grpc.RpcError) as rpc:
                grpc_generate(stub, max_new_tokens=1, structured_outputs=schema)
            assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert grpc_generate(stub, max_new_tokens=4) == [3, 4, 5, 6]
            assert grpc_generate(stub) == [3, 4, 5, 6]  # unset: the cap, not the default 128


def test_a_client_over_its_rate_gets_429_with_retry_after_on_both_ports(model_dir: Path) -> None:
    """One client (127.0.0.1) shares one budget across HTTP and gRPC; the stock clients see
    429 + Retry-After (openai.RateLimitError) and RESOURCE_EXHAUSTED + retry-after-s."""
    with serving(model_dir, IngressLimits(requests_per_second=0.01, burst=2)) as s:
        client, model = s.client(), s.model
        client.completions.create(model=model, prompt=[1, 2], max_tokens=2)
        channel, stub = s.stub()
        with channel:
            assert grpc_generate(stub, max_new_tokens=2) == [3, 4]
            with pytest.raises(grpc.RpcError) as rpc:
                grpc_generate(stub, max_new_tokens=2)
            assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            trailing = dict(rpc.value.trailing_metadata() or ())
            assert 0 < float(trailing["retry-after-s"]) <= 100
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=model, prompt=[1, 2], max_tokens=2)
        assert err.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
        assert 1 <= int(err.value.response.headers["Retry-After"]) <= 100
        # Only the generating routes count: the model list and health are not limited.
        assert client.models.list().data[0].id == model
        url = f"http://127.0.0.1:{s.http_port}"
        assert requests.get(f"{url}/health", timeout=30).status_code == 200
        metrics = requests.get(f"{url}/metrics", timeout=30).text
        assert 'swaserve:requests_rate_limited_total{model_name="' in metrics
        assert s.cluster.clients.refused == {"rate": 2, "concurrency": 0}
        assert 'reason="rate"} 2.0' in metrics


def settled(cluster: HeldCluster, timeout_s: float = 60.0) -> None:
    """Wait until the local client has no request open on the server."""
    deadline = time.monotonic() + timeout_s
    while cluster.clients.open_requests("peer:127.0.0.1"):
        assert time.monotonic() < deadline, "a request's place was never released"
        time.sleep(0.01)


def test_open_requests_are_capped_until_a_stream_ends(model_dir: Path) -> None:
    with serving(model_dir, IngressLimits(max_concurrent=1)) as s:
        client, model = s.client(), s.model
        s.cluster.go.clear()
        stream = client.completions.create(model=model, prompt=[1, 2], max_tokens=3, stream=True)
        first = next(iter(stream))
        assert s.cluster.holding.acquire(timeout=60)
        assert first.choices[0].text is not None
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=model, prompt=[1, 2], max_tokens=2)
        channel, stub = s.stub()
        with channel:
            with pytest.raises(grpc.RpcError) as rpc:
                grpc_generate(stub, max_new_tokens=2)
            assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            s.cluster.go.set()
            assert len(list(stream)) >= 1
            stream.close()
            # The server releases its place once the response is sent: after the client read it.
            settled(s.cluster)
            assert grpc_generate(stub, max_new_tokens=2) == [3, 4]
        settled(s.cluster)
        client.completions.create(model=model, prompt=[1, 2], max_tokens=2)
        assert s.cluster.clients.refused == {"rate": 0, "concurrency": 2}


def test_with_a_key_the_budget_is_the_keys_and_a_wrong_key_is_401_not_429(
    model_dir: Path,
) -> None:
    with serving(model_dir, IngressLimits(requests_per_second=0.01, burst=1), "k1") as s:
        url = f"http://127.0.0.1:{s.http_port}/v1/completions"
        body = {"prompt": [1, 2], "max_tokens": 1}

        def post(key: str) -> requests.Response:
            headers = {"Authorization": f"Bearer {key}"}
            return requests.post(url, json=body, headers=headers, timeout=30)

        assert post("k1").status_code == 200
        assert post("k1").status_code == 429
        assert [post("wrong").status_code for _ in range(3)] == [401] * 3
        assert s.cluster.clients.refused["rate"] == 1
        # gRPC without a token counts against its address, not the key: still has its budget.
        channel, stub = s.stub()
        with channel:
            assert grpc_generate(stub, max_new_tokens=1) == [3]
