"""The OpenAI-compatible HTTP API end to end on the session's Ray, called with the stock
`openai` client (and raw HTTP for bodies it would not send): streamed and whole completions
and chat completions against the gRPC Generate of the same token ids, usage and cached tokens,
the errors in OpenAI's shape, auth, 429, /metrics, a client that leaves, and `swaserve serve
--http-port` as a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import requests
from cluster_harness import (
    WINDOW,
    ServedCluster,
    greedy,
    kv_in_use,
    stopped,
    stream,
    wait_idle,
    wait_idle_for_reuse,
    worker_pids,
)
from prometheus_client.parser import text_string_to_metric_families
from test_cluster_faults import StreamThread, long_request
from test_serve_command import ServeProcess, engine_pids_of_other_drivers

from swaserve.cluster.http_server import HttpServer
from swaserve.cluster.metrics import ServingMetrics
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.text.chat_template import ChatTemplate
from swaserve.router import RouterConfig

pytestmark = pytest.mark.slow

BOS_ID = 256
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is a sliding window?"},
]
DESIGN_METRICS = {
    "swaserve:num_requests_running",
    "swaserve:num_requests_waiting",
    "swaserve:token_usage",
    "swaserve:swa_token_usage",
    "swaserve:prefix_cache_queries",  # counters: the parser drops `_total`
    "swaserve:prefix_cache_hits",
    "swaserve:time_to_first_token_seconds",
    "swaserve:inter_token_latency_seconds",
    "swaserve:e2e_request_latency_seconds",
    "swaserve:router_decisions",
    "swaserve:swa_tombstoned_tokens",
}


def start_http(served: ServedCluster, **options: Any) -> HttpServer:
    server = HttpServer(served.cluster, port=0, **options)
    served.loop.run(server.start())
    return server


@pytest.fixture(scope="module")
def http(two_workers: ServedCluster) -> Iterator[HttpServer]:
    info = two_workers.cluster.model_info
    assert info is not None
    server = start_http(two_workers, metrics=ServingMetrics(info.model_name))
    try:
        yield server
    finally:
        two_workers.loop.run(server.stop())


@pytest.fixture(scope="module")
def base_url(http: HttpServer) -> str:
    return f"http://127.0.0.1:{http.port}"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(two_workers: ServedCluster) -> str:
    assert two_workers.cluster.model_info is not None
    return two_workers.cluster.model_info.model_name


def grpc_tokens(served: ServedCluster, ids: list[int], max_new: int) -> tuple[list[int], str]:
    tokens, text, last = stream(
        served.stub(),
        pb.GenerateRequest(token_ids=ids, sampling_params=greedy(max_new, ignore_eos=True)),
    )
    assert last.finish_reason == "length"
    return tokens, text


EXACT = {"ignore_eos": True, "return_token_ids": True}  # extras (vLLM's names)


def test_a_full_router_queue_gets_429_with_retry_after(
    make_cluster: Callable[..., ServedCluster],
) -> None:
    """First in the module: the cluster names its placement groups `swaserve-worker-<i>`, so
    a second cluster of this driver cannot start while the module's `two_workers` lives."""
    served = make_cluster(replicas=1, max_total_tokens=512, router=RouterConfig(max_queue_len=0))
    server = start_http(served)
    assert served.cluster.model_info is not None
    model_name = served.cluster.model_info.model_name
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0
        )
        holder = StreamThread(served, long_request(0, max_new_tokens=450))
        holder.start()
        assert holder.first.wait(120)
        prompt = list(long_request(1).token_ids)
        with stopped(worker_pids(served)):  # the holder holds its room throughout
            for stream_it in (False, True):
                with pytest.raises(openai.RateLimitError) as err:
                    out = client.completions.create(
                        model=model_name, prompt=prompt, max_tokens=450, stream=stream_it
                    )
                    if stream_it:
                        list(out)
                assert err.value.status_code == 429
                assert err.value.response.headers["Retry-After"] == "1"
                assert err.value.code == "rate_limit_exceeded"
            assert served.stub().Abort(pb.AbortRequest(request_id="long-0"), timeout=10).aborted
        holder.join(60)
        wait_idle(served)
        out = client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=450,
            extra_body={"ignore_eos": True},
            temperature=0,
        )
        assert out.usage is not None and out.usage.completion_tokens == 450  # room again
    finally:
        served.loop.run(server.stop())


def test_a_sessions_second_turn_reports_cached_tokens(
    two_workers: ServedCluster, client: openai.OpenAI, model_name: str
) -> None:
    """Early in the module, while the pools are mostly free (`wait_idle_for_reuse`)."""
    tokenizer = two_workers.cluster.tokenizer
    assert tokenizer is not None
    turn1 = tokenizer.encode("Quokka: you are a terse assistant.\nUser: sliding windows?\n")
    first = client.completions.create(
        model=model_name,
        prompt=turn1,
        max_tokens=12,
        user="http-session-1",
        extra_body=EXACT,
        temperature=0,
    )
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens < 3  # at most BOS + a letter
    answer = first.choices[0].token_ids
    wait_idle_for_reuse(two_workers)
    turn2 = turn1 + answer + tokenizer.encode("\nUser: and the radix cache?\n")[1:]
    second = client.completions.create(
        model=model_name,
        prompt=turn2,
        max_tokens=8,
        user="http-session-1",
        extra_body=EXACT,
        temperature=0,
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    # all of turn 1 but its last answer token, which was sampled and never computed
    assert second.usage.prompt_tokens_details.cached_tokens == len(turn1) + len(answer) - 1
    wait_idle(two_workers)


def test_a_chats_second_turn_reuses_the_first_prompt_after_the_window_moved_on(
    two_workers: ServedCluster, client: openai.OpenAI, model_name: str
) -> None:
    """The first answer is longer than W, so its decode left the window of the first prompt;
    the template re-renders it, so the second prompt diverges right after the first one. The
    window checkpoint at the first prompt's end keeps it resumable."""
    first = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=3 * WINDOW,
        user="chat-session-1",
        extra_body={"ignore_eos": True},
        temperature=0,
    )
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    wait_idle_for_reuse(two_workers)
    turn2 = [
        *MESSAGES,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the radix cache?"},
    ]
    second = client.chat.completions.create(
        model=model_name, messages=turn2, max_tokens=4, user="chat-session-1", temperature=0
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    page_size = two_workers.cluster.model_info.limits.page_size  # type: ignore[union-attr]
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - page_size <= cached < second.usage.prompt_tokens
    wait_idle(two_workers)


def test_completion_streamed_and_whole_equal_grpc_generate(
    two_workers: ServedCluster, client: openai.OpenAI, model_name: str
) -> None:
    tokenizer = two_workers.cluster.tokenizer
    assert tokenizer is not None
    prompt = "The window slides: "
    ids = tokenizer.encode(prompt)
    expected_ids, expected_text = grpc_tokens(two_workers, ids, 12)
    whole = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=12, extra_body=EXACT, temperature=0
    )
    choice = whole.choices[0]
    assert choice.text == expected_text
    assert choice.token_ids == expected_ids
    assert choice.prompt_token_ids == ids
    assert choice.finish_reason == "length"
    assert whole.id.startswith("cmpl-") and whole.model == model_name
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 12)
    assert whole.usage.total_tokens == len(ids) + 12

    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXACT,
            temperature=0,
        )
    )
    *deltas, final = chunks
    assert "".join(c.choices[0].text for c in deltas) == expected_text
    assert [t for c in deltas for t in c.choices[0].token_ids] == expected_ids
    assert [c.choices[0].finish_reason for c in deltas][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in deltas[:-1])
    assert all(c.usage is None for c in deltas)
    assert final.choices == []
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(ids), 12)
    assert final.usage.total_tokens == len(ids) + 12
    assert len({c.id for c in chunks}) == 1


def test_chat_streamed_and_whole_equal_grpc_generate_of_the_rendered_template(
    two_workers: ServedCluster, client: openai.OpenAI, cluster_model: Path, model_name: str
) -> None:
    tokenizer = two_workers.cluster.tokenizer
    assert tokenizer is not None
    rendered = ChatTemplate.from_model_dir(cluster_model).render(
        MESSAGES, add_generation_prompt=True
    )
    ids = tokenizer.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1  # the template's BOS, not doubled
    expected_ids, expected_text = grpc_tokens(two_workers, ids, 10)
    whole = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=10, extra_body=EXACT, temperature=0
    )
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text
    assert choice.token_ids == expected_ids
    assert choice.prompt_token_ids == ids
    assert choice.finish_reason == "length"
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)

    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_completion_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXACT,
            temperature=0,
        )
    )
    *deltas, final = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == expected_text
    assert [t for c in deltas for t in c.choices[0].token_ids] == expected_ids
    assert deltas[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert final.choices == [] and final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(ids), 10)


def test_stop_string_truncates_and_finishes_with_stop(
    client: openai.OpenAI, model_name: str
) -> None:
    prompt = "Stop strings: "
    full = client.completions.create(
        model=model_name,
        prompt=prompt,
        max_tokens=24,
        extra_body={"ignore_eos": True},
        temperature=0,
    )
    full_text = full.choices[0].text
    printable = [i for i, c in enumerate(full_text) if i >= 3 and c.isprintable() and c != "\ufffd"]
    assert printable, full_text
    stop = full_text[printable[0] : printable[0] + 2]
    expected = full_text[: full_text.index(stop)]
    cut = client.completions.create(
        model=model_name,
        prompt=prompt,
        max_tokens=24,
        stop=[stop],
        extra_body={"ignore_eos": True},
        temperature=0,
    )
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=24,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
            temperature=0,
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "home"],
    "additionalProperties": False,
}


def test_response_format_json_schema_validates_on_every_seed(
    client: openai.OpenAI, model_name: str
) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True},
    }
    texts = []
    for seed in range(10):
        out = client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            response_format=fmt,  # type: ignore[arg-type]
        )
        assert out.choices[0].finish_reason == "stop"
        text = out.choices[0].message.content or ""
        jsonschema.validate(json.loads(text), PET_SCHEMA)
        texts.append(text)
    assert len(set(texts)) > 5
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=200,
            temperature=1.0,
            seed=0,
            response_format=fmt,  # type: ignore[arg-type]
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == texts[0]
    json_object = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=300,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if json_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(json_object.choices[0].message.content or ""), dict)


def test_vllm_structured_outputs_extras(client: openai.OpenAI, model_name: str) -> None:
    for body in (
        {"structured_outputs": {"choice": ["red", "blue", "green"]}},
        {"guided_choice": ["red", "blue", "green"]},
    ):
        out = client.completions.create(
            model=model_name, prompt="Colour:", max_tokens=8, temperature=1.0, extra_body=body
        )
        assert out.choices[0].text in ("red", "blue", "green")
        assert out.choices[0].finish_reason == "stop"
    out = client.completions.create(
        model=model_name,
        prompt="Code:",
        max_tokens=12,
        temperature=1.0,
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}},
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", out.choices[0].text)


def test_logprobs_in_openai_shapes_whole_and_streamed(
    client: openai.OpenAI, model_name: str
) -> None:
    kwargs: dict[str, Any] = {
        "model": model_name,
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
        assert entry.top_logprobs[0].logprob == entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    # The second request may hit the first's cached prompt (or run on the other worker): its
    # prefill then computes fewer rows, whose sums round differently in the last bits.
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    plain = client.chat.completions.create(**(kwargs | {"logprobs": False, "top_logprobs": None}))
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == whole.choices[0].message.content
    completion = client.completions.create(
        model=model_name,
        prompt="Log:",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 5
    assert len(lp.token_logprobs or []) == 5 and len(lp.top_logprobs or []) == 5
    assert all(len(top) <= 2 for top in lp.top_logprobs or [])
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(5)]


def test_logit_bias_and_penalties_reach_the_engine(client: openai.OpenAI, model_name: str) -> None:
    out = client.completions.create(
        model=model_name,
        prompt=[7, 8, 9],
        max_tokens=4,
        temperature=0,
        logit_bias={"65": 100},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert out.choices[0].text == "AAAA"
    common: dict[str, Any] = {"model": model_name, "prompt": [7, 8, 9], "max_tokens": 6}
    biased = client.completions.create(
        temperature=0, logit_bias={"65": 8}, extra_body={"ignore_eos": True}, **common
    )
    assert biased.choices[0].text == "AAAAAA"
    # Each repeat costs A 2 more (frequency) and any repeat 2 (presence): the bias of 8 no
    # longer wins after a few.
    penalized = client.completions.create(
        temperature=0,
        logit_bias={"65": 8},
        frequency_penalty=2.0,
        presence_penalty=2.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.2, "min_tokens": 6},
        **common,
    )
    assert 1 <= penalized.choices[0].text.count("A") < 6


def test_n_choices_are_independent_requests(client: openai.OpenAI, model_name: str) -> None:
    whole = client.completions.create(
        model=model_name, prompt=[1, 2, 3, 4], max_tokens=5, n=3, extra_body=EXACT, temperature=0
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in whole.choices}) == 1
    assert whole.usage is not None and whole.usage.completion_tokens == 15
    chunks = client.chat.completions.create(
        messages=MESSAGES,
        model=whole.model,
        max_tokens=4,
        n=2,
        stream=True,
        extra_body={"ignore_eos": True},
        temperature=0,
    )
    texts = {0: "", 1: ""}
    reasons = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert texts[0] == texts[1]
    assert reasons == {0: "length", 1: "length"}


def test_models_lists_exactly_the_served_model(client: openai.OpenAI, model_name: str) -> None:
    assert [m.id for m in client.models.list()] == [model_name]
    assert client.models.retrieve(model_name).owned_by == "swaserve"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_another_model_name_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert err.value.code == "model_not_found"
    assert err.value.param == "model"


def test_any_user_string_is_a_session_key(client: openai.OpenAI, model_name: str) -> None:
    """OpenAI's `user` is free text (an e-mail address, say): not a valid id, so it is hashed
    into one instead of being refused; `session_id` (the gRPC rule) is checked."""
    for user in ("someone@example.com", "x" * 500):
        out = client.completions.create(model=model_name, prompt=[1, 2], max_tokens=1, user=user)
        assert out.usage is not None and out.usage.completion_tokens == 1


BAD_REQUESTS: list[tuple[str, str, dict[str, Any] | str, str | None]] = [
    ("missing messages", "chat", {}, "messages"),
    ("empty messages", "chat", {"messages": []}, "messages"),
    ("role tool", "chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    (
        "image content part",
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
    ),
    ("temperature -1", "completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("top_p 0", "completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("max_tokens 0", "completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("n 0", "completions", {"prompt": "x", "n": 0}, "n"),
    ("seed 2**63", "completions", {"prompt": "x", "seed": 2**63}, "seed"),
    ("unknown field", "completions", {"prompt": "x", "best_friend": 1}, "best_friend"),
    ("echo", "completions", {"prompt": "x", "echo": True}, "echo"),
    (
        "tool without a function",
        "chat",
        {"messages": MESSAGES, "tools": [{"type": "function"}]},
        "tools[0].function",
    ),
    (
        "tools on a model without a tool-call parser",
        "chat",
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
    ),
    (
        "top_logprobs 21",
        "chat",
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    ("top_logprobs alone", "chat", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("logprobs 21", "completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    (
        "presence_penalty 2.5",
        "completions",
        {"prompt": "x", "presence_penalty": 2.5},
        "presence_penalty",
    ),
    (
        "frequency_penalty -3",
        "chat",
        {"messages": MESSAGES, "frequency_penalty": -3},
        "frequency_penalty",
    ),
    ("logit_bias word key", "completions", {"prompt": "x", "logit_bias": {"hi": 1}}, "logit_bias"),
    (
        "logit_bias outside",
        "completions",
        {"prompt": "x", "logit_bias": {"100000": 1}},
        "logit_bias",
    ),
    (
        "schema that does not compile",
        "chat",
        {
            "messages": MESSAGES,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}},
            },
        },
        "response_format",
    ),
    (
        "1 MB schema",
        "chat",
        {
            "messages": MESSAGES,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"description": "x" * 1_000_000}},
            },
        },
        "response_format",
    ),
    (
        "json_schema without a schema",
        "chat",
        {
            "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s"}},
        },
        "response_format",
    ),
    (
        "bad regex",
        "completions",
        {"prompt": "x", "structured_outputs": {"regex": "[a-"}},
        "structured_outputs",
    ),
    (
        "two constraints",
        "chat",
        {"messages": MESSAGES, "response_format": {"type": "json_object"}, "guided_regex": "a"},
        "guided_regex",
    ),
    ("ids outside the vocabulary", "completions", {"prompt": [1, 288]}, "prompt"),
    ("empty prompt", "completions", {"prompt": []}, "prompt"),
    ("prompt of a number", "completions", {"prompt": 7}, "prompt"),
    ("batch of two prompts", "completions", {"prompt": ["a", "b"]}, "prompt"),
    ("over-long prompt", "completions", {"prompt": [1] * 4096}, "prompt"),
    (
        "prompt + max_tokens over the pool",
        "completions",
        {"prompt": [1] * 100, "max_tokens": 2000},
        "max_tokens",
    ),
    (
        "17 stop strings",
        "completions",
        {"prompt": "x", "stop": [f"s{i}" for i in range(17)]},
        "stop",
    ),
    ("empty stop string", "completions", {"prompt": "x", "stop": [""]}, "stop"),
    (
        "stop token outside",
        "completions",
        {"prompt": "x", "stop_token_ids": [999]},
        "stop_token_ids",
    ),
    ("session id with a slash", "completions", {"prompt": "x", "session_id": "a/b"}, "session_id"),
    (
        "stream_options without stream",
        "completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    (
        "max_tokens and max_completion_tokens differ",
        "chat",
        {"messages": MESSAGES, "max_tokens": 3, "max_completion_tokens": 4},
        "max_tokens",
    ),
    ("not JSON", "completions", "{", None),
    ("not an object", "completions", "[1, 2]", None),
]


@pytest.mark.parametrize(
    "name,endpoint,body,param", BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS]
)
def test_bad_requests_get_400_in_openai_shape(
    base_url: str,
    client: openai.OpenAI,
    model_name: str,
    name: str,
    endpoint: str,
    body: dict[str, Any] | str,
    param: str | None,
) -> None:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if isinstance(body, str):
        reply = requests.post(
            base_url + path, data=body, headers={"Content-Type": "application/json"}, timeout=30
        )
    else:
        reply = requests.post(base_url + path, json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
    again = client.completions.create(
        model=model_name,
        prompt=[7, 8, 9],
        max_tokens=2,
        extra_body={"ignore_eos": True},
        temperature=0,
    )
    assert again.choices[0].finish_reason == "length"  # the server serves on
    assert again.usage is not None and again.usage.completion_tokens == 2


def test_the_openai_client_sees_unsupported_fields_as_bad_requests(
    client: openai.OpenAI, model_name: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            messages=MESSAGES,
            model=model_name,
            audio={"voice": "alloy", "format": "wav"},
            modalities=["text", "audio"],
        )
    assert err.value.status_code == 400
    assert "audio" in err.value.message and "modalities" in err.value.message
    assert err.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="x", echo=True)
    assert err.value.param == "echo"


def test_health(base_url: str) -> None:
    reply = requests.get(base_url + "/health", timeout=10)
    assert (reply.status_code, reply.json()) == (200, {"status": "serving"})


def test_api_key_is_required_when_configured(two_workers: ServedCluster, model_name: str) -> None:
    server = start_http(two_workers, api_key="s3cret")
    base = f"http://127.0.0.1:{server.port}"
    try:
        wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.completions.create(model=model_name, prompt="x", max_tokens=1)
        assert err.value.code == "invalid_api_key"
        reply = requests.get(base + "/v1/models", timeout=10)  # no header at all
        assert reply.status_code == 401
        assert reply.json()["error"]["code"] == "invalid_api_key"
        assert reply.headers["WWW-Authenticate"] == "Bearer"
        assert requests.get(base + "/metrics", timeout=10).status_code == 401
        assert requests.get(base + "/health", timeout=10).status_code == 200  # probes need none
        right = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in right.models.list()] == [model_name]
        out = right.completions.create(model=model_name, prompt=[1, 2], max_tokens=2, temperature=0)
        assert out.usage is not None and out.usage.prompt_tokens == 2
    finally:
        two_workers.loop.run(server.stop())


def metric_samples(base_url: str) -> dict[str, dict[str, float]]:
    """family name → sample name → the sum over its label sets."""
    reply = requests.get(base_url + "/metrics", timeout=10)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(reply.text):
        samples = out.setdefault(family.name, {})
        for s in family.samples:
            samples[s.name] = samples.get(s.name, 0.0) + s.value
    return out


def test_metrics_list_design_names_and_count_requests(
    two_workers: ServedCluster, base_url: str, client: openai.OpenAI, model_name: str
) -> None:
    client.completions.create(
        model=model_name, prompt=[3, 4, 5], max_tokens=2, temperature=0
    )  # a routing decision
    wait_idle(two_workers)
    before = metric_samples(base_url)
    assert set(before) >= DESIGN_METRICS
    assert "swaserve:router_queue_len" in before
    prompt = [11, 12, 13, 14, 15, 16, 17]
    out = client.completions.create(
        model=model_name,
        prompt=prompt,
        max_tokens=3,
        extra_body={"ignore_eos": True},
        temperature=0,
    )
    assert out.usage is not None and out.usage.completion_tokens == 3
    wait_idle(two_workers)  # the router holds the worker's report of it: its counters too
    after = metric_samples(base_url)
    queries = "swaserve:prefix_cache_queries"
    grown = after[queries][f"{queries}_total"] - before[queries][f"{queries}_total"]
    assert grown == len(prompt)
    ttft = "swaserve:time_to_first_token_seconds"
    assert after[ttft][f"{ttft}_count"] == before[ttft][f"{ttft}_count"] + 1
    e2e = "swaserve:e2e_request_latency_seconds"
    assert after[e2e][f"{e2e}_count"] == before[e2e][f"{e2e}_count"] + 1
    itl = "swaserve:inter_token_latency_seconds"
    assert after[itl][f"{itl}_count"] == before[itl][f"{itl}_count"] + 2  # 3 tokens, 2 gaps
    # where its first token's time went: four parts, each once, adding up to no more than the
    # time to first token (which starts earlier, at the request's arrival)
    parts = 0.0
    for part in ("route", "queue", "prefill", "transport"):
        name = f"swaserve:request_{part}_time_seconds"
        assert after[name][f"{name}_count"] == before.get(name, {}).get(f"{name}_count", 0) + 1
        parts += after[name][f"{name}_sum"] - before.get(name, {}).get(f"{name}_sum", 0.0)
    grew = after[ttft][f"{ttft}_sum"] - before[ttft][f"{ttft}_sum"]
    assert 0.0 < parts <= grew + 1e-6, (parts, grew)


@pytest.mark.parametrize("how", ["stream", "whole"])
def test_a_client_that_leaves_frees_its_kv(
    two_workers: ServedCluster, client: openai.OpenAI, base_url: str, model_name: str, how: str
) -> None:
    before = kv_in_use(wait_idle(two_workers))
    assert before == {"worker-0": (0, 0), "worker-1": (0, 0)}
    body = {"prompt": list(range(30, 90)), "max_tokens": 1800, "ignore_eos": True}
    held: dict[str, tuple[int, int]] = {}
    if how == "stream":
        chunks = client.completions.create(
            model=model_name,
            prompt=body["prompt"],
            max_tokens=1800,
            stream=True,
            extra_body={"ignore_eos": True},
            temperature=0,
        )
        for n, _ in enumerate(chunks):
            if n == 3:
                held = kv_in_use(two_workers.load())
                chunks.close()
                break
        assert max(full for full, _ in held.values()) > 0  # the request did hold KV
    else:
        # its workers stand still: no answer comes before the client's timeout
        with stopped(worker_pids(two_workers)), pytest.raises(requests.Timeout):
            requests.post(base_url + "/v1/completions", json=body | {"temperature": 0}, timeout=1.0)
    assert kv_in_use(wait_idle(two_workers)) == before


def test_an_error_after_the_stream_began_is_a_last_event(
    two_workers: ServedCluster, base_url: str
) -> None:
    """A request aborted on the server (gRPC Abort of its id) mid-stream: an error event, then
    [DONE]; the engine's "abort" is never an OpenAI finish reason."""
    body = {"prompt": [5] * 20, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    pids = worker_pids(two_workers)
    events: list[Any] = []
    with requests.post(base_url + "/v1/completions", json=body, stream=True, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if not line:
                continue
            assert line.startswith(b"data: ")
            data = line[len(b"data: ") :]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            if len(events) == 2:
                with stopped(pids):  # the stream is still open when the abort comes
                    aborted = two_workers.stub().Abort(
                        pb.AbortRequest(request_id=events[0]["id"]), timeout=10
                    )
                assert aborted.aborted
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "service_unavailable" and error["type"] == "server_error"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
    wait_idle(two_workers)


HTTP_LISTEN = re.compile(r"^swaserve: OpenAI-compatible HTTP API on (http://127\.0\.0\.1:\d+)/v1$")


class HttpServeProcess(ServeProcess):
    """`swaserve serve --http-port 0` on the session's Ray; `start()` waits for both ports."""

    def __init__(self, ray_session: str, model: Path, tmp_path: Path, *more: str) -> None:
        env = dict(os.environ, SWASERVE_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
        args = ["--ray-address", ray_session, "--grpc-port", "0", "--http-port", "0"]
        args += ["--device", "cpu", "--max-total-tokens", "4096", "--model", str(model), *more]
        super().__init__(args, env)

    def start(self) -> tuple[str, str]:
        """(served model name, base URL of the HTTP API)."""
        model_name, _ = self.wait_listening()
        deadline = time.monotonic() + 30
        while not (urls := [m[1] for line in self.lines if (m := HTTP_LISTEN.match(line))]):
            assert time.monotonic() < deadline, "\n".join(self.lines[-20:])
            time.sleep(0.1)
        return model_name, urls[0]

    def wait_for_line(self, text: str, timeout_s: float = 60.0) -> None:
        """Until a line of the output contains `text`."""
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline, "\n".join(self.lines[-20:])
            time.sleep(0.05)


class LongStream(threading.Thread):
    """A streamed completion in a thread: its chunks, and the error it ended with (if any)."""

    def __init__(self, client: openai.OpenAI, model_name: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client, self.model_name, self.max_tokens = client, model_name, max_tokens
        self.chunks: list[Any] = []
        self.error: openai.APIError | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            for chunk in self.client.completions.create(
                model=self.model_name,
                prompt=[5] * 10,
                max_tokens=self.max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                self.chunks.append(chunk)
                self.started.set()
        except openai.APIError as exc:
            self.error = exc
        finally:
            self.started.set()


def test_serve_command_with_http_port_and_sigterm_drain(
    ray_session: str, cluster_model: Path, tmp_path: Path
) -> None:
    process = HttpServeProcess(ray_session, cluster_model, tmp_path)
    try:
        model_name, base = process.start()
        assert any(
            line.startswith(f"try:  curl {base}/v1/chat/completions") for line in process.lines
        )
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].finish_reason == "length" and out.model == model_name

        streaming = LongStream(client, model_name, 300)
        streaming.start()
        assert streaming.started.wait(60)
        with stopped(engine_pids_of_other_drivers()):  # the stream stays open through the drain
            process.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while requests.get(base + "/health", timeout=5).status_code != 503:
                assert time.monotonic() < deadline, "health never turned 503"
                time.sleep(0.02)
            assert requests.get(base + "/health", timeout=5).json() == {"status": "draining"}
            with pytest.raises(openai.InternalServerError) as err:
                client.completions.create(model=model_name, prompt=[1, 2], max_tokens=2)
            assert err.value.status_code == 503
        streaming.join(120)
        assert streaming.error is None
        assert streaming.chunks[-1].choices[0].finish_reason == "length"  # it drained
        assert process.proc.wait(60) == 0
        process._reader.join(10)
        assert process.lines[-1] == "swaserve: stopped"
        assert any(re.search(r"request cmpl-\w+: 10 prompt tokens", line) for line in process.lines)
    finally:
        process.stop()


def test_serve_command_ends_a_stream_that_outlives_the_drain_with_an_error_event(
    ray_session: str, cluster_model: Path, tmp_path: Path
) -> None:
    process = HttpServeProcess(ray_session, cluster_model, tmp_path, "--drain-timeout-s", "0.5")
    try:
        model_name, base = process.start()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        streaming = LongStream(client, model_name, 3000)
        streaming.start()
        assert streaming.started.wait(60)
        with stopped(engine_pids_of_other_drivers()):  # the stream cannot end within the drain
            process.proc.send_signal(signal.SIGTERM)
            process.wait_for_line("drain timed out")
        streaming.join(60)
        assert not streaming.is_alive()
        assert streaming.error is not None  # the stream's last event was an error
        assert "aborted" in streaming.error.message
        assert all(c.choices[0].finish_reason is None for c in streaming.chunks)
        assert process.proc.wait(60) == 0
        process._reader.join(10)
        assert process.lines[-1] == "swaserve: stopped"
        assert not [line for line in process.lines if "Traceback" in line or "ASGI" in line]
    finally:
        process.stop()
