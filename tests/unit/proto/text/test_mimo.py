"""MiMo-V2-Flash's chat format: the tiny model's template renders as transformers renders it,
the streaming parser turns `<think>` and XML tool calls into reasoning, content and JSON
arguments however the tokens are split, and the grammars accept exactly the calls and answers
their schemas allow."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from swaserve.cluster.openai_api.chat import compact
from swaserve.proto.text import mimo
from swaserve.proto.text.chat_template import ChatTemplate
from swaserve.proto.text.formats import MIMO, ChatFormat, chat_format
from swaserve.proto.text.parsed import Delta
from swaserve.proto.text.tokenizer import TextTokenizer, encode_text, load_tokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8, "description": "a city"},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time."}},
]
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
    "<parameter=unit>c</parameter>\n<parameter=days>\n3\n</parameter>\n"
    '<parameter=where>{"lat": 48.8}</parameter>\n</function>\n</tool_call>'
)


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="mimo-v2-flash", num_layers=2, native_chat=True)


@pytest.fixture(scope="module")
def tok(model: Path) -> TextTokenizer:
    t = load_tokenizer(str(model))
    assert t is not None
    return t


@pytest.fixture(scope="module")
def fmt(tok: TextTokenizer) -> ChatFormat:
    f = chat_format(tok)
    assert f is not None and f.name == MIMO
    return f


def parse(
    fmt: ChatFormat, tok: TextTokenizer, text: str, prompt: str = "", splits: list[int] = ()
) -> tuple[list[Delta], Any]:
    parser = fmt.parser(
        tok, encode_text(tok.tokenizer, prompt), {"get_weather": WEATHER, "get_time": {}}
    )
    ids = encode_text(tok.tokenizer, text)
    out: list[Delta] = []
    start = 0
    for cut in [*sorted(splits), len(ids)]:
        out += parser.push(ids[start:cut])
        start = max(start, cut)
    return out + parser.finish(), parser


def joined(deltas: list[Delta]) -> dict[str, Any]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.kind == "tool_call":
            calls.setdefault(d.index, [d.name or "", ""])[1] += d.text
    return {
        "reasoning": "".join(d.text for d in deltas if d.kind == "reasoning"),
        "content": "".join(d.text for d in deltas if d.kind == "content"),
        "calls": [(name, json.loads(args)) for name, args in calls.values()],
    }


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "They want weather.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
            }
        ],
    },
    {"role": "tool", "content": '{"t": 21}', "tool_call_id": "c1"},
    {"role": "assistant", "content": "21 degrees.", "reasoning_content": "Read it."},
    {"role": "user", "content": "Thanks"},
]


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_the_template_renders_as_transformers_renders_it(
    model: Path, thinking: bool, tools: Any
) -> None:
    ours = ChatTemplate.from_model_dir(model).render(
        MESSAGES, add_generation_prompt=True, tools=tools, enable_thinking=thinking
    )
    theirs = AutoTokenizer.from_pretrained(model).apply_chat_template(
        MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n" + ("<think>" if thinking else "<think></think>"))
    # reasoning is kept for the turns after the last user message only: here none
    assert "They want weather." not in ours and "Read it." not in ours
    assert "<parameter=city>Paris</parameter>\n<parameter=days>2</parameter>\n" in ours
    assert "<|im_start|>tool\n<tool_response>\n" in ours
    if tools:
        assert "<name>get_weather</name>" in ours and "<required>" in ours


def test_a_tool_loops_reasoning_is_kept_within_the_turn(model: Path) -> None:
    text = ChatTemplate.from_model_dir(model).render(MESSAGES[:4], add_generation_prompt=True)
    assert "<think>They want weather.</think><tool_call>" in text


def test_reasoning_content_and_a_typed_call(fmt: ChatFormat, tok: TextTokenizer) -> None:
    deltas, parser = parse(
        fmt, tok, "Plan.</think>Checking.\n" + CALL + "<|im_end|>", prompt="x<think>"
    )
    out = joined(deltas)
    assert out["reasoning"] == "Plan." and out["content"] == "Checking."  # not the newline
    assert out["calls"] == [
        ("get_weather", {"city": "Paris", "unit": "c", "days": 3, "where": {"lat": 48.8}})
    ]
    assert parser.calls == 1 and parser.reasoning_tokens == len("Plan.")
    assert parser.chunk([], True, "stop")[1] == "tool_calls"
    assert parser.stop_token == mimo.IM_END


def test_without_thinking_everything_is_content(fmt: ChatFormat, tok: TextTokenizer) -> None:
    out = joined(parse(fmt, tok, "Just text <b>.", prompt="x<think></think>")[0])
    assert out == {"reasoning": "", "content": "Just text <b>.", "calls": []}


def test_parallel_calls_a_json_call_and_whitespace_between(
    fmt: ChatFormat, tok: TextTokenizer
) -> None:
    text = CALL + "\n" + '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
    out = joined(parse(fmt, tok, text)[0])
    assert [c[0] for c in out["calls"]] == ["get_weather", "get_time"]
    assert out["calls"][1][1] == {} and out["content"] == ""


def test_an_unreadable_call_is_content_and_a_cut_call_closes(
    fmt: ChatFormat, tok: TextTokenizer
) -> None:
    out = joined(parse(fmt, tok, "<tool_call>oops</tool_call>")[0])
    assert out["calls"] == [] and out["content"] == "<tool_call>oops</tool_call>"
    cut = joined(parse(fmt, tok, CALL[: CALL.index("<parameter=days>")])[0])
    assert cut["calls"] == [("get_weather", {"city": "Paris", "unit": "c"})]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 200), max_size=8))
def test_any_split_of_the_tokens_parses_the_same(
    fmt: ChatFormat, tok: TextTokenizer, splits: list[int]
) -> None:
    text = "Plan é.</think>Ok ✓.\n" + CALL + "<|im_end|>"
    whole = joined(parse(fmt, tok, text, prompt="<think>")[0])
    assert joined(parse(fmt, tok, text, prompt="<think>", splits=splits)[0]) == whole


def matcher(tok: TextTokenizer, grammar: str) -> llguidance.LLMatcher:
    lt = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=288, eos_token=257)
    m = llguidance.LLMatcher(lt, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(tok: TextTokenizer, grammar: str, text: str) -> bool:
    m = matcher(tok, grammar)
    for t in encode_text(tok.tokenizer, text):
        if not m.consume_token(t) or m.is_error():
            return False
    return m.is_accepting()


@pytest.mark.parametrize("thinking", [False, True])
def test_the_forced_call_grammar_takes_exactly_valid_calls(
    tok: TextTokenizer, thinking: bool
) -> None:
    tools = [("get_weather", WEATHER), ("get_time", {})]
    one = mimo.forced_call_grammar(tools, thinking, False, compact)
    many = mimo.forced_call_grammar(tools, thinking, True, compact)
    pre = "Hm.</think>" if thinking else ""
    end = "<|im_end|>"
    call = CALL.replace("\n3\n", "3").replace('{"lat": 48.8}', '{"lat":48.8}')  # compact JSON
    good = call + end
    assert accepts(tok, one, pre + good)
    time = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    assert accepts(tok, many, pre + call + "\n" + time + end)
    assert not accepts(tok, one, pre + call + "\n" + time + end)
    for bad in (
        good.replace(">3<", ">9<"),  # above the maximum
        good.replace("Paris", "Parisienne"),  # over maxLength
        good.replace(">c<", ">k<"),  # not in the enum
        good.replace("<parameter=city>Paris</parameter>\n", ""),  # a required one missing
        good.replace("get_weather", "get_wheather"),  # no such tool
        "Some text first. " + good,
    ):
        assert not accepts(tok, one, pre + bad), bad
    if not thinking:
        assert not accepts(tok, one, "Hm.</think>" + good)


def test_the_answer_grammar_constrains_what_follows_the_reasoning(tok: TextTokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer = f"%json {json.dumps(compact(schema))}"
    thinking = mimo.final_answer_grammar(answer, True)
    assert accepts(tok, thinking, 'free {text}</think>{"a":1}<|im_end|>')
    assert not accepts(tok, thinking, 'free</think>{"a":"x"}<|im_end|>')
    plain = mimo.final_answer_grammar(answer, False)
    assert accepts(tok, plain, '{"a":1}<|im_end|>')
    jsonschema.validate({"a": 1}, schema)


def test_formats_are_told_apart(
    tiny_model_factory: Callable[..., Path], tok: TextTokenizer
) -> None:
    plain = load_tokenizer(str(tiny_model_factory(arch="mimo-v2-flash", num_layers=2)))
    harmony = load_tokenizer(str(tiny_model_factory(arch="gpt-oss", num_layers=2, harmony=True)))
    assert chat_format(plain) is None
    assert chat_format(harmony) is not None and chat_format(harmony).name == "harmony"  # type: ignore[union-attr]
    fmt = chat_format(tok)
    assert fmt is not None
    assert fmt.stop_ids == (fmt.special_ids[mimo.IM_END], fmt.special_ids[mimo.END_OF_TEXT])
