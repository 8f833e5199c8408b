"""Chat completions and the Responses API on a MiMo-V2-Flash-format model end to end (a tiny
MiMo with its own ChatML, `<think>` and `<tool_call>` tokens and template, two workers on the
session's Ray, the stock `openai` client): a forced call from a random model is schema-valid
XML that comes back as JSON arguments, a response format constrains the answer, a gRPC client
gets parsed parts, and a conversation's next turn reuses the cache up to where MiMo's template
drops the finished turn's `<think>` block."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from cluster_harness import (
    MAX_TOTAL_TOKENS,
    WINDOW,
    ServedCluster,
    model_name_of,
    openai_client,
    running_cluster,
    wait_idle,
    wait_idle_for_reuse,
)

from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.text.chat_template import ChatTemplate
from swaserve.proto.text.tokenizer import encode_text, load_tokenizer

pytestmark = pytest.mark.slow

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time."}},
]


@pytest.fixture(scope="module")
def mimo_model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(
        arch="mimo-v2-flash", num_layers=4, sliding_window_size=WINDOW, native_chat=True
    )


@pytest.fixture(scope="module")
def mimo_cluster(ray_session: str, mimo_model: Path) -> Iterator[ServedCluster]:
    # Room for the first test's nine tool-call turns (1,249 prompt tokens each, their outputs
    # cached) on one worker without pressure, under which its follow-up may move.
    yield from running_cluster(mimo_model, replicas=2, max_total_tokens=4 * MAX_TOTAL_TOKENS)


@pytest.fixture(scope="module")
def client(mimo_cluster: ServedCluster) -> Iterator[openai.OpenAI]:
    yield from openai_client(mimo_cluster)


@pytest.fixture(scope="module")
def model_name(mimo_cluster: ServedCluster) -> str:
    return model_name_of(mimo_cluster)


def test_a_forced_tool_call_validates_on_every_seed_whole_and_streamed(
    mimo_cluster: ServedCluster, client: openai.OpenAI, model_name: str
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed, choice in enumerate(["required"] * 4 + [named] * 4):
        out = client.chat.completions.create(
            model=model_name,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=160,
        )
        picked = out.choices[0]
        assert picked.finish_reason == "tool_calls", picked
        (call,) = picked.message.tool_calls or []
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
        else:
            assert json.loads(call.function.arguments) == {}
        assert "<tool_call>" not in (picked.message.content or "")
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=named,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            temperature=1.0,
            seed=0,
            max_tokens=160,
            stream=True,
        )
    )
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert pieces[0].function.name == "get_weather" and pieces[0].id
    arguments = "".join(p.function.arguments or "" for p in pieces)
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    follow = [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": pieces[0].id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": pieces[0].id, "content": '{"temp": 21}'},
    ]
    # The router holds every worker's report of the call's turn (its cache events) before the
    # follow-up is routed, and no pool is under pressure, where a short history may move.
    wait_idle_for_reuse(mimo_cluster)
    answer = client.chat.completions.create(
        model=model_name,
        messages=follow,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
    )
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens > 0
    wait_idle(mimo_cluster)


def test_a_response_format_constrains_the_answer(client: openai.OpenAI, model_name: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA}}
    for seed in range(3):
        out = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "Weather?"}],
            response_format=fmt,  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content or ""), WEATHER_SCHEMA)


def test_grpc_parses_mimo_output_into_parts(mimo_cluster: ServedCluster) -> None:
    """`parse_output`: reasoning, content and a call's JSON arguments, from the prompt's own
    thinking switch (the prompt ends inside `<think>`)."""
    grammar = (
        'start: /[b-z ]{12}/ </think> /[b-z]{5}/ <tool_call> "\\n<function=get_weather>\\n'
        '<parameter=city>" /[a-z]{4}/ "</parameter>\\n<parameter=days>" /[1-7]/ '
        '"</parameter>\\n</function>\\n" </tool_call> <|im_end|>'
    )
    params = pb.SamplingParams(
        max_new_tokens=120,
        temperature=1.0,
        seed=3,
        structured_outputs=pb.StructuredOutputs(grammar=grammar),
    )
    prompt = "<|im_start|>user\nWeather?<|im_end|><|im_start|>assistant\n<think>"
    items = list(
        mimo_cluster.stub().Generate(
            pb.GenerateRequest(text=prompt, sampling_params=params, parse_output=True), timeout=60
        )
    )
    parts = [p for item in items for p in item.parsed]
    assert items[-1].finish_reason == "tool_calls"
    assert len("".join(p.text for p in parts if p.kind == "reasoning")) == 12
    assert len("".join(p.text for p in parts if p.kind == "content")) == 5
    calls = [p for p in parts if p.kind == "tool_call"]
    assert {(p.tool_name, p.tool_index) for p in calls} == {("get_weather", 0)}
    args = json.loads("".join(p.text for p in calls))
    assert len(args["city"]) == 4 and 1 <= args["days"] <= 7


@pytest.mark.parametrize("thinking", [False, True], ids=["no thinking", "thinking"])
def test_a_chats_second_turn_reuses_the_first_up_to_the_dropped_think_block(
    mimo_cluster: ServedCluster,
    client: openai.OpenAI,
    model_name: str,
    mimo_model: Path,
    thinking: bool,
) -> None:
    """The first answer is longer than W, so its decode left the window of the first prompt.
    MiMo's template renders a finished turn without its `<think>` block (or the empty one of
    thinking off), so the second prompt diverges inside the first prompt's last tokens: the
    window checkpoint keeps its SWA KV a few tokens past a window before the prompt's end
    (`CHECKPOINT_SLACK_TOKENS`), so the second turn reuses everything before the divergence,
    with no window repair."""
    session = f"mimo-chat-{thinking}"
    messages = [
        {"role": "system", "content": f"You are terse ({session})."},
        {"role": "user", "content": "What is a sliding window?"},
    ]
    answer = 3 * WINDOW
    think = "/[b-z ]{20}/ </think> " if thinking else ""
    first = client.chat.completions.create(
        model=model_name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=answer + 40,
        user=session,
        temperature=0,
        extra_body={
            "chat_template_kwargs": {"enable_thinking": thinking},
            "structured_outputs": {"grammar": f"start: {think}/[b-z ]{{{answer}}}/ <|im_end|>"},
        },
    )
    assert first.choices[0].finish_reason == "stop"
    content = first.choices[0].message.content or ""
    assert len(content) == answer
    reasoning = (first.choices[0].message.model_extra or {}).get("reasoning_content") or ""
    assert len(reasoning) == (20 if thinking else 0)
    wait_idle(mimo_cluster)
    turn2 = [
        *messages,
        {"role": "assistant", "content": content, "reasoning_content": reasoning or None},
        {"role": "user", "content": "And the radix cache?"},
    ]
    second = client.chat.completions.create(
        model=model_name,
        messages=turn2,  # type: ignore[arg-type]
        max_tokens=4,
        user=session,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
    )
    template = ChatTemplate.from_model_dir(mimo_model)
    tokenizer = load_tokenizer(str(mimo_model))
    assert tokenizer is not None
    ids = [
        encode_text(
            tokenizer.tokenizer,
            template.render(m, add_generation_prompt=True, enable_thinking=thinking),
        )
        for m in (messages, turn2)
    ]
    common = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    assert len(ids[0]) - 2 <= common < len(ids[0])  # inside the first prompt's last tokens
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens == len(ids[1])
    info = mimo_cluster.cluster.model_info
    assert info is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert common - info.limits.page_size <= cached <= common
    wait_idle(mimo_cluster)


def test_the_responses_api_calls_and_continues(client: openai.OpenAI, model_name: str) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}
    first = client.responses.create(
        model=model_name,
        input="Weather in Paris?",
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        max_output_tokens=160,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    second = client.responses.create(
        model=model_name,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21"}],
        tools=[tool],  # type: ignore[list-item]
        max_output_tokens=4,
        temperature=0,
    )
    assert second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens > 0
