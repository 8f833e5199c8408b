"""The harmony renderer and streaming parser against the examples of harmony's format
documentation (docs/format.md of openai/harmony), as text."""

from __future__ import annotations

import re

import pytest

from swaserve.proto.text import harmony
from swaserve.proto.text.harmony import Conversation, Delta, Message, StreamParser, Tool

WEATHER_TOOLS = [
    Tool("get_location", "Gets the location of the user."),
    Tool(
        "get_current_weather",
        "Gets the current weather in the provided location.",
        {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "description": "The city and state, e.g. San Francisco, CA",
                },
                "format": {
                    "type": "string",
                    "enum": ["celsius", "fahrenheit"],
                    "default": "celsius",
                },
            },
            "required": ["location"],
        },
    ),
    Tool(
        "get_multiple_weathers",
        "Gets the current weather in the provided list of locations.",
        {
            "type": "object",
            "properties": {
                "locations": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]',
                },
                "format": {
                    "type": "string",
                    "enum": ["celsius", "fahrenheit"],
                    "default": "celsius",
                },
            },
            "required": ["locations"],
        },
    ),
]

DOCUMENTED_PROMPT = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: 2025-06-28

Reasoning: high

# Valid channels: analysis, commentary, final. Channel must be included for every message.
Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>developer<|message|># Instructions

Use a friendly tone.

# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

} // namespace functions<|end|><|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant"""


def test_the_documented_function_calling_prompt_renders_exactly() -> None:
    convo = Conversation(
        [Message("user", "What is the weather like in SF?")],
        instructions="Use a friendly tone.",
        tools=WEATHER_TOOLS,
        reasoning_effort="high",
        current_date="2025-06-28",
    )
    assert convo.render() == DOCUMENTED_PROMPT


def test_tool_call_history_and_result_render_as_documented() -> None:
    convo = Conversation(
        [
            Message("user", "What is the weather like in SF?"),
            Message("assistant", "Need to use function get_weather.", channel="analysis"),
            Message(
                "assistant",
                '{"location":"San Francisco"}',
                channel="commentary",
                recipient="functions.get_weather",
                content_type="<|constrain|>json",
            ),
            Message(
                "functions.get_weather",
                '{"sunny": true, "temperature": 20}',
                channel="commentary",
                recipient="assistant",
            ),
        ],
        instructions="Use a friendly tone.",
        tools=WEATHER_TOOLS,
        reasoning_effort="high",
        current_date="2025-06-28",
    )
    tail = (
        "<|start|>user<|message|>What is the weather like in SF?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"location":"San Francisco"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary"
        '<|message|>{"sunny": true, "temperature": 20}<|end|><|start|>assistant'
    )
    rendered = convo.render()
    assert rendered.endswith(tail)
    # The reasoning of the turn still calling tools is kept.
    assert "Need to use function get_weather." in rendered


def test_reasoning_of_finished_turns_is_dropped_and_history_ends_with_end() -> None:
    messages = [
        Message("user", "What is 2 + 2?"),
        Message("assistant", 'User asks: "What is 2 + 2?" Simple arithmetic.', channel="analysis"),
        Message("assistant", "2 + 2 = 4.", channel="final"),
        Message("user", "What about 9 / 2?"),
    ]
    rendered = Conversation(messages).render()
    assert "Simple arithmetic" not in rendered
    assert rendered.endswith(
        "<|start|>user<|message|>What is 2 + 2?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|end|>"
        "<|start|>user<|message|>What about 9 / 2?<|end|><|start|>assistant"
    )
    assert "<|start|>developer" not in rendered  # no instructions, no tools: no empty block


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_reasoning_effort_is_spelled_in_the_system_message(effort: str) -> None:
    assert (
        f"\n\nReasoning: {effort}\n\n"
        in Conversation([Message("user", "x")], reasoning_effort=effort).render()
    )
    with pytest.raises(ValueError, match="reasoning_effort"):
        Conversation([Message("user", "x")], reasoning_effort="max").render()


# ---- parsing: a character-level vocabulary with harmony's special tokens ---------------
SPECIAL = {name: 1000 + i for i, name in enumerate(harmony.SPECIAL_TOKENS)}


def encode(text: str) -> list[int]:
    pattern = "(" + "|".join(re.escape(s) for s in SPECIAL) + ")"
    ids: list[int] = []
    for part in re.split(pattern, text):
        ids += [SPECIAL[part]] if part in SPECIAL else [ord(c) for c in part]
    return ids


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i < 1000)


def parse(text: str, step: int = 1) -> tuple[list[Delta], StreamParser]:
    parser = StreamParser(SPECIAL, decode)
    ids = encode(text)
    out: list[Delta] = []
    for i in range(0, len(ids), step):
        out += parser.push(ids[i : i + step])
    out += parser.finish()
    return out, parser


def joined(deltas: list[Delta], kind: str) -> str:
    return "".join(d.text for d in deltas if d.kind == kind)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_documented_answer_parses_into_reasoning_and_content(step: int) -> None:
    out, parser = parse(
        '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide '
        "answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
        step,
    )
    assert (
        joined(out, "reasoning") == 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'
    )
    assert joined(out, "content") == "2 + 2 = 4."
    assert parser.stop_token == harmony.RETURN
    assert [(m.channel, m.author) for m in parser.messages] == [
        ("analysis", "assistant"),
        ("final", "assistant"),
    ]


@pytest.mark.parametrize(
    "header",
    [
        "<|channel|>commentary to=functions.get_weather <|constrain|>json",  # documented
        " to=functions.get_weather<|channel|>commentary <|constrain|>json",  # recipient first
        "<|channel|>commentary to=functions.get_weather<|channel|>commentary json",  # dirty
        "<|channel|>analysis to=functions.get_weather <|constrain|>json",  # on analysis
    ],
)
def test_a_tool_call_parses_wherever_its_recipient_is(header: str) -> None:
    out, parser = parse(
        "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
        f"<|start|>assistant{header}<|message|>"
        '{"location":"San Francisco"}<|call|>'
    )
    calls = [d for d in out if d.kind == "tool_call"]
    assert {d.name for d in calls} == {"get_weather"} and {d.index for d in calls} == {0}
    assert "".join(d.text for d in calls) == '{"location":"San Francisco"}'
    assert parser.stop_token == harmony.CALL and parser.calls == 1
    assert joined(out, "content") == ""


def test_a_preamble_without_recipient_is_content_and_malformed_text_does_not_raise() -> None:
    out, _ = parse(
        "<|channel|>commentary<|message|>Will start with the plan.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    )
    assert joined(out, "content") == "Will start with the plan.Done."
    out, _ = parse("no header at all<|message|>x<|end|>stray text")
    assert isinstance(out, list)
