"""Chat completions on a model that speaks harmony (the tiny GPT-OSS's tokenizer has its special
tokens), over the real HTTP server and a `FakeCluster` whose worker streams a scripted output:
the prompt is rendered in harmony (reasoning effort, tools, tool results), and the output is
parsed into reasoning, content and tool calls, whole and streamed, with the stock client."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from routed_fakes import FakeCluster, LoopThread, ScriptedCluster, serve_over_http

from swaserve.cluster.http_server import HttpServer
from swaserve.proto.text import harmony
from swaserve.proto.text.tokenizer import TextTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
THINK_THEN_ANSWER = (
    "<|channel|>analysis<|message|>The user greets.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
)


CALL_AND_RESULT = (
    "<|start|>user<|message|>Weather in Paris?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
    '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 21}'
    "<|end|><|start|>assistant"
)
"""The history of CALL answered with {"temp": 21}, as harmony renders it."""


@pytest.fixture(scope="module")
def served(tiny_model_factory: Callable[..., Path]) -> Iterator[tuple[ScriptedCluster, str]]:
    model = tiny_model_factory("gpt-oss", num_layers=1, harmony=True)
    cluster = ScriptedCluster(model, TextTokenizer(model), THINK_THEN_ANSWER)
    with serve_over_http(cluster) as url:
        yield cluster, url


@pytest.fixture
def client(served: tuple[ScriptedCluster, str]) -> openai.OpenAI:
    served[0].script = THINK_THEN_ANSWER
    return openai.OpenAI(base_url=served[1], api_key="unused", max_retries=0, timeout=30)


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def test_reasoning_and_answer_are_parsed_apart_whole_and_streamed(
    served: tuple[ScriptedCluster, str], client: openai.OpenAI
) -> None:
    cluster = served[0]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=cluster.model_info.model_name, messages=messages)
    message = out.choices[0].message
    assert message.content == "Hello there!"
    assert extra(message, "reasoning_content") == extra(message, "reasoning") == "The user greets."
    assert out.choices[0].finish_reason == "stop"
    details = out.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.reasoning_tokens == len("The user greets.")
    prompt = cluster.prompt()
    assert prompt.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Reasoning: medium" in prompt
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>" in prompt
    assert prompt.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    ids = cluster.tokenizer.tokenizer  # type: ignore[union-attr]
    stops = {ids.token_to_id(harmony.RETURN), ids.token_to_id(harmony.CALL)}
    assert stops <= set(cluster.requests[-1].params.stop_token_ids)
    chunks = list(
        client.chat.completions.create(
            model=cluster.model_info.model_name, messages=messages, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Hello there!"
    assert "".join(extra(d, "reasoning_content") or "" for d in deltas) == "The user greets."
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("effort", ["low", "high"])
def test_reasoning_effort_changes_the_system_message(
    served: tuple[ScriptedCluster, str], client: openai.OpenAI, effort: str
) -> None:
    client.chat.completions.create(
        model=served[0].model_info.model_name,
        messages=[{"role": "user", "content": "Hi"}],
        reasoning_effort=effort,  # type: ignore[arg-type]
    )
    assert f"\n\nReasoning: {effort}\n\n" in served[0].prompt()


def test_a_tool_call_comes_back_as_tool_calls_whole_and_streamed(
    served: tuple[ScriptedCluster, str], client: openai.OpenAI
) -> None:
    cluster = served[0]
    cluster.script = CALL
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    name = cluster.model_info.model_name
    out = client.chat.completions.create(model=name, messages=messages, tools=[WEATHER])  # type: ignore[list-item]
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert "type get_weather = (_: {\ncity: string,\n}) => any;" in cluster.prompt()
    chunks = list(
        client.chat.completions.create(model=name, messages=messages, tools=[WEATHER], stream=True)  # type: ignore[list-item]
    )
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The result goes back; the history renders the call and its result as harmony.
    cluster.script = THINK_THEN_ANSWER
    follow = [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the weather.",
            "tool_calls": [
                {"id": call.id, "type": "function", "function": call.function.model_dump()}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    answer = client.chat.completions.create(model=name, messages=follow, tools=[WEATHER])  # type: ignore[arg-type,list-item]
    assert answer.choices[0].message.content == "Hello there!"
    assert cluster.prompt().endswith(CALL_AND_RESULT)


def test_tool_choice_required_and_named_constrain_the_output(
    served: tuple[ScriptedCluster, str], client: openai.OpenAI
) -> None:
    cluster = served[0]
    name = cluster.model_info.model_name
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "x"}],
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
        )
        spec = cluster.requests[-1].params.structured_outputs
        assert spec is not None and spec.grammar is not None
        assert "commentary to=functions.get_weather " in spec.grammar
        assert '"whitespace_flexible": false' in spec.grammar  # compact JSON arguments
    client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "x"}],
        tools=[WEATHER],
        tool_choice="none",  # type: ignore[list-item]
    )
    assert "namespace functions" not in cluster.prompt()
    assert cluster.requests[-1].params.structured_outputs is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [
                    {
                        **WEATHER,
                        "function": {
                            **WEATHER["function"],
                            "parameters": {"type": "array", "uniqueItems": True},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
            "messages[0].tool_call_id",
        ),
        ({"reasoning_effort": "max"}, "reasoning_effort"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(
    served: tuple[ScriptedCluster, str], client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    kwargs: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}]} | body
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=served[0].model_info.model_name, **kwargs)
    assert err.value.param == param, err.value.message


def test_content_never_carries_a_channel_marker(
    served: tuple[ScriptedCluster, str], client: openai.OpenAI
) -> None:
    served[
        0
    ].script = (
        "<|channel|>final<|message|>a<|channel|>b<|end|>c<|start|>assistant<|message|>d<|return|>"
    )
    out = client.chat.completions.create(
        model=served[0].model_info.model_name, messages=[{"role": "user", "content": "x"}]
    )
    content = out.choices[0].message.content or ""
    assert "<|" not in content and "a" in content


# ---- the Responses API ---------------------------------------------------------------------
RESPONSES_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": WEATHER["function"]["parameters"],  # type: ignore[index]
}


def test_a_response_has_reasoning_and_message_items(
    served: tuple[ScriptedCluster, str], client: openai.OpenAI
) -> None:
    cluster = served[0]
    out = client.responses.create(
        model=cluster.model_info.model_name,
        input="Hi",
        instructions="Be brief.",
        reasoning={"effort": "high"},
    )
    assert out.status == "completed" and out.output_text == "Hello there!"
    kinds = [item.type for item in out.output]
    assert kinds == ["reasoning", "message"]
    assert out.output[0].content[0].text == "The user greets."  # type: ignore[union-attr,index]
    assert out.usage is not None and out.usage.input_tokens == len(cluster.requests[-1].token_ids)
    assert out.usage.output_tokens_details.reasoning_tokens == len("The user greets.")
    prompt = cluster.prompt()
    assert "Reasoning: high" in prompt and "# Instructions\n\nBe brief." in prompt
    assert client.responses.retrieve(out.id).output_text == "Hello there!"


def test_a_function_call_and_its_output_continue_with_previous_response_id(
    served: tuple[ScriptedCluster, str], client: openai.OpenAI
) -> None:
    cluster = served[0]
    name = cluster.model_info.model_name
    cluster.script = CALL
    first = client.responses.create(
        model=name,
        input="Weather in Paris?",
        tools=[RESPONSES_WEATHER, {"type": "web_search"}],  # type: ignore[list-item]
    )
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert "web_search" not in cluster.prompt()  # a hosted tool is not offered
    cluster.script = THINK_THEN_ANSWER
    second = client.responses.create(
        model=name,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}],
        tools=[RESPONSES_WEATHER],  # type: ignore[list-item]
    )
    assert second.output_text == "Hello there!"
    assert cluster.prompt().endswith(CALL_AND_RESULT)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=name, input="x", previous_response_id=first.id)


def test_a_streamed_response_sends_the_events_in_order(
    served: tuple[ScriptedCluster, str], client: openai.OpenAI
) -> None:
    cluster = served[0]
    cluster.script = CALL
    events = list(
        client.responses.create(
            model=cluster.model_info.model_name,
            input="Weather?",
            tools=[RESPONSES_WEATHER],  # type: ignore[list-item]
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.reasoning_text.delta" in kinds
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    added = kinds.index("response.output_item.added")
    assert kinds.index("response.reasoning_text.delta") > added
    final = events[-1].response  # type: ignore[union-attr]
    assert [item.type for item in final.output] == ["reasoning", "function_call"]


def test_namespaces_encrypted_reasoning_and_bad_items(
    served: tuple[ScriptedCluster, str], client: openai.OpenAI
) -> None:
    cluster = served[0]
    name = cluster.model_info.model_name
    cluster.script = (
        "<|channel|>analysis<|message|>Read it.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.repo.read <|constrain|>json<|message|>{"path":"a.py"}<|call|>'
    )
    namespace = {
        "type": "namespace",
        "name": "repo",
        "description": "The repository.",
        "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}],
    }
    out = client.responses.create(
        model=name,
        input="Read a.py",
        tools=[namespace],  # type: ignore[list-item]
        store=False,
        include=["reasoning.encrypted_content"],
    )
    reasoning, call = out.output
    assert call.type == "function_call" and call.name == "read"
    assert call.namespace == "repo"  # type: ignore[union-attr]
    blob = reasoning.encrypted_content  # type: ignore[union-attr]
    assert blob and "Read it." not in blob
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)  # store: false
    cluster.script = THINK_THEN_ANSWER
    client.responses.create(
        model=name,
        input=[
            {"role": "user", "content": "Read a.py"},
            {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": blob},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": "read",
                "namespace": "repo",
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "print(1)"},
        ],
        tools=[namespace],  # type: ignore[list-item]
        store=False,
    )
    assert "<|channel|>analysis<|message|>Read it.<|end|>" in cluster.prompt()
    assert "to=functions.repo.read" in cluster.prompt()
    for body, param in (
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input"),
        (
            {
                "input": "x",
                "tools": [{"type": "web_search"}],
                "tool_choice": {"type": "web_search"},
            },
            "tool_choice",
        ),
        ({"input": "x", "background": True}, "background"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=name, **body)  # type: ignore[arg-type]
        assert err.value.param == param, err.value.message


def test_a_model_without_harmony_answers_responses_with_text(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model = tiny_model_factory("mimo-v2-flash", num_layers=1)
    cluster = FakeCluster(model, TextTokenizer(model), ["w0"])
    loop = LoopThread()
    server = HttpServer(cluster, port=0)
    loop.run(server.start())
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0
        )
        out = client.responses.create(
            model=cluster.model_info.model_name, input="hi", max_output_tokens=3
        )
        assert [item.type for item in out.output] == ["message"]
        assert out.status == "incomplete" and out.incomplete_details is not None
        assert out.incomplete_details.reason == "max_output_tokens"
        assert out.usage is not None and out.usage.output_tokens == 3
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(
                model=cluster.model_info.model_name,
                input="hi",
                tools=[RESPONSES_WEATHER],  # type: ignore[list-item]
            )
        assert err.value.param == "tools"
    finally:
        loop.run(server.stop())
        loop.close()
