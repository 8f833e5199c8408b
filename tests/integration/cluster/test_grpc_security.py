"""The bearer token, TLS and mutual TLS, with the stock gRPC client, and TLS and mutual TLS on
the OpenAI HTTP port with the stock `openai` client (an `https` base URL and a CA bundle)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import openai
import pytest
import requests
from cluster_harness import ServedCluster, greedy
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_grpc_cluster import grpcurl

from swaserve.cluster.cli import main
from swaserve.cluster.client import open_channel
from swaserve.cluster.grpc_server import GrpcServerConfig
from swaserve.cluster.http_server import HttpServer
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

TOKEN = "s3cret-token"


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 / localhost and its key, as PEM files."""
    return issue(tmp_path, "server", None)


def issue(
    tmp_path: Path, name: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None
) -> tuple[Path, Path]:
    """`name`.crt / `name`.key: a certificate for 127.0.0.1 / localhost, signed by `ca` (a
    certificate and its key), or by itself when None."""
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = certificate(name, key, ca, san)
    cert_file, key_file = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def certificate_authority(
    tmp_path: Path,
) -> tuple[Path, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A CA: its PEM file, certificate and key."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = certificate(
        "swaserve test CA", key, None, x509.BasicConstraints(ca=True, path_length=None)
    )
    path = tmp_path / "ca.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, cert, key


def certificate(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    extension: x509.ExtensionType,
) -> x509.Certificate:
    """A day's certificate of `key` named `name`, with `extension`, signed by `ca` or itself."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer, signer = (subject, key) if ca is None else (ca[0].subject, ca[1])
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(extension, critical=isinstance(extension, x509.BasicConstraints))
        .sign(signer, hashes.SHA256())
    )


def generate_once(
    channel: grpc.Channel, metadata: list[tuple[str, str]] | None = None
) -> list[int]:
    stub = pb_grpc.InferenceStub(channel)
    request = pb.GenerateRequest(token_ids=[1, 2, 3], sampling_params=greedy(3))
    return [
        t for item in stub.Generate(request, metadata=metadata, timeout=30) for t in item.token_ids
    ]


def test_bearer_token_is_required_on_every_rpc_but_health(two_workers: ServedCluster) -> None:
    server = two_workers.add_server(GrpcServerConfig(port=0, auth_token=TOKEN))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        calls = [
            lambda md: generate_once(channel, md),
            lambda md: stub.GetLoad(pb.GetLoadRequest(), metadata=md, timeout=10),
            lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=10),
            lambda md: stub.Abort(pb.AbortRequest(request_id="x"), metadata=md, timeout=10),
        ]
        for call in calls:
            for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]):
                with pytest.raises(grpc.RpcError) as err:
                    call(metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call([("authorization", f"Bearer {TOKEN}")])  # passes
        assert len(generate_once(channel, [("authorization", f"Bearer {TOKEN}")])) == 3
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)  # no token needed
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tls_serves_a_client_that_trusts_the_certificate(
    two_workers: ServedCluster, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    server = two_workers.add_server(
        GrpcServerConfig(port=0, tls_cert_file=str(cert), tls_key_file=str(key))
    )
    address = f"127.0.0.1:{server.port}"
    credentials = grpc.ssl_channel_credentials(cert.read_bytes())
    with grpc.secure_channel(address, credentials) as channel:
        assert len(generate_once(channel)) == 3
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        generate_once(channel)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port


def test_tls_needs_both_files(tmp_path: Path) -> None:
    cert, _ = self_signed(tmp_path)
    with pytest.raises(ValueError, match="both"):
        GrpcServerConfig(tls_cert_file=str(cert))
    with pytest.raises(ValueError, match="does not exist"):
        GrpcServerConfig(tls_cert_file=str(cert), tls_key_file=str(tmp_path / "missing.key"))


def test_tls_needs_the_pair_before_a_client_ca(tmp_path: Path) -> None:
    ca, _, _ = certificate_authority(tmp_path)
    with pytest.raises(ValueError, match="mutual TLS"):
        GrpcServerConfig(tls_ca_file=str(ca))


def test_mutual_tls_on_grpc_refuses_a_client_without_a_certificate_of_the_ca(
    two_workers: ServedCluster, tmp_path: Path
) -> None:
    ca_file, ca_cert, ca_key = certificate_authority(tmp_path)
    cert, key = issue(tmp_path, "server", (ca_cert, ca_key))
    client_cert, client_key = issue(tmp_path, "client", (ca_cert, ca_key))
    stranger_cert, stranger_key = issue(tmp_path, "stranger", None)  # not the CA's
    server = two_workers.add_server(
        GrpcServerConfig(
            port=0, tls_cert_file=str(cert), tls_key_file=str(key), tls_ca_file=str(ca_file)
        )
    )
    address = f"127.0.0.1:{server.port}"
    root = ca_file.read_bytes()
    with grpc.secure_channel(
        address,
        grpc.ssl_channel_credentials(root, client_key.read_bytes(), client_cert.read_bytes()),
    ) as channel:
        assert len(generate_once(channel)) == 3
    with open_channel(address, str(ca_file), str(client_cert), str(client_key)) as channel:
        assert len(generate_once(channel)) == 3  # `swaserve client --tls-cert-file ...`
    with pytest.raises(ValueError, match="both"):
        open_channel(address, str(ca_file), str(client_cert))
    probe = ["client", "--server", address, "--health", "--tls-ca-file", str(ca_file)]
    probe += ["--tls-server-name", "localhost", "--timeout-s", "10"]  # as the chart's probes
    assert (
        main([*probe, "--tls-cert-file", str(client_cert), "--tls-key-file", str(client_key)]) == 0
    )
    assert main(probe) == 1  # no client certificate
    trusting = [grpcurl(), "-cacert", str(ca_file)]
    with_cert = [*trusting, "-cert", str(client_cert), "-key", str(client_key)]
    listed = subprocess.run(
        [*with_cert, address, "list"], capture_output=True, text=True, timeout=60, check=True
    )
    assert "swaserve.v1.Inference" in listed.stdout.split()
    refused = subprocess.run(
        [*trusting, address, "list"], capture_output=True, text=True, timeout=60, check=False
    )
    assert refused.returncode != 0  # grpcurl without a client certificate
    for credentials in (
        grpc.ssl_channel_credentials(root),  # no client certificate
        grpc.ssl_channel_credentials(root, stranger_key.read_bytes(), stranger_cert.read_bytes()),
    ):
        with (
            grpc.secure_channel(address, credentials) as channel,
            pytest.raises(grpc.RpcError) as err,
        ):
            generate_once(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def openai_over(
    server: HttpServer, ca_file: Path, cert: tuple[Path, Path] | None = None
) -> openai.OpenAI:
    """The stock client against `server`'s https URL, trusting `ca_file`, presenting `cert`."""
    context = ssl.create_default_context(cafile=str(ca_file))
    if cert is not None:
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    http_client = openai.DefaultHttpxClient(verify=context)
    return openai.OpenAI(
        base_url=f"{server.scheme}://127.0.0.1:{server.port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
        http_client=http_client,
    )


def complete(client: openai.OpenAI, model: str) -> int:
    out = client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=3, temperature=0)
    assert out.usage is not None
    return out.usage.completion_tokens


def test_the_http_api_over_tls_and_mutual_tls(two_workers: ServedCluster, tmp_path: Path) -> None:
    """With the TLS files the HTTP port speaks HTTPS only; with a client CA too, only to
    clients that present a certificate it signed."""
    info = two_workers.cluster.model_info
    assert info is not None
    ca_file, ca_cert, ca_key = certificate_authority(tmp_path)
    cert, key = issue(tmp_path, "server", (ca_cert, ca_key))
    client_cert = issue(tmp_path, "client", (ca_cert, ca_key))
    stranger = issue(tmp_path, "stranger", None)
    tls = HttpServer(two_workers.cluster, port=0, tls_cert_file=str(cert), tls_key_file=str(key))
    mutual = HttpServer(
        two_workers.cluster,
        port=0,
        tls_cert_file=str(cert),
        tls_key_file=str(key),
        tls_ca_file=str(ca_file),
    )
    for server in (tls, mutual):
        two_workers.loop.run(server.start())
    try:
        assert tls.scheme == "https"
        assert complete(openai_over(tls, ca_file), info.model_name) == 3
        with pytest.raises(openai.APIConnectionError):  # a client that trusts another CA
            complete(openai_over(tls, stranger[0]), info.model_name)
        with pytest.raises(requests.ConnectionError):  # plain text to the TLS port
            requests.get(f"http://127.0.0.1:{tls.port}/health", timeout=10)
        assert complete(openai_over(mutual, ca_file, client_cert), info.model_name) == 3
        for cert_pair in (None, stranger):
            with pytest.raises(openai.APIConnectionError):
                complete(openai_over(mutual, ca_file, cert_pair), info.model_name)
    finally:
        for server in (tls, mutual):
            two_workers.loop.run(server.stop())
    with pytest.raises(ValueError, match="mutual TLS"):
        HttpServer(two_workers.cluster, port=0, tls_ca_file=str(ca_file))


def rotate(tmp_path: Path, cert: Path, key: Path) -> Path:
    """Overwrite `cert` / `key` in place with a pair of a new CA (as a renewed Secret does);
    returns the new CA's file."""
    fresh = tmp_path / "rotated"
    fresh.mkdir()
    ca_file, ca_cert, ca_key = certificate_authority(fresh)
    new_cert, new_key = issue(fresh, "server", (ca_cert, ca_key))
    key.write_bytes(new_key.read_bytes())  # key first: a half-done rotation is skipped
    cert.write_bytes(new_cert.read_bytes())
    return ca_file


def test_a_rotated_certificate_is_served_without_a_restart(
    two_workers: ServedCluster, tmp_path: Path
) -> None:
    """gRPC reads the files again at a new connection's handshake; the HTTP server polls them
    (here every 50 ms: the test waits for its reload count) and loads them into its live SSL
    context. Connections made after the rotation see the new certificate."""
    info = two_workers.cluster.model_info
    assert info is not None
    ca_file, ca_cert, ca_key = certificate_authority(tmp_path)
    cert, key = issue(tmp_path, "server", (ca_cert, ca_key))
    grpc_server = two_workers.add_server(
        GrpcServerConfig(port=0, tls_cert_file=str(cert), tls_key_file=str(key))
    )
    http = HttpServer(
        two_workers.cluster, port=0, tls_cert_file=str(cert), tls_key_file=str(key), tls_poll_s=0.05
    )
    two_workers.loop.run(http.start())
    address = f"127.0.0.1:{grpc_server.port}"
    try:
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca_file.read_bytes())) as ch:
            assert len(generate_once(ch)) == 3
        assert complete(openai_over(http, ca_file), info.model_name) == 3
        new_ca = rotate(tmp_path, cert, key)
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(new_ca.read_bytes())) as ch:
            assert len(generate_once(ch)) == 3
        with (
            grpc.secure_channel(address, grpc.ssl_channel_credentials(ca_file.read_bytes())) as ch,
            pytest.raises(grpc.RpcError),
        ):
            generate_once(ch)  # the old CA no longer matches what is served
        assert grpc_server.tls is not None and grpc_server.tls.reloads == 1
        wait_for(lambda: http.tls is not None and http.tls.reloads == 1)
        assert complete(openai_over(http, new_ca), info.model_name) == 3
        with pytest.raises(openai.APIConnectionError):
            complete(openai_over(http, ca_file), info.model_name)
        assert not http.reload_tls()  # nothing changed since
    finally:
        two_workers.loop.run(http.stop())


def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Until `condition()` holds (a bound, not a wait: it returns as soon as it does)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)
