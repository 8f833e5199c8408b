"""The ingresses' edges on real servers (uvicorn, grpc.aio) on 127.0.0.1, over a `FakeCluster`
(no Ray): the HTTP body limit for Content-Length and chunked bodies (a 413 the `openai` client
and `requests` read), tokenizing off the event loop, the gRPC deadline reaching the router,
and the gRPC bearer token rule."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import requests
from routed_fakes import FakeCluster, LoopThread, counting_tokens

from swaserve.cluster.grpc_server import (
    BearerToken,
    GrpcServer,
    GrpcServerConfig,
)
from swaserve.cluster.http_server import HttpServer
from swaserve.cluster.openai_api import MAX_BODY_BYTES
from swaserve.proto.sampling_params import SamplingParams
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc
from swaserve.proto.text.tokenizer import TextTokenizer, encode_text, load_tokenizer

TOKEN = "s3cret"
OVER_LIMIT_BYTES = MAX_BODY_BYTES + 4_000_000  # about 20 MB
TOO_LARGE = {
    "message": f"the request body is larger than {MAX_BODY_BYTES} bytes",
    "type": "invalid_request_error",
    "param": None,
    "code": "request_too_large",
}


class GatedTokenizer:
    """The model's tokenizer, except that `encode_batch` (what the ingresses encode with)
    first waits for `gate`; `entered` says a call is waiting there."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def encode_batch(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        if not self.gate.wait(60):
            raise TimeoutError("the test never opened the gate")
        return self.inner.encode_batch(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Served:
    cluster: FakeCluster
    tokenizer: GatedTokenizer
    http_port: int
    grpc_port: int
    grpc_auth_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def stub(self, port: int | None = None) -> tuple[grpc.Channel, pb_grpc.InferenceStub]:
        channel = grpc.insecure_channel(f"127.0.0.1:{port or self.grpc_port}")
        return channel, pb_grpc.InferenceStub(channel)


@pytest.fixture
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="gpt-oss", num_layers=2, sliding_window_size=4)


@pytest.fixture
def served(model_dir: Path) -> Iterator[Served]:
    tokenizer = load_tokenizer(str(model_dir))
    assert tokenizer is not None
    gated = GatedTokenizer(tokenizer.tokenizer)
    tokenizer.tokenizer = gated
    cluster = FakeCluster(model_dir, tokenizer, ["w0"])
    loop = LoopThread()
    servers: list[Any] = []
    try:
        http = HttpServer(cluster, port=0)
        servers.append(http)
        grpc_plain = GrpcServer(cluster, GrpcServerConfig(port=0))
        servers.append(grpc_plain)
        grpc_auth = GrpcServer(cluster, GrpcServerConfig(port=0, auth_token=TOKEN))
        servers.append(grpc_auth)
        ports = [loop.run(server.start()) for server in servers]
        yield Served(cluster, gated, *ports)
    finally:
        gated.gate.set()
        try:
            for server in servers:
                loop.run(server.stop())
        finally:
            loop.close()


def post(url: str, data: Any, **headers: str) -> requests.Response:
    return requests.post(
        url, data=data, headers={"Content-Type": "application/json", **headers}, timeout=60
    )


def completion_body(prompt: Any, max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True}


# ---- the body limit --------------------------------------------------------------------------
def test_a_body_over_the_limit_with_content_length_is_a_413_in_openai_shape(
    served: Served,
) -> None:
    body = json.dumps(completion_body("x" * OVER_LIMIT_BYTES, 1)).encode()
    reply = post(f"{served.url}/v1/completions", body)
    assert reply.request.headers["Content-Length"] == str(len(body))
    assert reply.status_code == 413
    assert reply.json() == {"error": TOO_LARGE}
    assert reply.headers["connection"] == "close"
    assert served.cluster.fake_router.routed == []  # refused before anything was routed


def test_a_chunked_body_over_the_limit_is_a_413_in_openai_shape(served: Served) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"max_tokens": 1, "prompt": "'
        for _ in range(OVER_LIMIT_BYTES // 1_000_000):
            yield b"x" * 1_000_000
        yield b'"}'

    reply = post(f"{served.url}/v1/chat/completions", chunks())
    assert reply.request.headers["Transfer-Encoding"] == "chunked"
    assert "Content-Length" not in reply.request.headers
    assert reply.status_code == 413
    assert reply.json() == {"error": TOO_LARGE}


def test_the_openai_client_reads_the_413_and_the_server_serves_on(served: Served) -> None:
    client = served.client()
    model = served.cluster.model_info.model_name
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=model, prompt="x" * OVER_LIMIT_BYTES, max_tokens=1)
    assert err.value.status_code == 413
    assert err.value.body == TOO_LARGE
    out = client.completions.create(model=model, prompt=[7, 8, 9], max_tokens=3)
    assert out.choices[0].text == bytes([10, 11, 12]).decode()
    assert out.usage is not None and out.usage.completion_tokens == 3


def test_a_chunked_body_under_the_limit_is_served(served: Served) -> None:
    body = json.dumps(completion_body([7, 8, 9], 3)).encode()
    reply = post(f"{served.url}/v1/completions", (body[i : i + 5] for i in range(0, len(body), 5)))
    assert reply.request.headers["Transfer-Encoding"] == "chunked"
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == [10, 11, 12]


def test_a_client_that_expects_100_continue_gets_the_413_before_it_sends_the_body(
    served: Served,
) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {OVER_LIMIT_BYTES}\r\nExpect: 100-continue\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", served.http_port), timeout=30) as sock:
        sock.sendall(head.encode())
        response = b""
        while chunk := sock.recv(65536):  # the server closes the connection after the 413
            response += chunk
    status, _, rest = response.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large"
    assert json.loads(rest.partition(b"\r\n\r\n")[2]) == {"error": TOO_LARGE}


# ---- tokenizing off the event loop -----------------------------------------------------------
def _http_text(served: Served) -> tuple[list[int], list[int]]:
    reply = post(f"{served.url}/v1/completions", json.dumps(completion_body("hello", 2)))
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def _http_chat(served: Served) -> tuple[list[int], list[int]]:
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2,
        "return_token_ids": True,
    }
    reply = post(f"{served.url}/v1/chat/completions", json.dumps(body))
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def _grpc_text(served: Served) -> tuple[list[int], list[int]]:
    channel, stub = served.stub()
    with channel:
        params = pb.SamplingParams(max_new_tokens=2)
        items = list(stub.Generate(pb.GenerateRequest(text="hello", sampling_params=params)))
    assert served.cluster.tokenizer is not None
    return served.cluster.tokenizer.encode("hello"), [t for i in items for t in i.token_ids]


@pytest.mark.parametrize("send", [_http_text, _http_chat, _grpc_text])
def test_a_prompt_being_tokenized_holds_up_no_other_request(
    served: Served, send: Callable[[Served], tuple[list[int], list[int]]]
) -> None:
    served.tokenizer.gate.clear()
    result: list[tuple[list[int], list[int]]] = []
    slow = threading.Thread(target=lambda: result.append(send(served)))
    slow.start()
    try:
        assert served.tokenizer.entered.wait(30)  # the slow one is inside the tokenizer
        reply = post(f"{served.url}/v1/completions", json.dumps(completion_body([7, 8, 9], 3)))
        assert reply.json()["choices"][0]["token_ids"] == [10, 11, 12]
        channel, stub = served.stub()
        with channel:
            ids = pb.GenerateRequest(
                token_ids=[20, 21], sampling_params=pb.SamplingParams(max_new_tokens=2)
            )
            assert [t for i in stub.Generate(ids, timeout=30) for t in i.token_ids] == [22, 23]
        assert slow.is_alive()  # both were answered while it still waited in the tokenizer
    finally:
        served.tokenizer.gate.set()
        slow.join(60)
    [(prompt_ids, tokens)] = result
    assert prompt_ids[0] == 256  # BOS, once: the template's or the tokenizer's
    assert tokens == counting_tokens(prompt_ids, SamplingParams(max_new_tokens=2))


def test_text_tokenizer_encode_is_bos_and_encode_text(model_dir: Path) -> None:
    tokenizer = TextTokenizer(model_dir)
    for text in ["hello", "", " leading space", "wörld ☃ 日本語", "a\nb\tc" * 50]:
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        assert tokenizer.encode(text) == bos + encode_text(tokenizer.tokenizer, text)
        expected = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        assert encode_text(tokenizer.tokenizer, text) == expected


def test_encode_text_lets_other_threads_run_while_it_tokenizes(model_dir: Path) -> None:
    """`Tokenizer.encode` holds the GIL for the whole call; `encode_text` must not: this
    thread keeps running while another tokenizes a long text."""
    tokenizer = TextTokenizer(model_dir).tokenizer
    text = "the sliding window moves on. " * 40_000  # about a second of tokenizing
    started, done = threading.Event(), threading.Event()

    def tokenize() -> None:
        started.set()
        encode_text(tokenizer, text)
        done.set()

    worker = threading.Thread(target=tokenize)
    worker.start()
    assert started.wait(30)
    turns = 0
    while not done.wait(0.001):
        turns += 1
    worker.join()
    assert turns >= 50  # with the GIL held throughout, this loop gets one or two turns


# ---- gRPC: deadline and token ------------------------------------------------------------
def test_the_grpc_deadline_reaches_the_router_and_http_sends_none(served: Served) -> None:
    router = served.cluster.fake_router
    channel, stub = served.stub()
    request = pb.GenerateRequest(
        token_ids=[1, 2], sampling_params=pb.SamplingParams(max_new_tokens=2)
    )
    with channel:
        assert [t for i in stub.Generate(request, timeout=30) for t in i.token_ids] == [3, 4]
        with_deadline = router.route_timeouts[-1]
        list(stub.Generate(request))
        without = router.route_timeouts[-1]
    # The server reads the deadline gRPC carries on its own clock (`time_remaining`), which can
    # be a fraction of a second off the client's 30 s: the test checks that one arrives.
    assert with_deadline is not None and 0 < with_deadline <= 31
    assert without is None
    post(f"{served.url}/v1/completions", json.dumps(completion_body([1, 2], 2)))
    assert router.route_timeouts[-1] is None  # the OpenAI API has no request deadline


def test_the_bearer_token_rule() -> None:
    rule = BearerToken(TOKEN)
    assert rule.allows([("authorization", f"Bearer {TOKEN}")])
    assert rule.allows([("x-other", "1"), ("authorization", f"Bearer {TOKEN}".encode())])
    assert not rule.allows([("authorization", "Bearer wrong")])
    assert not rule.allows([("authorization", TOKEN)])
    assert not rule.allows([])
    assert not rule.allows(None)
    with pytest.raises(ValueError, match="empty"):
        BearerToken(" ")


def test_the_grpc_server_requires_the_token_when_one_is_set(served: Served) -> None:
    channel, stub = served.stub(served.grpc_auth_port)
    request = pb.GenerateRequest(
        token_ids=[1, 2], sampling_params=pb.SamplingParams(max_new_tokens=2)
    )
    with channel:
        for metadata in ([], [("authorization", "Bearer wrong")]):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, metadata=metadata, timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = [("authorization", f"Bearer {TOKEN}")]
        items = list(stub.Generate(request, metadata=good, timeout=30))
    assert [t for i in items for t in i.token_ids] == [3, 4]


def test_num_speculative_tokens_reaches_the_engine_from_grpc_and_http(served: Served) -> None:
    """The per-request drafts option passes through both ingresses; out of range it is
    INVALID_ARGUMENT / 400 naming the field."""
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        params = pb.SamplingParams(max_new_tokens=2, num_speculative_tokens=2)
        list(stub.Generate(pb.GenerateRequest(token_ids=[1, 2], sampling_params=params)))
        assert served.cluster.params[-1].num_speculative_tokens == 2
        bad = pb.SamplingParams(max_new_tokens=2, num_speculative_tokens=99)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(token_ids=[1, 2], sampling_params=bad)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_speculative_tokens" in (err.value.details() or "")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="x")
    client.completions.create(
        model=served.cluster.model_info.model_name,
        prompt=[1, 2],
        max_tokens=2,
        extra_body={"num_speculative_tokens": 0},
    )
    assert served.cluster.params[-1].num_speculative_tokens == 0
    with pytest.raises(openai.BadRequestError) as bad_http:
        client.completions.create(
            model=served.cluster.model_info.model_name,
            prompt=[1, 2],
            max_tokens=2,
            extra_body={"num_speculative_tokens": 99},
        )
    assert "num_speculative_tokens" in str(bad_http.value)
