"""Chat completions on a harmony model end to end (a tiny GPT-OSS whose tokenizer has harmony's
special tokens, two workers on the session's Ray, the stock `openai` client): a forced tool call
from a random model validates against its schema, a response format constrains only the final
answer, and a conversation's second turn is reused from the prefix cache, also when harmony
drops the first turn's reasoning."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from cluster_harness import (
    WINDOW,
    ServedCluster,
    model_name_of,
    openai_client,
    running_cluster,
    wait_idle,
)

from swaserve.cluster.openai_api.chat import compact
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.text.harmony import Conversation, Message, Tool

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is a sliding window?"},
]
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
NO_ANALYSIS = {"97": -100}
"""A random model would rarely end a reasoning message. After `<|channel|>` the channel is
"analysis" or another ('a' or not): biasing 'a' away makes it act at once. Where a grammar
forces an 'a' (a name, a JSON key) it is the only token allowed and is drawn anyway."""


@pytest.fixture(scope="module")
def harmony_cluster(
    ray_session: str, tiny_model_factory: Callable[..., Path]
) -> Iterator[ServedCluster]:
    model = tiny_model_factory(
        arch="gpt-oss", num_layers=4, sliding_window_size=WINDOW, harmony=True
    )
    yield from running_cluster(model, replicas=2)


@pytest.fixture(scope="module")
def client(harmony_cluster: ServedCluster) -> Iterator[openai.OpenAI]:
    yield from openai_client(harmony_cluster)


@pytest.fixture(scope="module")
def model_name(harmony_cluster: ServedCluster) -> str:
    return model_name_of(harmony_cluster)


def test_a_forced_tool_call_validates_on_every_seed_whole_and_streamed(
    harmony_cluster: ServedCluster, client: openai.OpenAI, model_name: str
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed, choice in enumerate(["required"] * 4 + [named] * 4):
        out = client.chat.completions.create(
            model=model_name,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            max_tokens=120,
            logit_bias=NO_ANALYSIS,
        )
        picked = out.choices[0]
        assert picked.finish_reason == "tool_calls", picked
        (call,) = picked.message.tool_calls or []
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
        assert "<|" not in (picked.message.content or "")
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=named,  # type: ignore[arg-type]
            temperature=1.0,
            seed=0,
            max_tokens=120,
            logit_bias=NO_ANALYSIS,
            stream=True,
        )
    )
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert pieces[0].function.name == "get_weather" and pieces[0].id
    arguments = "".join(p.function.arguments or "" for p in pieces)
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The tool's result goes back: the follow-up's prompt extends the call's sequence.
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
    answer = client.chat.completions.create(
        model=model_name,
        messages=follow,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        user="weather-agent",
    )
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens > 0
    wait_idle(harmony_cluster)


def test_a_response_format_constrains_the_final_answer(
    client: openai.OpenAI, model_name: str
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA}}
    for seed in range(4):
        out = client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=fmt,  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            max_tokens=120,
            logit_bias=NO_ANALYSIS,
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content or ""), WEATHER_SCHEMA)


def harmony_answer(reasoning: int, answer: int) -> dict[str, Any]:
    """A whole-output grammar (harmony's tokens spelled out) that makes the random tiny model
    reason `reasoning` characters (none: 0) and answer `answer`, as GPT-OSS would."""
    final = f'<|channel|> "final" <|message|> /[b-z ]{{{answer}}}/'
    if not reasoning:
        return {"structured_outputs": {"grammar": f"start: {final}"}}
    think = f'<|channel|> "analysis" <|message|> /[b-z ]{{{reasoning}}}/ <|end|>'
    return {"structured_outputs": {"grammar": f'start: {think} <|start|> "assistant" {final}'}}


@pytest.mark.parametrize("reasoning", [0, 20], ids=["answer only", "reasoning then answer"])
def test_a_harmony_chats_second_turn_reuses_the_first(
    harmony_cluster: ServedCluster, client: openai.OpenAI, model_name: str, reasoning: int
) -> None:
    """The first answer is longer than W, so its decode left the window of the first prompt.
    Without reasoning, the second prompt extends the first turn's whole sequence: all of it is
    reused. With reasoning, harmony drops the finished turn's analysis, so the second prompt
    diverges right after the first prompt: the window checkpoint at its end keeps it
    resumable, and the second turn reuses the first prompt."""
    session = f"harmony-chat-{reasoning}"
    # A system message of its own: nothing that another test cached is shared past it.
    messages = [{"role": "system", "content": f"You are terse ({session})."}, MESSAGES[1]]
    first = client.chat.completions.create(
        model=model_name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=3 * WINDOW + reasoning + 32,  # the headers: 7 tokens, 25 more with reasoning
        user=session,
        extra_body=harmony_answer(reasoning, 3 * WINDOW),
        temperature=0,
    )
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.choices[0].finish_reason == "stop"
    content = first.choices[0].message.content or ""
    assert len(content) == 3 * WINDOW
    thought = (first.choices[0].message.model_extra or {}).get("reasoning_content") or ""
    assert len(thought) == reasoning
    wait_idle(harmony_cluster)
    turn2 = [
        *messages,
        {"role": "assistant", "content": content},
        {"role": "user", "content": "And the radix cache?"},
    ]
    second = client.chat.completions.create(
        model=model_name,
        messages=turn2,  # type: ignore[arg-type]
        max_tokens=4,
        user=session,
        temperature=0,
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    info = harmony_cluster.cluster.model_info
    assert info is not None
    page_size = info.limits.page_size
    cached = second.usage.prompt_tokens_details.cached_tokens
    if reasoning:
        assert first.usage.prompt_tokens - page_size <= cached <= first.usage.prompt_tokens + 1
    else:  # all of turn 1 but its last token, which was sampled and never computed
        whole = first.usage.prompt_tokens + first.usage.completion_tokens - 1
        assert whole - page_size <= cached <= whole
    assert cached < second.usage.prompt_tokens
    wait_idle(harmony_cluster)


def test_grpc_parses_harmony_output_into_parts(harmony_cluster: ServedCluster) -> None:
    """`parse_output`: a gRPC client gets reasoning, content and tool-call parts without
    parsing harmony itself (here a call forced by a whole-output grammar)."""
    prompt = Conversation(
        [Message("user", "Weather in Paris?")],
        tools=[Tool("get_weather", "Weather of a city.", WEATHER_SCHEMA)],
    ).render()
    grammar = (
        'start: <|channel|> "analysis" <|message|> /[b-z ]{12}/ <|end|> <|start|> "assistant" '
        '<|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
        f"args <|call|>\nargs: %json {json.dumps(compact(WEATHER_SCHEMA))}"
    )
    params = pb.SamplingParams(
        max_new_tokens=160,
        temperature=1.0,
        seed=3,
        structured_outputs=pb.StructuredOutputs(grammar=grammar),
    )
    items = list(
        harmony_cluster.stub().Generate(
            pb.GenerateRequest(text=prompt, sampling_params=params, parse_output=True), timeout=60
        )
    )
    parts = [p for item in items for p in item.parsed]
    assert items[-1].finish_reason == "tool_calls"
    assert len("".join(p.text for p in parts if p.kind == "reasoning")) == 12
    calls = [p for p in parts if p.kind == "tool_call"]
    assert {(p.tool_name, p.tool_index) for p in calls} == {("get_weather", 0)}
    jsonschema.validate(json.loads("".join(p.text for p in calls)), WEATHER_SCHEMA)
    assert not [p for p in parts if p.kind == "content"]


SEED = 1
"""A seed whose draws call the tool at once (seeded sampling draws the same on any worker)."""


def test_the_responses_api_with_tools_a_format_and_a_previous_response(
    harmony_cluster: ServedCluster, client: openai.OpenAI, model_name: str
) -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": WEATHER_SCHEMA,
        "strict": True,
    }
    first = client.responses.create(
        model=model_name,
        input="Weather in Paris?",
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        reasoning={"effort": "low"},
        temperature=1.0,
        max_output_tokens=120,
        extra_body={"seed": SEED},
        user="responses-agent",
    )
    assert first.status == "completed", first.output
    (call,) = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    follow = client.responses.create(
        model=model_name,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21C"}],
        tools=[tool],  # type: ignore[list-item]
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA}},
        max_output_tokens=300,
        user="responses-agent",
    )
    assert follow.usage is not None and follow.usage.input_tokens_details.cached_tokens > 0
    with client.responses.stream(
        model=model_name, input="Say something.", max_output_tokens=8
    ) as stream:
        kinds = [event.type for event in stream]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    wait_idle(harmony_cluster)
