"""Chat completions and the Responses API on a model that speaks MiMo-V2-Flash's format (the
tiny MiMo made with `native_chat`: its ChatML, `<think>` and `<tool_call>` tokens and template),
over the real HTTP server and a cluster whose worker streams a scripted output, with the stock
client: the thinking switch, reasoning and XML tool calls parsed whole and streamed, tool
results rendered back, forced calls as grammars over MiMo's syntax, and the 400s."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from routed_fakes import ScriptedCluster, serve_over_http

from swaserve.proto.text.tokenizer import TextTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ANSWER = "The user greets.</think>Hello there!<|im_end|>"
CALL = (
    "Need the weather.</think><tool_call>\n<function=get_weather>\n"
    "<parameter=city>Paris</parameter>\n<parameter=days>2</parameter>\n</function>\n"
    "</tool_call><|im_end|>"
)
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def served(tiny_model_factory: Callable[..., Path]) -> Iterator[tuple[ScriptedCluster, str]]:
    model = tiny_model_factory("mimo-v2-flash", num_layers=2, native_chat=True)
    cluster = ScriptedCluster(model, TextTokenizer(model), ANSWER)
    with serve_over_http(cluster) as url:
        yield cluster, url


@pytest.fixture
def cluster(served: tuple[ScriptedCluster, str]) -> ScriptedCluster:
    served[0].script = ANSWER
    return served[0]


@pytest.fixture
def client(served: tuple[ScriptedCluster, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1], api_key="unused", max_retries=0, timeout=30)


def name(cluster: ScriptedCluster) -> str:
    assert cluster.model_info is not None
    return cluster.model_info.model_name


def extra(obj: Any, key: str) -> Any:
    return (obj.model_extra or {}).get(key)


def test_thinking_is_off_by_default_and_on_by_the_template_switch(
    cluster: ScriptedCluster, client: openai.OpenAI
) -> None:
    cluster.script = "Hi!<|im_end|>"
    out = client.chat.completions.create(
        model=name(cluster), messages=[{"role": "user", "content": "Hi"}]
    )
    assert cluster.prompt().endswith("<|im_start|>assistant\n<think></think>")
    assert out.choices[0].message.content == "Hi!"
    assert extra(out.choices[0].message, "reasoning_content") is None
    cluster.script = ANSWER
    for kwargs in (THINKING, {"reasoning_effort": "high"}):
        out = client.chat.completions.create(
            model=name(cluster),
            messages=[{"role": "user", "content": "Hi"}],
            extra_body=kwargs.get("chat_template_kwargs") and kwargs,
            reasoning_effort=kwargs.get("reasoning_effort"),  # type: ignore[arg-type]
        )
        assert cluster.prompt().endswith("<|im_start|>assistant\n<think>")
        message = out.choices[0].message
        assert message.content == "Hello there!"
        assert extra(message, "reasoning_content") == "The user greets."
        assert out.usage is not None and out.usage.completion_tokens_details is not None
        assert out.usage.completion_tokens_details.reasoning_tokens == len("The user greets.")
    chunks = list(
        client.chat.completions.create(
            model=name(cluster),
            messages=[{"role": "user", "content": "Hi"}],
            extra_body=THINKING,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(extra(d, "reasoning_content") or "" for d in deltas) == "The user greets."
    content = "".join(d.content or "" for d in deltas)
    assert content == "Hello there!" and "<" not in content


def test_a_tool_call_comes_back_typed_whole_and_streamed_and_its_result_goes_back(
    cluster: ScriptedCluster, client: openai.OpenAI
) -> None:
    cluster.script = CALL
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    out = client.chat.completions.create(
        model=name(cluster),
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        extra_body=THINKING,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert "<name>get_weather</name>" in cluster.prompt()
    chunks = list(
        client.chat.completions.create(
            model=name(cluster),
            messages=messages,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            extra_body=THINKING,
            stream=True,
        )
    )
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert len([p for p in pieces if p.function.arguments]) == 3  # per parameter, then "}"
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert json.loads(arguments) == {"city": "Paris", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    cluster.script = ANSWER
    follow = [
        *messages,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    answer = client.chat.completions.create(
        model=name(cluster),
        messages=follow,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        extra_body=THINKING,
    )
    assert answer.choices[0].message.content == "Hello there!"
    assert cluster.prompt().endswith(
        "<|im_start|>assistant\n<think>Need the weather.</think><tool_call>\n"
        "<function=get_weather>\n<parameter=city>Paris</parameter>\n"
        "<parameter=days>2</parameter>\n</function>\n</tool_call><|im_end|>"
        '<|im_start|>tool\n<tool_response>\n{"temp": 21}\n</tool_response>\n<|im_end|>'
        "<|im_start|>assistant\n<think>"
    )


def test_tool_choice_required_named_and_none(
    cluster: ScriptedCluster, client: openai.OpenAI
) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        client.chat.completions.create(
            model=name(cluster),
            messages=[{"role": "user", "content": "x"}],
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
        )
        spec = cluster.requests[-1].params.structured_outputs
        assert spec is not None and spec.grammar is not None
        assert '"\\n<function=get_weather>\\n"' in spec.grammar
        assert spec.grammar.startswith('start: "\\n"? call <|im_end|>')  # one call, no thinking
    client.chat.completions.create(
        model=name(cluster),
        messages=[{"role": "user", "content": "x"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
    )
    assert "<tools>" not in cluster.prompt()
    assert cluster.requests[-1].params.structured_outputs is None
    im_end = cluster.tokenizer.tokenizer.token_to_id("<|im_end|>")  # type: ignore[union-attr]
    assert im_end in cluster.requests[-1].params.stop_token_ids


def test_a_response_format_constrains_the_answer_after_the_reasoning(
    cluster: ScriptedCluster, client: openai.OpenAI
) -> None:
    client.chat.completions.create(
        model=name(cluster),
        messages=[{"role": "user", "content": "x"}],
        response_format={"type": "json_object"},
        extra_body=THINKING,
    )
    spec = cluster.requests[-1].params.structured_outputs
    assert spec is not None and spec.grammar is not None
    assert spec.grammar.startswith("start: think answer <|im_end|>")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
            "tool_choice",
        ),
        (
            {"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
            "messages[0].tool_call_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "[1]"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"chat_template_kwargs": {"enable_thinking": "yes"}},
            "chat_template_kwargs.enable_thinking",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        (
            {
                "tools": [{**WEATHER, "function": {"name": "f", "parameters": {"type": "array"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {
                "tools": [
                    {
                        **WEATHER,
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "array", "uniqueItems": True}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    cluster: ScriptedCluster, client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    kwargs: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}]} | body
    extra_body = {k: kwargs.pop(k) for k in ("chat_template_kwargs",) if k in kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=name(cluster), extra_body=extra_body, **kwargs)
    assert err.value.param == param, err.value.message


def test_the_responses_api_runs_a_tool_loop_as_one_session(
    served: tuple[ScriptedCluster, str], cluster: ScriptedCluster, client: openai.OpenAI
) -> None:
    cluster.script = CALL
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": WEATHER["function"]["parameters"],
    }  # type: ignore[index]
    first = client.responses.create(
        model=name(cluster),
        input="Weather?",
        tools=[tool],
        reasoning={"effort": "low"},  # type: ignore[list-item]
    )
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.type == "function_call" and json.loads(call.arguments) == {
        "city": "Paris",
        "days": 2,
    }
    cluster.script = ANSWER
    second = client.responses.create(
        model=name(cluster),
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21"}],
        tools=[tool],  # type: ignore[list-item]
        reasoning={"effort": "low"},
    )
    assert second.output_text == "Hello there!"
    assert "<tool_response>\n21\n</tool_response>" in cluster.prompt()
    assert "<think>Need the weather.</think><tool_call>" in cluster.prompt()
    sessions = cluster.fake_router.sessions[-2:]
    assert sessions[0] is not None and sessions[0] == sessions[1]
    other = client.responses.create(model=name(cluster), input="Hi")
    assert cluster.fake_router.sessions[-1] not in (None, sessions[0])
    assert other.status == "completed"
