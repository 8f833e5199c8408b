"""`ChatTemplate`: a model dir's chat template, rendered the way transformers'
`apply_chat_template` renders it, without transformers (the engine-side helper the HTTP layer
calls for chat requests).

The template comes from `chat_template.jinja` (what transformers 5 writes) or the
`chat_template` field of `tokenizer_config.json` (a string, or a list of named templates: the
one named "default" is used). It is rendered in a sandboxed jinja2 environment with
transformers' settings: `trim_blocks`, `lstrip_blocks`, the `loopcontrols` extension, a
`tojson` filter that does not escape HTML or non-ASCII, and the globals `raise_exception` and
`strftime_now`. The template sees `messages` (keys whose value is None dropped, as
transformers does), `add_generation_prompt`, `tools`, `documents`, the named special tokens
(`bos_token`, `eos_token`, `pad_token`, ... as strings) and any extra keyword arguments.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
Message = Mapping[str, Any]


class ChatTemplateError(Exception):
    """The model has no chat template, or its template cannot be read or rendered."""


class ChatTemplate:
    """One model's chat template (None: the model has none) and its special tokens."""

    def __init__(
        self,
        template: str | None,
        special_tokens: Mapping[str, str] | None = None,
        source: str = "<chat template>",
    ) -> None:
        self.template = template
        self.special_tokens = dict(special_tokens or {})
        self.source = source
        self._compiled: jinja2.Template | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        """Read the template and special tokens of `model_dir` (no template is not an error
        here: `render` raises when a chat request arrives)."""
        root = Path(model_dir)
        config_path = root / TOKENIZER_CONFIG_FILE
        config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ChatTemplateError(f"cannot read {config_path}: {exc}") from exc
        template_path = root / TEMPLATE_FILE
        if template_path.is_file():
            template: str | None = template_path.read_text()
            source = str(template_path)
        else:
            template = _named_default(config.get("chat_template"), config_path)
            source = f"{config_path} (chat_template)"
        specials = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = config.get(name)
            value = value.get("content") if isinstance(value, Mapping) else value
            if isinstance(value, str):
                specials[name] = value
        return cls(template, specials, source if template is not None else str(root))

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages` (tokenize it without adding special tokens: the
        template places them). Raises `ChatTemplateError` when the model has no template, the
        conversation is empty, or the template raises."""
        if self.template is None:
            raise ChatTemplateError(
                f"the model in {self.source} has no chat template (no {TEMPLATE_FILE} and no "
                f"chat_template in {TOKENIZER_CONFIG_FILE}): send a completion request with a "
                "prompt instead"
            )
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty conversation")
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"chat messages must be objects, got {message!r}")
            chat.append({k: v for k, v in message.items() if v is not None})
        try:
            return self._template().render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **(self.special_tokens | kwargs),
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template of {self.source}: {exc}") from exc

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.template or "")
            except jinja2.TemplateSyntaxError as exc:
                raise ChatTemplateError(f"chat template of {self.source}: {exc}") from exc
        return self._compiled


def _named_default(value: Any, path: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ChatTemplateError(
        f"{path}: chat_template must be a string or a list of named templates with a 'default'"
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
