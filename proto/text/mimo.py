"""MiMo-V2-Flash's chat format: reasoning in `<think>` blocks and tool calls as XML, parsed from
generated tokens as they stream, and the grammars that force a call or constrain the answer in
that syntax. The prompt itself is the checkpoint's own chat template (`CHAT_TEMPLATE` is the
format's template for tiny test models); this module reads what the model writes back.

    <|im_start|>system\\n{system}[# Tools ... <tools>...</tools> ...]<|im_end|>
    <|im_start|>user\\n{text}<|im_end|>
    <|im_start|>assistant\\n[<think>{reasoning}</think>]{content}
        <tool_call>\\n<function={name}>\\n<parameter={key}>{value}</parameter>\\n...
        </function>\\n</tool_call><|im_end|>
    <|im_start|>tool\\n<tool_response>\\n{result}\\n</tool_response>\\n<|im_end|>
    <|im_start|>assistant\\n<think>          (thinking on)   or   ...<think></think> (off)

Turns are joined without a newline. `<think>`, `</think>`, `<tool_call>` and `</tool_call>`
are single tokens and are recognized by id. A parameter's value is raw text: it becomes JSON
by its schema's type (a string stays a string; numbers, booleans, objects and arrays are
parsed as JSON). A call whose body is a JSON object (`{"name": ..., "arguments": ...}`, the
Qwen / Hermes style) is read too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from swaserve.proto.text.parsed import Delta, OutputParser

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK, THINK_END = "<think>", "</think>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
SPECIAL_TOKENS = (IM_START, IM_END, END_OF_TEXT)
"""Special in the tokenizer's sense (never text)."""
ADDED_TOKENS = (THINK, THINK_END, TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END)
"""Single tokens that decode to their text, as in MiMo's (Qwen2-based) vocabulary."""
REQUIRED_TOKENS = (IM_END, THINK, THINK_END, TOOL_CALL, TOOL_CALL_END)
STOP_TOKENS = (IM_END, END_OF_TEXT)

SYSTEM_DEFAULT = "You are MiMo, a helpful AI assistant engineered by Xiaomi."

CHAT_TEMPLATE = (
    """\
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- set keep_all = keep_all_reasoning is defined and keep_all_reasoning -%}
{%- set msgs = messages -%}
{%- if msgs and msgs[0].role == 'system' -%}
{{- '<|im_start|>system\\n' + msgs[0].content -}}
{%- set msgs = msgs[1:] -%}
{%- else -%}
{{- '<|im_start|>system\\n"""
    + SYSTEM_DEFAULT
    + """' -}}
{%- endif -%}
{%- if tools -%}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.'
    + '\\n\\nYou have access to the following functions:\\n\\n<tools>' -}}
{%- for t in tools -%}
{%- set f = t.function if t.function is defined else t -%}
{{- '\\n<function>\\n<name>' + f.name + '</name>' -}}
{%- if f.description -%}{{- '\\n<description>' + f.description | trim + '</description>' -}}
{%- endif -%}
{{- '\\n<parameters>' -}}
{%- if f.parameters and f.parameters.properties -%}
{%- for pname, p in f.parameters.properties | items -%}
{{- '\\n<parameter>\\n<name>' + pname + '</name>' -}}
{%- if p.type is defined -%}{{- '\\n<type>' + p.type | string + '</type>' -}}{%- endif -%}
{%- if p.description is defined -%}
{{- '\\n<description>' + p.description | trim + '</description>' -}}
{%- endif -%}
{%- for k, v in p | items if k not in ('type', 'description') -%}
{{- '\\n<' + k + '>' + v | tojson + '</' + k + '>' -}}
{%- endfor -%}
{{- '\\n</parameter>' -}}
{%- endfor -%}
{%- endif -%}
{%- if f.parameters and f.parameters.required -%}
{{- '\\n<required>' + f.parameters.required | tojson + '</required>' -}}
{%- endif -%}
{{- '\\n</parameters>\\n</function>' -}}
{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, output the function name and arguments in the '
    + 'following format:\\n<tool_call>\\n<function=example_function_name>\\n'
    + '<parameter=example_parameter_1>value_1</parameter>\\n</function>\\n</tool_call>\\n\\n'
    + 'Close </think> before a <tool_call>; never call a function inside <think>. A value '
    + 'between parameter tags is kept exactly as written.' -}}
{%- endif -%}
{{- '<|im_end|>' -}}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in msgs -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}
{%- endif -%}{%- endfor -%}
{%- for m in msgs -%}
{%- if m.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if m.reasoning_content and (keep_all or loop.index0 > ns.last_user) -%}
{{- '<think>' + m.reasoning_content + '</think>' -}}
{%- endif -%}
{{- m.content or '' -}}
{%- for c in m.tool_calls or [] -%}
{%- set f = c.function if c.function is defined else c -%}
{{- '<tool_call>\\n<function=' + f.name + '>\\n' -}}
{%- for k, v in f.arguments | items -%}
{{- '<parameter=' + k + '>' -}}
{%- if v is string -%}{{- v -}}{%- else -%}{{- v | tojson -}}{%- endif -%}
{{- '</parameter>\\n' -}}
{%- endfor -%}
{{- '</function>\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>' -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>tool\\n' -}}{%- endif -%}
{{- '<tool_response>\\n' + m.content + '\\n</tool_response>\\n' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>' -}}{%- endif -%}
{%- else -%}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' + ('<think>' if thinking else '<think></think>') -}}
{%- endif -%}"""
)
"""MiMo-V2-Flash's chat format as a template (system default, XML tool list, `<think>` kept
for the turns after the last user message, calls as XML, tool results grouped in one tool
turn, `enable_thinking` off by default)."""

_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


def special_ids(tokenizer: Any) -> dict[str, int] | None:
    """The format's tokens → their ids in `tokenizer` (a `tokenizers.Tokenizer`), or None when
    it lacks one the parser needs (the model does not speak this format)."""
    ids = {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS + ADDED_TOKENS}
    if any(ids[name] is None for name in REQUIRED_TOKENS):
        return None
    return {k: v for k, v in ids.items() if v is not None}


def json_value(raw: str, schema: Any) -> Any:
    """A parameter's raw text as the JSON value its schema's type says (a string when the type
    is string or the text is not valid JSON)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind and kind[0] == "string"):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class StreamParser(OutputParser):
    """Generated tokens → `Delta`s: text inside `<think>` is reasoning, a `<tool_call>` block is
    a call (its name as soon as `<function=...>` is complete, its arguments as each parameter
    closes), the rest is content. Whitespace between calls is not content. A call that cannot
    be read (no function name) comes out as content, as the model wrote it."""

    def __init__(
        self,
        special_ids: dict[str, int],
        decode: Callable[[list[int]], str],
        *,
        in_reasoning: bool = False,
        tools: dict[str, Any] | None = None,
    ) -> None:
        """`in_reasoning`: the prompt ends inside `<think>` (thinking on); `tools`: function
        name → its parameters' JSON schema, for the values' types."""
        super().__init__(decode)
        self._ids = {v: k for k, v in special_ids.items()}
        self._state = "reasoning" if in_reasoning else "content"
        self._tools = tools or {}
        self._held = ""  # whitespace-only content, held until text follows
        self._call = ""  # the open call's text so far
        self._call_name: str | None = None
        self._call_args = 0  # parameters emitted for the open call
        self._call_closed = False

    def push(self, token_ids: Iterable[int]) -> list[Delta]:
        out: list[Delta] = []
        for token in token_ids:
            special = self._ids.get(token)
            if special is None:
                self._pending.append(token)
                if self._state == "reasoning":
                    self.reasoning_tokens += 1
                out += self._drain(final=False)
                continue
            out += self._drain(final=True)
            if special == THINK:
                self._state = "reasoning"
            elif special == THINK_END:
                self._state = "content" if self._state == "reasoning" else self._state
            elif special == TOOL_CALL and self._state != "call":
                self._held = ""
                self._state, self._call, self._call_name = "call", "", None
                self._call_args, self._call_closed = 0, False
            elif special == TOOL_CALL_END and self._state == "call":
                out += self._end_call()
            elif special in STOP_TOKENS:
                self.stop_token = special
        return out

    def finish(self) -> list[Delta]:
        out = self._drain(final=True)
        if self._state == "call":
            out += self._end_call()
        if self._held and not self.calls:
            out.append(Delta("content", self._held))
        self._held = ""
        return out

    def _drain(self, final: bool) -> list[Delta]:
        text = self._take(final)
        if not text:
            return []
        if self._state == "reasoning":
            return [Delta("reasoning", text)]
        if self._state == "call":
            self._call += text
            return self._read_call()
        text = self._held + text
        if not text.strip():
            self._held = text
            return []
        self._held = ""
        return [Delta("content", text)]

    def _read_call(self) -> list[Delta]:
        """The pieces of the open call that are complete in `self._call`."""
        out: list[Delta] = []
        if self._call_name is None:
            if self._call.lstrip().startswith("{"):
                return out  # a JSON call: read whole at </tool_call>
            match = _FUNCTION.search(self._call)
            if match is None:
                return out
            self._call_name = match.group(1).strip()
            self._call = self._call[match.end() :]
            out.append(Delta("tool_call", "", self._call_name, self.calls))
            self.calls += 1
        schema = (self._tools.get(self._call_name) or {}).get("properties") or {}
        while not self._call_closed:
            match = _PARAMETER.search(self._call)
            end = self._call.find("</function>")
            if match is not None and (end < 0 or match.start() < end):
                key, raw = match.group(1).strip(), match.group(2)
                raw = raw.removeprefix("\n").removesuffix("\n")
                piece = json.dumps(key) + ": " + json.dumps(json_value(raw, schema.get(key)))
                out.append(self._args(("{" if self._call_args == 0 else ", ") + piece))
                self._call_args += 1
                self._call = self._call[match.end() :]
            elif end >= 0:
                out.append(self._args("}" if self._call_args else "{}"))
                self._call_closed = True
                self._call = self._call[end + len("</function>") :]
            else:
                break
        return out

    def _args(self, text: str) -> Delta:
        return Delta("tool_call", text, self._call_name, self.calls - 1)

    def _end_call(self) -> list[Delta]:
        out = self._read_call()
        if self._call_name is None:
            out += self._json_call()
        elif not self._call_closed:
            out.append(self._args("}" if self._call_args else "{}"))
        self._state = "content"
        self._call = ""
        return out

    def _json_call(self) -> list[Delta]:
        try:
            body = json.loads(self._call)
            name = body["name"]
            args = body.get("arguments", body.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError, AttributeError):
            return [Delta("content", f"{TOOL_CALL}{self._call}{TOOL_CALL_END}")]
        text = args if isinstance(args, str) else json.dumps(args)
        self.calls += 1
        return [
            Delta("tool_call", "", name, self.calls - 1),
            Delta("tool_call", text, name, self.calls - 1),
        ]


def prompt_in_reasoning(prompt_ids: Sequence[int], special: dict[str, int]) -> bool:
    """Whether generation starts inside `<think>`: the prompt ends with it (thinking on)."""
    return bool(prompt_ids) and prompt_ids[-1] == special.get(THINK)


# ---- grammars ------------------------------------------------------------------------------
THINK_RULE = "think: /(?s:.*)/ </think>"
TEXT_VALUE = 'text_value[stop="</parameter>"]: /(?s:.*)/'
CLOSE_REGEX = r"<\/parameter>\n"


def _lark_regex(regex: str) -> str:
    return regex.replace("/", "\\/")


def _value_rule(schema: Any, compact: Callable[[Any], Any]) -> str:
    """A Lark expression for one parameter's value and its closing tag. A string's value is
    its raw text (an enum's members, a pattern, a length range, or any text up to the closing
    tag); any other value is its JSON text, by its schema (bounds, items, properties)."""
    close = ' "</parameter>\\n"'
    if not isinstance(schema, dict) or not schema:
        return "text_value" + ' "\\n"'
    kind = schema.get("type")
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(json.dumps(v) for v in enum) + ")" + close
    if kind == "string":
        # one lexeme with its closing tag: a greedy value would eat the tag's first bytes
        if isinstance(schema.get("pattern"), str):
            pattern = schema["pattern"].removeprefix("^").removesuffix("$")
            return f"/(?:{_lark_regex(pattern)}){CLOSE_REGEX}/"
        low, high = schema.get("minLength"), schema.get("maxLength")
        if isinstance(low, int) or isinstance(high, int):
            top = high if isinstance(high, int) else ""
            return f"/(?s:.{{{low or 0},{top}}}){CLOSE_REGEX}/"
        return "text_value" + ' "\\n"'
    if kind is None and "enum" not in schema and "const" not in schema:
        return "text_value" + ' "\\n"'
    return f"%json {json.dumps(compact(schema))}" + close


def forced_call_grammar(
    tools: Sequence[tuple[str, Any]],
    thinking: bool,
    parallel: bool,
    compact: Callable[[Any], Any],
) -> str:
    """A Lark grammar (llguidance's) that makes the model call one of `tools` ((name, JSON
    schema of its parameters) pairs) in this format, each parameter's value valid for its
    schema: the declared parameters in order, the required ones always, the others optional;
    more calls after the first when `parallel`; `<|im_end|>` ends it. With `thinking`, free
    reasoning and `</think>` come first. `compact`: a schema → the same with compact JSON asked for."""
    rules = [TEXT_VALUE]
    alternatives = []
    for k, (name, schema) in enumerate(tools):
        schema = schema if isinstance(schema, dict) else {}
        required = set(schema.get("required") or ())
        params = []
        for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            rules.append(f'p_{k}_{j}: "<parameter={key}>" {_value_rule(sub, compact)}')
            params.append(f"p_{k}_{j}" + ("" if key in required else "?"))
        body = " ".join(params)
        rules.append(
            f'call_{k}: <tool_call> "\\n<function={name}>\\n" {body} "</function>\\n" </tool_call>'
        )
        alternatives.append(f"call_{k}")
    calls = 'call ("\\n"? call)*' if parallel else "call"
    head = [
        f'start: {"think " if thinking else ""}"\\n"? {calls} {IM_END}',
        f"call: {' | '.join(alternatives)}",
    ]
    if thinking:
        head.append(THINK_RULE)
    return "\n".join(head + rules)


def final_answer_grammar(answer: str, thinking: bool) -> str:
    """A Lark grammar whose content after the reasoning is `answer` (a Lark expression), then
    `<|im_end|>`."""
    if not thinking:
        return f"start: answer {IM_END}\nanswer: {answer}"
    return "\n".join([f"start: think answer {IM_END}", THINK_RULE, f"answer: {answer}"])
