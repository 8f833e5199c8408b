"""The Ray Serve application on the session's Ray: the stock `openai` client over Serve's HTTP
proxy, the gRPC API through Serve's gRPC proxy, the router's placement, 429, /metrics, the body
limit, the API key on the gRPC path, and a replica replaced after its TP rank died."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
import requests
import yaml
from cluster_harness import STARTUP_TIMEOUT_S, reference_tokens
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.config import gRPCOptions
from ray.serve.schema import ServeDeploySchema
from ray.util.placement_group import placement_group_table

from swaserve.cluster.openai_api import MAX_BODY_BYTES
from swaserve.cluster.serve import GRPC_SERVICER_FUNCTION, ServeAppArgs, build_app
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
APP = "swaserve"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeApp:
    def __init__(self, http_port: int, grpc_port: int, model: Path) -> None:
        self.http_port, self.grpc_port, self.model = http_port, grpc_port, model

    def client(self, prefix: str = "") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.http_port}{prefix}/v1",
            api_key="unused",
            max_retries=0,
        )

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics").read()
        out = {}
        for family in text_string_to_metric_families(text.decode()):
            for s in family.samples:
                out[s.name, tuple(sorted(s.labels.items()))] = s.value
        return out


@pytest.fixture(scope="module")
def serve_app(ray_session: str, cluster_model: Path) -> Iterator[ServeApp]:
    http_port, grpc_port = free_port(), free_port()
    serve.start(
        http_options={"host": "127.0.0.1", "port": http_port},
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER_FUNCTION]),
    )
    try:
        args = {"model": str(cluster_model), "replicas": "2", "tp_size": "1", "device": "cpu"}
        serve.run(build_app({**args, "max_total_tokens": "2048"}), name=APP, route_prefix="/")
        tight = {**args, "replicas": 1, "max_total_tokens": 512, "router_max_queue_len": 0}
        serve.run(build_app(tight), name="tight", route_prefix="/tight")
        yield ServeApp(http_port, grpc_port, cluster_model)
    finally:
        serve.shutdown()


def test_openai_client_streams_chat_and_completion_with_the_engines_tokens(
    serve_app: ServeApp,
) -> None:
    client = serve_app.client()
    model = serve_app.model.name
    assert [m.id for m in client.models.list().data] == [model]
    prompt = [3, 14, 15, 92, 65, 35]
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert text == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"
    # the same prompt over Serve's gRPC proxy gives the engine's tokens
    with grpc.insecure_channel(f"127.0.0.1:{serve_app.grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(
            token_ids=prompt, sampling_params=pb.SamplingParams(max_new_tokens=6, temperature=0)
        )
        items = list(stub.Generate(request, metadata=[("application", APP)], timeout=60))
        load = stub.GetLoad(pb.GetLoadRequest(), metadata=[("application", APP)], timeout=30)
    ids = [t for item in items for t in item.token_ids]
    assert ids == reference_tokens(serve_app.model, [prompt], [6])[0]
    assert items[-1].finish_reason == "length"
    assert len(load.workers) == 2
    assert all(w.full_total_tokens == 2048 for w in load.workers)


def test_second_turn_through_serve_reuses_the_first_turns_cache(serve_app: ServeApp) -> None:
    client = serve_app.client()
    model = serve_app.model.name
    turn1 = [(5 * i + 7) % 250 for i in range(40)]
    first = client.completions.create(
        model=model, prompt=turn1, max_tokens=8, temperature=0, user="session-7"
    )
    answer = reference_tokens(serve_app.model, [turn1], [8])[0]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = [*turn1, *answer, 1, 2, 3]
    second = client.completions.create(
        model=model, prompt=turn2, max_tokens=4, temperature=0, user="session-7"
    )
    assert second.usage.prompt_tokens_details.cached_tokens == len(turn1) + len(answer) - 1


def test_structured_output_and_logprobs_through_serve(serve_app: ServeApp) -> None:
    client = serve_app.client()
    model = serve_app.model.name
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "rank": {"enum": [1, 2, 3]},
            "sites": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        },
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    for seed in range(6):
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "A city?"}],
            max_tokens=100,
            temperature=1.0,
            seed=seed,
            response_format=fmt,  # type: ignore[arg-type]
            logprobs=True,
            top_logprobs=1,
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content or ""), schema)
        content = out.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and len(content) == out.usage.completion_tokens  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"uniqueItems": True}},
            },  # type: ignore[arg-type]
        )
    assert err.value.body["param"] == "response_format"


def test_malformed_requests_get_openai_errors(serve_app: ServeApp) -> None:
    client = serve_app.client()
    model = serve_app.model.name
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=[1, 999], max_tokens=3)
    assert "vocabulary" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="another-model", prompt="x", max_tokens=3)


def test_a_request_the_router_cannot_place_gets_429(serve_app: ServeApp) -> None:
    client = serve_app.client("/tight")
    model = serve_app.model.name
    started = threading.Event()
    done: list[str] = []

    def hold() -> None:
        stream = client.completions.create(
            model=model,
            prompt=[1, 2, 3],
            max_tokens=450,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                done.append(chunk.choices[0].finish_reason)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert started.wait(60)
        # Not held by stopping its worker, as the gRPC and HTTP ingresses' 429 tests are: a
        # stopped worker replica stalled Serve's router replica (health checks and queue
        # probes unanswered) until Serve killed it. The holder has 449 decode steps to go
        # when the refused request is routed.
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(
                model=model, prompt=[4, 5, 6], max_tokens=450, extra_body={"ignore_eos": True}
            )
        assert err.value.response.headers["retry-after"] == "1"
        assert err.value.body["type"] == "rate_limit_error" or err.value.status_code == 429
    finally:
        holder.join(120)
    assert done == ["length"]


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == x for k, x in labels.items())
    )


def test_metrics_list_the_names_and_follow_the_requests(serve_app: ServeApp) -> None:
    client = serve_app.client()
    model = serve_app.model.name
    before = serve_app.metrics()
    client.completions.create(model=model, prompt=[9, 8, 7, 6], max_tokens=3, temperature=0)
    # The prefix-cache counters come with the worker's report, which may reach the router
    # after the answer reached us: wait for it.
    queries = "swaserve:prefix_cache_queries_total"
    deadline = time.monotonic() + 60
    while total(after := serve_app.metrics(), queries) == total(before, queries):
        assert time.monotonic() < deadline, "the worker's report never came"
        time.sleep(0.1)
    names = {name for name, _ in after}
    for name in (
        "swaserve:num_requests_running",
        "swaserve:num_requests_waiting",
        "swaserve:token_usage",
        "swaserve:swa_token_usage",
        "swaserve:swa_tombstoned_tokens",
        "swaserve:prefix_cache_queries_total",
        "swaserve:prefix_cache_hits_total",
        "swaserve:time_to_first_token_seconds_count",
        "swaserve:inter_token_latency_seconds_count",
        "swaserve:e2e_request_latency_seconds_count",
        "swaserve:router_decisions_total",
        "swaserve:request_queue_time_seconds_count",
        "swaserve:request_prefill_time_seconds_count",
    ):
        assert name in names, name
    for name in (
        "swaserve:time_to_first_token_seconds_count",
        "swaserve:request_route_time_seconds_count",
        "swaserve:request_transport_time_seconds_count",
        "swaserve:prefix_cache_queries_total",
    ):
        assert total(after, name) > total(before, name), name
    routed = total(after, "swaserve:router_decisions_total", policy="ttft", outcome="routed")
    assert routed > total(
        before, "swaserve:router_decisions_total", policy="ttft", outcome="routed"
    )
    workers = {dict(ls)["worker"] for n, ls in after if n == "swaserve:num_requests_running"}
    assert len(workers) == 2


def test_serve_yaml_parses_and_names_the_builder_with_args_it_accepts() -> None:
    config = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    schema = ServeDeploySchema(**config)
    app = schema.applications[0]
    assert app.import_path == "swaserve.cluster.serve:build_app"
    assert config["grpc_options"]["grpc_servicer_functions"] == [GRPC_SERVICER_FUNCTION]
    args = ServeAppArgs(**app.args)
    args.check_extra()
    assert args.replicas == 2
    assert args.router_config().policy == "ttft"


def test_build_app_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown argument"):
        build_app({"no_such_knob": 1})
    with pytest.raises(ValueError, match="replicas"):
        build_app({"replicas": 0})
    with pytest.raises(ValueError, match="policy"):
        build_app({"router_policy": "random-ish"})


def test_a_tp2_worker_replica_holds_both_ranks_in_its_placement_group(serve_app: ServeApp) -> None:
    args = {
        "model": str(serve_app.model),
        "replicas": 1,
        "tp_size": 2,
        "device": "cpu",
        "max_total_tokens": 2048,
    }
    serve.run(build_app(args), name="tp2", route_prefix="/tp2")
    try:
        client = serve_app.client("/tp2")
        prompt = [21, 22, 23, 24, 25]
        out = client.completions.create(
            model=serve_app.model.name, prompt=prompt, max_tokens=6, temperature=0
        )
        assert out.usage.completion_tokens == 6
        status = serve.status().applications["tp2"].deployments["SwaWorker"]
        assert status.replica_states == {"RUNNING": 1}
        groups = [
            g
            for g in placement_group_table().values()
            if g["state"] == "CREATED" and g["strategy"] == "STRICT_PACK"
        ]
        assert [{"CPU": 1.0}, {"CPU": 1.0}] in [list(g["bundles"].values()) for g in groups]
        with grpc.insecure_channel(f"127.0.0.1:{serve_app.grpc_port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(
                token_ids=prompt, sampling_params=pb.SamplingParams(max_new_tokens=6, temperature=0)
            )
            items = list(stub.Generate(request, metadata=[("application", "tp2")], timeout=60))
            info = stub.GetModelInfo(
                pb.GetModelInfoRequest(), metadata=[("application", "tp2")], timeout=30
            )
        assert [t for i in items for t in i.token_ids] == reference_tokens(
            serve_app.model, [prompt], [6]
        )[0]
        assert info.tp_size == 2
    finally:
        serve.delete("tp2")


AGENT_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,  # else a random model adds keys until max_tokens
}


@pytest.mark.parametrize("native", ["gpt-oss", "mimo-v2-flash"])
def test_tool_calls_and_a_stored_conversation_through_serve_on_each_chat_format(
    serve_app: ServeApp, tiny_model_factory: Callable[..., Path], native: str
) -> None:
    """A model in its own chat format (harmony; MiMo's) behind Serve with two ingress
    replicas: a required tool call validates and its result's follow-up hits the cache, and a
    Responses conversation continues by `previous_response_id` turn after turn whichever
    ingress replica each request reaches (the store is one deployment)."""
    model = tiny_model_factory(native, num_layers=2, sliding_window_size=8, native_chat=True)
    args = {
        "model": str(model),
        "replicas": 1,
        "ingress_replicas": 2,
        "device": "cpu",
        "max_total_tokens": 4096,
    }
    app = f"agents-{native}"
    serve.run(build_app(args), name=app, route_prefix=f"/{app}")
    try:
        client = serve_app.client(f"/{app}")
        tool = {"type": "function", "function": {"name": "weather", "parameters": AGENT_SCHEMA}}
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather?"}]
        # a random model rarely ends harmony's analysis: bias its channel's first letter away
        bias = {"97": -100} if native == "gpt-oss" else None
        out = client.chat.completions.create(
            model=model.name,
            messages=messages,  # type: ignore[arg-type]
            tools=[tool],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=1,
            max_tokens=120,
            logit_bias=bias,  # type: ignore[arg-type]
        )
        assert out.choices[0].finish_reason == "tool_calls"
        (call,) = out.choices[0].message.tool_calls or []
        jsonschema.validate(json.loads(call.function.arguments), AGENT_SCHEMA)
        messages += [
            out.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        follow = client.chat.completions.create(
            model=model.name,
            messages=messages,  # type: ignore[arg-type]
            tools=[tool],  # type: ignore[list-item]
            max_tokens=3,
            temperature=0,
        )
        assert follow.usage is not None and follow.usage.prompt_tokens_details is not None
        assert follow.usage.prompt_tokens_details.cached_tokens > 0
        previous = client.responses.create(model=model.name, input="Hi", max_output_tokens=3)
        for turn in range(6):
            previous = client.responses.create(
                model=model.name,
                input=f"Turn {turn}",
                previous_response_id=previous.id,
                max_output_tokens=3,
            )
            assert client.responses.retrieve(previous.id).id == previous.id
        assert previous.usage is not None
        assert previous.usage.input_tokens_details.cached_tokens > 0
        client.responses.delete(previous.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(previous.id)
    finally:
        serve.delete(app)


def test_the_http_api_key_comes_from_args_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SWASERVE_API_KEY", raising=False)
    assert ServeAppArgs().resolved_api_key() is None
    secret = tmp_path / "key"
    secret.write_text("from-file\n")
    assert ServeAppArgs(api_key_file=str(secret)).resolved_api_key() == "from-file"
    monkeypatch.setenv("SWASERVE_API_KEY", "from-env")
    assert ServeAppArgs().resolved_api_key() == "from-env"
    assert ServeAppArgs(api_key="inline").resolved_api_key() == "inline"


def test_a_body_over_the_limit_gets_a_413_through_serves_proxy(serve_app: ServeApp) -> None:
    url = f"http://127.0.0.1:{serve_app.http_port}/v1/completions"
    body = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 4_000_000), "max_tokens": 1}).encode()
    chunked = (body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20))
    for data in (body, chunked):
        reply = requests.post(
            url, data=data, headers={"Content-Type": "application/json"}, timeout=120
        )
        assert reply.status_code == 413
        error = reply.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
    ok = serve_app.client().completions.create(
        model=serve_app.model.name, prompt=[1, 2, 3], max_tokens=2, temperature=0
    )
    assert ok.usage is not None and ok.usage.completion_tokens == 2


def test_grpc_through_serves_proxy_needs_the_api_key_when_one_is_set(serve_app: ServeApp) -> None:
    """... and the app's limits hold on both of its ingresses, the key's one budget shared."""
    key = "grpc-s3cret"
    args = {"model": str(serve_app.model), "replicas": 1, "device": "cpu", "api_key": key}
    args |= {"limit_requests_per_second": 0.001, "limit_burst": 3, "limit_max_tokens": 8}
    serve.run(build_app({**args, "max_total_tokens": 1024}), name="keyed", route_prefix="/keyed")
    try:
        prompt = [31, 32, 33]
        request = pb.GenerateRequest(
            token_ids=prompt, sampling_params=pb.SamplingParams(max_new_tokens=4, temperature=0)
        )
        app = ("application", "keyed")
        with grpc.insecure_channel(f"127.0.0.1:{serve_app.grpc_port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            for metadata in ([app], [app, ("authorization", "Bearer wrong")]):
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Generate(request, metadata=metadata, timeout=60))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetLoad(pb.GetLoadRequest(), metadata=metadata, timeout=60)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            good = [app, ("authorization", f"Bearer {key}")]
            items = list(stub.Generate(request, metadata=good, timeout=60))
            load = stub.GetLoad(pb.GetLoadRequest(), metadata=good, timeout=60)
            bad = pb.GenerateRequest(token_ids=[1, 999])  # a failure before any item
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(bad, metadata=good, timeout=60))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "outside the vocabulary" in (err.value.details() or "")
        assert [t for i in items for t in i.token_ids] == reference_tokens(
            serve_app.model, [prompt], [4]
        )[0]
        assert len(load.workers) == 1
        with pytest.raises(openai.AuthenticationError):
            serve_app.client("/keyed").models.list()
        keyed = openai.OpenAI(
            base_url=f"http://127.0.0.1:{serve_app.http_port}/keyed/v1", api_key=key, max_retries=0
        )
        model = serve_app.model.name
        with pytest.raises(openai.BadRequestError) as capped:  # the key's third request
            keyed.completions.create(model=model, prompt=prompt, max_tokens=9)
        assert capped.value.body["param"] == "max_tokens"  # type: ignore[index]
        with pytest.raises(openai.RateLimitError) as limited:
            keyed.completions.create(model=model, prompt=prompt, max_tokens=2)
        assert int(limited.value.response.headers["retry-after"]) >= 1
        with grpc.insecure_channel(f"127.0.0.1:{serve_app.grpc_port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, metadata=good, timeout=60))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        serve.delete("keyed")


def _alive(actor_class: str) -> list[dict[str, Any]]:
    """The live actors of `actor_class` (Ray's state API needs a dashboard the session's Ray
    has not got)."""
    from ray._private import state

    return [
        a
        for a in state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"] == actor_class
    ]


def _replica_pids(app: str, deployment: str) -> list[int]:
    return [a["Pid"] for a in _alive(f"ServeReplica:{app}:{deployment}")]


def _owned_pids(app: str, deployment: str, actor_class: str) -> list[int]:
    """The processes of the `actor_class` actors that the app's `deployment` replicas started
    (the actors those replicas own)."""

    def where(address: dict[str, Any]) -> tuple[str, int]:
        return address["IPAddress"], address["Port"]

    replicas = {where(a["Address"]) for a in _alive(f"ServeReplica:{app}:{deployment}")}
    return [a["Pid"] for a in _alive(actor_class) if where(a["OwnerAddress"]) in replicas]


@contextlib.contextmanager
def one_replica_app(serve_app: ServeApp, app: str, tp_size: int) -> Iterator[list[tuple[str, str]]]:
    """An app of one worker replica (`tp_size` ranks) beside the module's, deleted after;
    yields the gRPC metadata that reaches it through Serve's proxy."""
    args = {"model": str(serve_app.model), "replicas": 1, "tp_size": tp_size, "device": "cpu"}
    serve.run(build_app({**args, "max_total_tokens": 1024}), name=app, route_prefix=f"/{app}")
    try:
        yield [("application", app)]
    finally:
        serve.delete(app)


def greedy_request(model: Path, prompt: list[int]) -> tuple[pb.GenerateRequest, list[int]]:
    """A 5-token greedy request and the tokens the reference run gives it."""
    expected = reference_tokens(model, [prompt], [5])[0]
    params = pb.SamplingParams(max_new_tokens=5, temperature=0)
    return pb.GenerateRequest(token_ids=prompt, sampling_params=params), expected


def test_a_replica_whose_tp_rank_died_fails_its_health_check_and_is_replaced(
    serve_app: ServeApp,
) -> None:
    app = "tp2-heal"
    request, expected = greedy_request(serve_app.model, [41, 42, 43, 44])
    with one_replica_app(serve_app, app, tp_size=2) as metadata:
        with grpc.insecure_channel(f"127.0.0.1:{serve_app.grpc_port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            items = list(stub.Generate(request, metadata=metadata, timeout=60))
            assert [t for i in items for t in i.token_ids] == expected
            before = items[-1].worker_id
            [pid] = _owned_pids(app, "SwaWorker", "RankWorker")
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + STARTUP_TIMEOUT_S  # a bound; the wait is for a state
            while True:
                load = stub.GetLoad(pb.GetLoadRequest(), metadata=metadata, timeout=30)
                workers = [w.worker_id for w in load.workers]
                if len(workers) == 1 and workers[0] != before:
                    break
                assert time.monotonic() < deadline, f"no new replica; workers: {workers}"
                time.sleep(0.2)
            items = list(stub.Generate(request, metadata=metadata, timeout=60))
        assert [t for i in items for t in i.token_ids] == expected
        assert items[-1].worker_id == workers[0]
        deadline = time.monotonic() + 60  # the replaced replica may still be stopping
        while (states := replica_states(app)) != {"RUNNING": 1}:
            assert time.monotonic() < deadline, states
            time.sleep(0.2)


def replica_states(app: str) -> dict[str, int]:
    return dict(serve.status().applications[app].deployments["SwaWorker"].replica_states)


def test_the_router_restarts_in_place_and_a_replaced_router_replica_starts_a_new_one(
    serve_app: ServeApp,
) -> None:
    """The ingress and the workers call the router actor that the SwaRouter replica owns.
    Its process killed, Ray restarts it in place and the workers' reports rebuild it; its
    replica killed (and the actor with it), Serve starts a new replica with a new actor, and
    the ingress and the workers fetch that one. Both times the app serves the same answer."""
    app = "router-heal"
    request, expected = greedy_request(serve_app.model, [51, 52, 53, 54])
    with one_replica_app(serve_app, app, tp_size=1) as metadata:
        with grpc.insecure_channel(f"127.0.0.1:{serve_app.grpc_port}") as channel:
            stub = pb_grpc.InferenceStub(channel)

            def generate() -> list[int]:
                items = list(stub.Generate(request, metadata=metadata, timeout=60))
                return [t for i in items for t in i.token_ids]

            def router_back(old_pid: int) -> None:
                """Wait until a new router actor runs and holds the worker's report."""
                deadline = time.monotonic() + STARTUP_TIMEOUT_S  # a bound; the wait is a state
                while True:
                    pids = _owned_pids(app, "SwaRouter", "RouterActor")
                    if pids and old_pid not in pids:
                        try:
                            load = stub.GetLoad(pb.GetLoadRequest(), metadata=metadata, timeout=30)
                        except grpc.RpcError as exc:  # the ingress's calls met the old actor
                            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                        else:
                            if len(load.workers) == 1:
                                return
                    assert time.monotonic() < deadline, f"no router came back: {pids}"
                    time.sleep(0.2)

            assert generate() == expected
            [router_pid] = _owned_pids(app, "SwaRouter", "RouterActor")
            os.kill(router_pid, signal.SIGKILL)
            router_back(router_pid)
            assert generate() == expected

            [router_pid] = _owned_pids(app, "SwaRouter", "RouterActor")
            [replica_pid] = _replica_pids(app, "SwaRouter")
            os.kill(replica_pid, signal.SIGKILL)  # its router actor ends with it
            router_back(router_pid)
            assert replica_pid not in _replica_pids(app, "SwaRouter")
            assert generate() == expected
        assert len(_owned_pids(app, "SwaRouter", "RouterActor")) == 1
