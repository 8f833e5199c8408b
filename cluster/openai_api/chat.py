"""Chat completions for models whose format swaserve parses. Harmony (GPT-OSS): OpenAI
messages and tools → a harmony `Conversation`, `tool_choice` → a grammar over harmony's own
tool-call syntax, and the generated tokens → `reasoning_content`, `content` and `tool_calls`.
MiMo-V2-Flash: the messages as its template takes them (`mimo_messages`), the thinking switch,
and grammars over its XML call syntax (`proto.text.mimo`); the same parsed output. Harmony:

    messages  system / developer → the developer message's # Instructions
              user → user; assistant → its reasoning (analysis), its content (final, or a
              commentary preamble before its calls) and each tool call (commentary to=
              functions.NAME <|constrain|>json ... <|call|>); tool → functions.NAME to=assistant
              (NAME: the call that `tool_call_id` names: an unknown id is a 400)
    tools     function tools → `namespace functions` in the developer message ("none": not
              offered); `reasoning_effort` → `Reasoning: ...` in the system message
    output    `harmony.StreamParser`: analysis → reasoning_content (and `reasoning`, as vLLM
              names it), final and preambles → content, calls → tool_calls (finish reason
              "tool_calls"); a channel marker never reaches `content`
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from swaserve.cluster.openai_api.protocol import APIError, ChatCompletionRequest, message_text
from swaserve.proto.grammar import JSON_OPTIONS
from swaserve.proto.text import harmony, mimo
from swaserve.proto.text.harmony import Conversation, Delta, Message, Tool


@dataclass(slots=True)
class ToolChoice:
    """What the request allows: "none", "auto", "required", or one named function."""

    mode: str
    name: str | None = None


def tool_choice(req: ChatCompletionRequest) -> ToolChoice:
    """The request's `tool_choice` (default: "auto" with tools, "none" without), checked
    against its tools (a name that is not one of them is a 400)."""
    names = {t.function.name for t in req.tools or ()}
    choice = req.tool_choice
    if choice is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(
                400, f"tool_choice {choice!r} is not none, auto or required", param="tool_choice"
            )
        if choice == "required" and not names:
            raise APIError(400, "tool_choice required needs tools", param="tool_choice")
        return ToolChoice(choice)
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
    if not isinstance(name, str):
        raise APIError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise APIError(
            400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )
    return ToolChoice("function", name)


def conversation(req: ChatCompletionRequest, choice: ToolChoice) -> Conversation:
    """The harmony conversation of a chat request (a 400 for a tool message whose call is
    not in the history)."""
    instructions: list[str] = []
    messages: list[Message] = []
    calls: dict[str, str] = {}  # tool_call_id -> function name
    for i, m in enumerate(req.messages):
        if m.role in ("system", "developer"):
            instructions.append(message_text(m.content, i))
        elif m.role == "user":
            messages.append(Message("user", message_text(m.content, i)))
        elif m.role == "assistant":
            messages += _assistant(m, i, calls)
        else:  # tool
            name = calls.get(m.tool_call_id or "")
            if name is None:
                raise APIError(
                    400,
                    f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no earlier tool call",
                    param=f"messages[{i}].tool_call_id",
                )
            messages.append(
                Message(
                    f"{harmony.FUNCTIONS}.{name}",
                    message_text(m.content, i),
                    channel="commentary",
                    recipient="assistant",
                )
            )
    tools = [] if choice.mode == "none" else [_tool(t) for t in req.tools or ()]
    return Conversation(
        messages,
        instructions="\n\n".join(instructions) or None,
        tools=tools,
        reasoning_effort=req.reasoning_effort or "medium",
    )


def _assistant(m: Any, i: int, calls: dict[str, str]) -> list[Message]:
    out = []
    reasoning = m.reasoning_content or m.reasoning
    if reasoning:
        out.append(Message("assistant", reasoning, channel="analysis"))
    text = message_text(m.content, i) if m.content is not None else ""
    if m.tool_calls:
        if text:
            out.append(Message("assistant", text, channel="commentary"))  # a preamble
        for call in m.tool_calls:
            calls[call.id] = call.function.name
            out.append(
                Message(
                    "assistant",
                    call.function.arguments,
                    channel="commentary",
                    recipient=f"{harmony.FUNCTIONS}.{call.function.name}",
                    content_type=f"{harmony.CONSTRAIN}json",
                )
            )
    elif text:
        out.append(Message("assistant", text, channel="final"))
    return out


def _tool(t: Any) -> Tool:
    return Tool(t.function.name, t.function.description or "", t.function.parameters)


def forced_call_grammar(req: ChatCompletionRequest, choice: ToolChoice) -> str | None:
    """A Lark grammar (llguidance's, with harmony's special tokens) that makes the model call
    a tool (`required`) or the named one, with arguments valid for its schema; reasoning
    before the call is allowed. None when the choice forces nothing."""
    if choice.mode not in ("required", "function"):
        return None
    tools = [
        t for t in req.tools or () if choice.mode == "required" or t.function.name == choice.name
    ]
    rules = []
    alternatives = []
    for k, t in enumerate(tools):
        schema = t.function.parameters or NO_PARAMETERS
        alternatives.append(f"call_{k}")
        rules.append(
            f'call_{k}: <|channel|> "commentary to=functions.{t.function.name} " <|constrain|> '
            f'"json" <|message|> args_{k} <|call|>'
        )
        rules.append(f"args_{k}: %json {json.dumps(compact(schema))}")
    head = [
        'start: (analysis <|start|> "assistant")? call',
        ANALYSIS_RULE,
        f"call: {' | '.join(alternatives)}",
    ]
    return "\n".join(head + rules)


@dataclass(slots=True)
class ParsedChoice:
    """One choice's parsed output so far."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, deltas: Sequence[Delta]) -> None:
        for d in deltas:
            if d.kind == "reasoning":
                self.reasoning.append(d.text)
            elif d.kind == "content":
                self.content.append(d.text)
            else:
                if d.index >= len(self.calls):
                    self.calls.append(new_call(d.name or ""))
                self.calls[d.index]["function"]["arguments"] += d.text

    def message(self) -> dict[str, Any]:
        reasoning = "".join(self.reasoning) or None
        out: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) or (None if self.calls else ""),
            "reasoning_content": reasoning,
            "reasoning": reasoning,
        }
        if self.calls:
            out["tool_calls"] = self.calls
        return out


def new_call(name: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }


def delta_fields(deltas: Sequence[Delta], calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed chunk's `delta` for these parsed pieces (`calls`: the calls started so far,
    to which a new one is added with its id and name)."""
    out: dict[str, Any] = {}
    tool_deltas: list[dict[str, Any]] = []
    for d in deltas:
        if d.kind == "reasoning":
            out["reasoning_content"] = out.get("reasoning_content", "") + d.text
            out["reasoning"] = out["reasoning_content"]
        elif d.kind == "content":
            out["content"] = out.get("content", "") + d.text
        else:
            if d.index >= len(calls):
                call = new_call(d.name or "")
                calls.append(call)
                tool_deltas.append({"index": d.index, **call})
            tool_deltas.append({"index": d.index, "function": {"arguments": d.text}})
    if tool_deltas:
        out["tool_calls"] = tool_deltas
    return out


def compact(schema: Any) -> Any:
    """`schema` with llguidance's option for compact JSON (`x-guidance`): inside a Lark
    grammar, `%json` would otherwise let a model run to max_tokens on whitespace."""
    if not isinstance(schema, dict):
        return schema
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **JSON_OPTIONS}}


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments of a function declared without parameters: `{}`."""

ANALYSIS_RULE = 'analysis: <|channel|> "analysis" <|message|> /(?s:.*)/ <|end|>'


def final_answer_grammar(source: str, spec: dict[str, Any]) -> str:
    """A Lark grammar that constrains only the final answer of a harmony output (reasoning
    before it stays free): `spec` is the request's structured output (`StructuredOutputs`
    fields: a JSON schema, any JSON object, a regex or a choice). A whole Lark grammar
    (`grammar`) is taken as it is: it constrains the whole output, harmony's channels and
    special tokens (`<|channel|>`, ...) included."""
    if spec.get("grammar") is not None:
        return str(spec["grammar"])
    return "\n".join(
        [
            'start: (analysis <|start|> "assistant")? final',
            ANALYSIS_RULE,
            'final: <|channel|> "final" <|message|> answer',
            f"answer: {answer_expression(source, spec)}",
        ]
    )


def answer_expression(source: str, spec: dict[str, Any]) -> str:
    """The Lark expression of a structured output's answer (a JSON schema, any JSON object,
    a regex or a choice)."""
    if spec.get("json_schema") is not None or spec.get("json_object"):
        schema = spec.get("json_schema")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise APIError(
                    400, f"{source}: the schema is not JSON: {exc}", param=source
                ) from None
        return f"%json {json.dumps(compact(schema if schema is not None else {'type': 'object'}))}"
    if spec.get("regex") is not None:
        return f"/{_lark_regex(spec['regex'])}/"
    if spec.get("choice"):
        return "(" + " | ".join(json.dumps(c) for c in spec["choice"]) + ")"
    raise APIError(400, f"{source}: nothing to constrain the answer with", param=source)


# ---- MiMo-V2-Flash ------------------------------------------------------------------------
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "documents")


def mimo_thinking(req: ChatCompletionRequest) -> bool:
    """Whether MiMo thinks first: `chat_template_kwargs.enable_thinking` (as vLLM and SGLang
    take it), else on when `reasoning_effort` is given; off by default, as its template."""
    kwargs = req.chat_template_kwargs or {}
    for name in RESERVED_TEMPLATE_KWARGS:
        if name in kwargs:
            raise APIError(
                400,
                f"chat_template_kwargs.{name} is set by the request itself",
                param=f"chat_template_kwargs.{name}",
            )
    if "enable_thinking" in kwargs:
        value = kwargs["enable_thinking"]
        if not isinstance(value, bool):
            raise APIError(
                400,
                "chat_template_kwargs.enable_thinking must be true or false",
                param="chat_template_kwargs.enable_thinking",
            )
        return value
    return req.reasoning_effort is not None


def tool_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's tools as the template takes them (OpenAI's shape, unset fields out)."""
    return [t.model_dump(exclude_none=True) for t in req.tools or ()]


def mimo_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as MiMo's template takes them: developer → system, a call's
    `arguments` as an object (not a JSON object: 400), a tool message after its call (an
    unknown `tool_call_id` is a 400)."""
    out: list[dict[str, Any]] = []
    calls: set[str] = set()
    for i, m in enumerate(req.messages):
        text = message_text(m.content, i) if m.content is not None else ""
        if m.role == "tool":
            if (m.tool_call_id or "") not in calls:
                raise APIError(
                    400,
                    f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no earlier tool call",
                    param=f"messages[{i}].tool_call_id",
                )
            out.append({"role": "tool", "content": text, "tool_call_id": m.tool_call_id})
        elif m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            reasoning = m.reasoning_content or m.reasoning
            if reasoning:
                msg["reasoning_content"] = reasoning
            if m.tool_calls:
                msg["tool_calls"] = []
                for j, call in enumerate(m.tool_calls):
                    calls.add(call.id)
                    msg["tool_calls"].append(
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {
                                "name": call.function.name,
                                "arguments": _arguments(call.function.arguments, i, j),
                            },
                        }
                    )
            out.append(msg)
        else:
            out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def _arguments(text: str, i: int, j: int) -> dict[str, Any]:
    try:
        args = json.loads(text) if text else {}
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise APIError(
            400,
            f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object",
            param=f"messages[{i}].tool_calls[{j}].function.arguments",
        )
    return args


def mimo_forced_call_grammar(
    req: ChatCompletionRequest, choice: ToolChoice, thinking: bool
) -> str | None:
    """MiMo's `forced_call_grammar`: a call (`required`) or the named one in its XML syntax,
    each value valid for its parameter's schema; several calls unless `parallel_tool_calls`
    is false."""
    if choice.mode not in ("required", "function"):
        return None
    tools = []
    for i, t in enumerate(req.tools or ()):
        if choice.mode == "required" or t.function.name == choice.name:
            schema = t.function.parameters or NO_PARAMETERS
            if schema.get("type", "object") != "object":
                raise APIError(
                    400,
                    f"tools[{i}].function.parameters must be an object schema",
                    param="tools",
                )
            tools.append((t.function.name, schema))
    parallel = req.parallel_tool_calls is not False
    return mimo.forced_call_grammar(tools, thinking, parallel, compact)


def mimo_final_answer_grammar(source: str, spec: dict[str, Any], thinking: bool) -> str:
    """MiMo's `final_answer_grammar`: the answer after `</think>` constrained; a whole Lark
    grammar is taken as it is (it spells `<think>` / `</think>` itself when thinking)."""
    if spec.get("grammar") is not None:
        return str(spec["grammar"])
    return mimo.final_answer_grammar(answer_expression(source, spec), thinking)


def _lark_regex(regex: str) -> str:
    return regex.replace("/", "\\/")
