"""The checked-in gRPC stubs of `swaserve/v1/inference.proto`: what `proto/generate_stubs.py`
makes, byte for byte; proto3 `optional` presence; the service's four methods."""

from __future__ import annotations

from pathlib import Path

import grpc

from swaserve.proto.generate_stubs import PROTO_ROOT, generate, stub_paths
from swaserve.proto.swaserve.v1 import inference_pb2, inference_pb2_grpc


def test_checked_in_stubs_are_what_the_generator_makes(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    checked_in = stub_paths(PROTO_ROOT)
    assert [p.name for p in fresh] == [
        "inference_pb2.py",
        "inference_pb2.pyi",
        "inference_pb2_grpc.py",
    ]
    for new, old in zip(fresh, checked_in, strict=True):
        assert new.read_bytes() == old.read_bytes(), (
            f"{old} is stale: run `python proto/generate_stubs.py` and commit the result"
        )
    grpc_stub = fresh[2].read_text()
    assert "from . import inference_pb2 as swaserve_dot_v1_dot_inference__pb2\n" in grpc_stub
    assert "from swaserve.v1 import" not in grpc_stub


def test_generate_request_round_trips_and_keeps_optional_presence() -> None:
    request = inference_pb2.GenerateRequest(
        request_id="r1",
        token_ids=[5, 6, 7],
        session_id="s",
        sampling_params=inference_pb2.SamplingParams(
            max_new_tokens=16, top_k=0, seed=0, stop=["\n\n"], stop_token_ids=[257]
        ),
    )
    parsed = inference_pb2.GenerateRequest.FromString(request.SerializeToString())

    assert parsed == request
    assert list(parsed.token_ids) == [5, 6, 7]
    assert parsed.text == ""
    params = parsed.sampling_params
    assert params.max_new_tokens == 16
    assert list(params.stop) == ["\n\n"]
    assert list(params.stop_token_ids) == [257]
    # Set to the zero value is still set; never set reads 0.0 but is absent.
    assert params.HasField("top_k") and params.top_k == 0
    assert params.HasField("seed") and params.seed == 0
    assert not params.HasField("temperature") and params.temperature == 0.0
    assert not params.HasField("top_p")
    assert not params.HasField("min_p")
    assert params.ignore_eos is False


def test_inference_service_has_four_methods_and_generate_streams() -> None:
    service = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    assert service.full_name == "swaserve.v1.Inference"
    methods = {m.name: m for m in service.methods}
    assert sorted(methods) == ["Abort", "Generate", "GetLoad", "GetModelInfo"]
    streaming = {name: (m.client_streaming, m.server_streaming) for name, m in methods.items()}
    assert streaming == {
        "Generate": (False, True),
        "Abort": (False, False),
        "GetModelInfo": (False, False),
        "GetLoad": (False, False),
    }
    assert methods["Generate"].input_type.full_name == "swaserve.v1.GenerateRequest"
    assert methods["Generate"].output_type.full_name == "swaserve.v1.GenerateResponse"
    with grpc.insecure_channel("localhost:1") as channel:  # lazy: nothing connects
        stub = inference_pb2_grpc.InferenceStub(channel)
        assert isinstance(stub.Generate, grpc.UnaryStreamMultiCallable)
        assert isinstance(stub.GetLoad, grpc.UnaryUnaryMultiCallable)


def test_messages_pickle_under_their_installed_module() -> None:
    """Ray Serve's gRPC proxy pickles requests: the classes must name an importable module."""
    import pickle

    from swaserve.proto.swaserve.v1 import inference_pb2 as pb

    assert pb.GenerateRequest.__module__ == "swaserve.proto.swaserve.v1.inference_pb2"
    request = pb.GenerateRequest(token_ids=[1, 2], sampling_params=pb.SamplingParams(seed=3))
    assert pickle.loads(pickle.dumps(request)) == request
