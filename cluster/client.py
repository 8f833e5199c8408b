"""`swaserve client`: stream a completion from a running `swaserve serve` over gRPC (or show
its model and load).

    swaserve client --server 127.0.0.1:50051 'Hello, swaserve!'
    swaserve client --server 127.0.0.1:50051 --load
    swaserve client --server 127.0.0.1:50051 --health   # exit 0 when SERVING (a probe)
    swaserve client --json-schema pet.json --logprobs 2 --json 'A pet as JSON:'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swaserve.proto import environment
from swaserve.proto.environment import AUTH_TOKEN_ENV
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="*", help="prompt text (joined with spaces)")
    parser.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the server")
    parser.add_argument("--token-ids", help="comma-separated prompt token ids instead of text")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--logprobs", type=int, default=None, help="top log-probabilities (0-20)")
    parser.add_argument("--presence-penalty", type=float, default=None)
    parser.add_argument("--frequency-penalty", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json-schema", help="JSON schema file the output must match")
    output.add_argument("--regex", help="regular expression the output must match")
    parser.add_argument("--session-id", default="", help="keeps a conversation's turns together")
    parser.add_argument("--request-id", default="")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="the call's deadline")
    parser.add_argument("--tls-ca-file", help="PEM CA bundle: connect over TLS")
    parser.add_argument(
        "--tls-cert-file", help="PEM client certificate (mutual TLS; with --tls-ca-file)"
    )
    parser.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file")
    parser.add_argument(
        "--tls-server-name",
        help="the name the server's certificate must carry (default: the --server host)",
    )
    parser.add_argument("--auth-token-file", help=f"bearer token file (or ${AUTH_TOKEN_ENV})")
    parser.add_argument("--json", action="store_true", help="one JSON object per stream item")
    parser.add_argument("--info", action="store_true", help="print GetModelInfo and exit")
    parser.add_argument("--load", action="store_true", help="print GetLoad and exit")
    parser.add_argument(
        "--health",
        action="store_true",
        help="check grpc.health.v1 and exit: 0 when SERVING (a Kubernetes exec probe over TLS)",
    )


def open_channel(
    server: str,
    tls_ca_file: str | None = None,
    tls_cert_file: str | None = None,
    tls_key_file: str | None = None,
    tls_server_name: str | None = None,
) -> grpc.Channel:
    """Plain text, or TLS trusting `tls_ca_file`, presenting a client certificate (mutual
    TLS) when `tls_cert_file` / `tls_key_file` are given, and checking the server's
    certificate against `tls_server_name` instead of `server`'s host when given."""
    if (tls_cert_file is None) != (tls_key_file is None):
        raise ValueError("a client certificate needs both --tls-cert-file and --tls-key-file")
    if tls_cert_file and not tls_ca_file:
        raise ValueError("a client certificate (mutual TLS) needs --tls-ca-file")
    if tls_ca_file:
        credentials = grpc.ssl_channel_credentials(
            Path(tls_ca_file).read_bytes(),
            Path(tls_key_file).read_bytes() if tls_key_file else None,
            Path(tls_cert_file).read_bytes() if tls_cert_file else None,
        )
        options = (
            [] if not tls_server_name else [("grpc.ssl_target_name_override", tls_server_name)]
        )
        return grpc.secure_channel(server, credentials, options=options)
    return grpc.insecure_channel(server)


def _metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    token = environment.auth_token(args.auth_token_file)
    return [("authorization", f"Bearer {token}")] if token else []


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_new_tokens=args.max_new_tokens, stop=args.stop)
    optional = (
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    )
    for name in optional:
        if getattr(args, name) is not None:
            setattr(params, name, getattr(args, name))
    if args.json_schema:
        schema = Path(args.json_schema).read_text()
        params.structured_outputs.CopyFrom(pb.StructuredOutputs(json_schema=schema))
    elif args.regex:
        params.structured_outputs.CopyFrom(pb.StructuredOutputs(regex=args.regex))
    request = pb.GenerateRequest(
        request_id=args.request_id, session_id=args.session_id, sampling_params=params
    )
    if args.token_ids:
        request.token_ids.extend(int(t) for t in args.token_ids.split(","))
    else:
        request.text = " ".join(args.prompt) or "Hello, swaserve!"
    return request


def run(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    metadata = _metadata(args)
    with open_channel(
        args.server, args.tls_ca_file, args.tls_cert_file, args.tls_key_file, args.tls_server_name
    ) as channel:
        stub = pb_grpc.InferenceStub(channel)
        try:
            if args.health:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=args.timeout_s
                )
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                print(status)
                return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
            if args.info or args.load:
                reply = (
                    stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10)
                    if args.info
                    else stub.GetLoad(pb.GetLoadRequest(), metadata=metadata, timeout=10)
                )
                print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True)))
                return 0
            last = None
            for item in stub.Generate(
                build_request(args), metadata=metadata, timeout=args.timeout_s
            ):
                last = item
                if args.json:
                    print(json.dumps(MessageToDict(item)), flush=True)
                else:
                    print(item.text, end="", flush=True)
        except grpc.RpcError as exc:
            print(f"\nswaserve client: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if last is not None and not args.json:
        usage = last.usage
        print(
            f"\n[{last.finish_reason}; {usage.prompt_tokens} prompt tokens "
            f"({usage.cached_tokens} cached), {usage.completion_tokens} new; {last.worker_id}]"
        )
    return 0
