"""The bearer token and TLS, with the stock gRPC client."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cluster_harness import ServedCluster, greedy
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swaserve.cluster.grpc_server import GrpcServerConfig
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

TOKEN = "s3cret-token"


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 / localhost and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "server.crt", tmp_path / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


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
