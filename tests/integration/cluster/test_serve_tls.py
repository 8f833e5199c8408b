"""The Serve app over TLS: Serve's own HTTP proxy serves HTTPS (`http_options` ssl_certfile /
ssl_keyfile, what the Helm chart sets in rayservice mode), and the stock `openai` client with
an https base URL and the CA bundle works with the API key and is refused without it. Serve's
gRPC proxy has no TLS option: the README says so."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from ray import serve
from test_grpc_security import self_signed

from swaserve.cluster.serve import build_app

pytestmark = pytest.mark.slow
KEY = "serve-tls-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tls_app(
    ray_session: str, cluster_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[int, Path]]:
    cert, key = self_signed(tmp_path_factory.mktemp("serve-tls"))
    port = free_port()
    serve.start(
        http_options={
            "host": "127.0.0.1",
            "port": port,
            "ssl_certfile": str(cert),
            "ssl_keyfile": str(key),
        }
    )
    try:
        args = {"model": str(cluster_model), "replicas": 1, "device": "cpu", "api_key": KEY}
        serve.run(build_app({**args, "max_total_tokens": 1024}), name="tls", route_prefix="/")
        yield port, cert
    finally:
        serve.shutdown()


def test_the_serve_app_speaks_https_to_a_client_with_the_ca_and_the_key(
    tls_app: tuple[int, Path], cluster_model: Path
) -> None:
    port, ca = tls_app
    context = ssl.create_default_context(cafile=str(ca))

    def client(api_key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1",
            api_key=api_key,
            max_retries=0,
            timeout=120,
            http_client=openai.DefaultHttpxClient(verify=context),
        )

    out = client(KEY).completions.create(
        model=cluster_model.name, prompt=[1, 2, 3], max_tokens=3, temperature=0
    )
    assert out.usage is not None and out.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        client("wrong").models.list()
    with pytest.raises(openai.APIConnectionError):  # a client that does not trust the CA
        openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=30
        ).models.list()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/health", timeout=30)  # no plain text
