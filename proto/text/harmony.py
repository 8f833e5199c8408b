"""GPT-OSS's harmony format: rendering a conversation into a prompt, and parsing generated
tokens back into reasoning, answer and tool calls as they stream. Written from the format's
documentation (openai/harmony `docs/format.md`); no tokenizer is built in, so it works with any
vocabulary that has harmony's special tokens (the published o200k_harmony one, or a tiny test
model's).

A message is `<|start|>{header}<|message|>{content}{end}`:

    header   assistant                                  the role (a tool: its name, functions.x)
             [ to={recipient}]                          a tool call's target (or to=assistant)
             [<|channel|>{analysis|commentary|final}]
             [ {content type}]                          ` <|constrain|>json` for JSON arguments
    end      <|end|>; <|call|> after an assistant's tool call; <|return|> ends a final answer
             (decode-time only: in history it is <|end|>)

The prompt is the system message (identity, knowledge cutoff, date, `Reasoning: low|medium|high`,
the valid channels), the developer message (`# Instructions`, then `# Tools` with the function
tools as a TypeScript-like `namespace functions`; none when both are empty), the history, and
`<|start|>assistant`. Earlier turns' reasoning is dropped once their turn ended on a final
answer; the current turn's (it is still calling tools) is kept, so a tool loop neither re-reasons
nor carries stale thoughts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from swaserve.proto.text.parsed import Delta, OutputParser

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
SPECIAL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
STOP_TOKENS = (RETURN, CALL)
"""Generation ends at either: a final answer, or a tool call for the caller to run."""

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
REASONING_EFFORTS = ("low", "medium", "high")
CHANNELS = ("analysis", "commentary", "final")
FUNCTIONS = "functions"


@dataclass(frozen=True, slots=True)
class Tool:
    """A function tool: its name, description and JSON-schema parameters (None: none)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None


@dataclass(slots=True)
class Message:
    """One harmony message. `author`: the role, or a tool's name (`functions.get_weather`)."""

    author: str
    content: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    @property
    def is_tool_call(self) -> bool:
        return self.author == "assistant" and self.recipient is not None


def render_message(m: Message) -> str:
    header = m.author
    if m.recipient is not None and m.recipient != "all":
        header += f" to={m.recipient}"
    if m.channel is not None:
        header += f"{CHANNEL}{m.channel}"
    if m.content_type is not None:
        header += f" {m.content_type}"
    end = CALL if m.is_tool_call else END
    return f"{START}{header}{MESSAGE}{m.content}{end}"


def system_message(
    reasoning_effort: str = "medium",
    *,
    current_date: str | None = None,
    knowledge_cutoff: str = KNOWLEDGE_CUTOFF,
    has_functions: bool = False,
) -> Message:
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}")
    top = [IDENTITY, f"Knowledge cutoff: {knowledge_cutoff}"]
    if current_date:
        top.append(f"Current date: {current_date}")
    channels = (
        f"# Valid channels: {', '.join(CHANNELS)}. Channel must be included for every message."
    )
    if has_functions:
        channels += f"\nCalls to these tools must go to the commentary channel: '{FUNCTIONS}'."
    sections = ["\n".join(top), f"Reasoning: {reasoning_effort}", channels]
    return Message("system", "\n\n".join(sections))


def developer_message(
    instructions: str | None, tools: Sequence[Tool], response_format: tuple[str, dict] | None = None
) -> Message | None:
    """The developer message, or None when it would be empty (never an empty block)."""
    sections = []
    if instructions:
        sections += ["# Instructions", instructions]
    if tools:
        sections.append(tools_section(tools))
    if response_format is not None:
        name, schema = response_format
        sections.append(f"# Response Formats\n\n## {name}\n\n{json.dumps(schema)}")
    if not sections:
        return None
    return Message("developer", "\n\n".join(sections))


def tools_section(tools: Sequence[Tool]) -> str:
    lines = ["# Tools", "", f"## {FUNCTIONS}", "", f"namespace {FUNCTIONS} {{", ""]
    for tool in tools:
        lines += [f"// {line}" for line in tool.description.splitlines()]
        if tool.parameters and tool.parameters.get("properties"):
            lines.append(f"type {tool.name} = (_: {typescript(tool.parameters)}) => any;")
        else:
            lines.append(f"type {tool.name} = () => any;")
        lines.append("")
    lines.append(f"}} // namespace {FUNCTIONS}")
    return "\n".join(lines)


def typescript(schema: Any, indent: str = "") -> str:
    """A JSON schema as the TypeScript-like type the format documents."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"]) or "never"
    if "const" in schema:
        return json.dumps(schema["const"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(typescript(v, indent) for v in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(typescript({**schema, "type": k}, indent) for k in kind)
    if kind == "object" or "properties" in schema:
        required = set(schema.get("required", ()))
        lines = ["{"]
        for name, prop in schema.get("properties", {}).items():
            if isinstance(prop, dict) and prop.get("description"):
                lines += [f"{indent}// {line}" for line in prop["description"].splitlines()]
            optional = "" if name in required else "?"
            line = f"{indent}{name}{optional}: {typescript(prop, indent)},"
            if isinstance(prop, dict) and "default" in prop:
                line += f" // default: {_default(prop['default'])}"
            lines.append(line)
        lines.append(f"{indent}}}")
        return "\n".join(lines)
    if kind == "array":
        item = typescript(schema.get("items", {}), indent)
        return f"({item})[]" if " | " in item else f"{item}[]"
    return {
        "string": "string",
        "integer": "number",
        "number": "number",
        "boolean": "boolean",
        "null": "null",
    }.get(kind or "", "any")


def _default(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# ---- a conversation -----------------------------------------------------------------------
@dataclass(slots=True)
class Conversation:
    """What a prompt is rendered from: the system settings, the developer message's parts, and
    the history as harmony messages (`Message`s, in order)."""

    messages: list[Message] = field(default_factory=list)
    instructions: str | None = None
    tools: list[Tool] = field(default_factory=list)
    reasoning_effort: str = "medium"
    current_date: str | None = None
    response_format: tuple[str, dict] | None = None

    def render(self) -> str:
        """The prompt text (special tokens as their strings) for the assistant's next turn."""
        parts = [
            system_message(
                self.reasoning_effort,
                current_date=self.current_date,
                has_functions=bool(self.tools),
            )
        ]
        developer = developer_message(self.instructions, self.tools, self.response_format)
        if developer is not None:
            parts.append(developer)
        parts += drop_finished_reasoning(self.messages)
        return "".join(render_message(m) for m in parts) + f"{START}assistant"


def drop_finished_reasoning(messages: Sequence[Message]) -> list[Message]:
    """Harmony's rule: the analysis of turns that ended on a final answer is dropped; the
    analysis after the last final answer (a turn still calling tools) is kept."""
    last_final = max(
        (i for i, m in enumerate(messages) if m.author == "assistant" and m.channel == "final"),
        default=-1,
    )
    return [
        m
        for i, m in enumerate(messages)
        if not (i < last_final and m.author == "assistant" and m.channel == "analysis")
    ]


# ---- parsing ------------------------------------------------------------------------------
class StreamParser(OutputParser):
    """Generated tokens → `Delta`s, one token at a time. Special tokens are recognized by id
    (text decoding drops them); header text is parsed leniently: the recipient may come before
    or after the channel, names are cut at a `<|`, a call on any channel counts, and a
    malformed header becomes plain content rather than an error."""

    def __init__(
        self,
        special_ids: dict[str, int],
        decode: Callable[[list[int]], str],
        *,
        in_header: bool = True,
    ) -> None:
        """`special_ids`: harmony's special tokens → their ids; `decode`: token ids → text
        (bytes of an incomplete character may be held back by the caller). `in_header`: the
        prompt ends with `<|start|>assistant`, so output starts in a header."""
        self._ids = {v: k for k, v in special_ids.items()}
        super().__init__(decode)
        self._state = "header" if in_header else "start"
        self._header: list[int] = []  # header tokens (text and <|channel|> / <|constrain|>)
        self._current: Delta | None = None  # kind / name of the message's content
        self.messages: list[Message] = []
        self._content: list[str] = []
        self._message: Message | None = None

    def push(self, token_ids: Iterable[int]) -> list[Delta]:
        out: list[Delta] = []
        for token in token_ids:
            special = self._ids.get(token)
            if self._state == "start":
                if special == START:
                    self._state, self._header = "header", []
                elif special is None:  # text outside a message: keep it as content
                    out += self._content_text([token], Delta("content", ""))
                continue
            if self._state == "header":
                if special == MESSAGE:
                    self._begin_content()
                elif special in (END, RETURN, CALL):  # a message with no content
                    self._begin_content()
                    self._end(special)
                else:
                    self._header.append(token)
                continue
            if special in (END, RETURN, CALL):
                out += self._flush()
                self._end(special)
            elif special == START:  # a new message without an end: close this one
                out += self._flush()
                self._end(END)
                self._state, self._header = "header", []
            elif special is not None:
                continue  # a stray special token inside content: dropped
            else:
                self._pending.append(token)
                if self._current is not None and self._current.kind == "reasoning":
                    self.reasoning_tokens += 1
                out += self._flush(final=False)
        return out

    def finish(self) -> list[Delta]:
        """The generation ended: flush what is held (a trailing incomplete character)."""
        out = self._flush()
        if self._state == "content":
            self._end(None)
        return out

    def _begin_content(self) -> None:
        header = self._parse_header()
        self._message = header
        self._content = []
        self._state = "content"
        recipient = header.recipient
        if recipient is not None and recipient != "assistant":
            name = recipient.removeprefix(f"{FUNCTIONS}.")
            self._current = Delta("tool_call", "", name, self.calls)
            self.calls += 1
        elif header.channel == "analysis":
            self._current = Delta("reasoning", "")
        else:
            self._current = Delta("content", "")

    def _parse_header(self) -> Message:
        """Role, channel, recipient, content type from the header's tokens (lenient)."""
        parts: list[tuple[str | None, str]] = []  # (special before it, text)
        text: list[int] = []
        before: str | None = None
        for token in self._header:
            special = self._ids.get(token)
            if special is None:
                text.append(token)
                continue
            parts.append((before, self._decode(text)))
            text, before = [], special
        parts.append((before, self._decode(text)))
        author, channel, recipient, content_type = "assistant", None, None, None
        for i, (marker, chunk) in enumerate(parts):
            words = chunk.split()
            if marker == CHANNEL and words:
                channel = words[0].split("<|")[0]
                words = words[1:]
            elif marker == CONSTRAIN:
                content_type = f"{CONSTRAIN}{chunk.strip()}"
                continue
            elif i == 0 and words and not words[0].startswith("to="):
                author = words[0]
                words = words[1:]
            for word in words:
                if word.startswith("to="):
                    recipient = word[3:].split("<|")[0]
                elif content_type is None and i > 0:
                    content_type = word
        return Message(author, "", channel, recipient, content_type)

    def _flush(self, final: bool = True) -> list[Delta]:
        if self._current is None:
            return []
        return self._content_text_decoded(self._take(final))

    def _content_text(self, tokens: list[int], kind: Delta) -> list[Delta]:
        self._current = self._current or kind
        self._pending += tokens
        return self._flush(final=False)

    def _content_text_decoded(self, text: str) -> list[Delta]:
        if not text or self._current is None:
            return []
        self._content.append(text)
        c = self._current
        return [Delta(c.kind, text, c.name, c.index)]

    def _end(self, token: str | None) -> None:
        if self._message is not None:
            self._message.content = "".join(self._content)
            self.messages.append(self._message)
        self._message, self._current, self._content = None, None, []
        self._state = "start"
        if token in STOP_TOKENS:
            self.stop_token = token


def special_ids(tokenizer: Any) -> dict[str, int] | None:
    """Harmony's special tokens → their ids in `tokenizer` (a `tokenizers.Tokenizer`), or None
    when it lacks one of them (the model does not speak harmony)."""
    ids = {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS}
    if any(i is None for i in ids.values()):
        return None
    return ids
