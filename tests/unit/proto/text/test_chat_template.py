"""`ChatTemplate` renders exactly what transformers' `apply_chat_template(tokenize=False)`
renders, for the tiny tokenizer's template and for a template that leans on transformers'
jinja settings (whitespace trimming, loop controls, `tojson`, `raise_exception`, `namespace`);
a model without a template gets a clear error when a chat request arrives."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from swaserve.proto.text.chat_template import TEMPLATE_FILE, ChatTemplate, ChatTemplateError
from swaserve.worker.models.tiny import write_byte_tokenizer

transformers = pytest.importorskip("transformers")

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Japan? ünïcödé 🙂"},
    ],
    [{"role": "user", "content": "  spaced\n\tlines  "}, {"role": "assistant", "content": None}],
]

# Written the way real templates are (GPT-OSS / Qwen style): whitespace control, loop state,
# a namespace, tools as JSON, and raise_exception for a role the template does not know.
RICH_TEMPLATE = """{%- set ns = namespace(system=none) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] -%}{%- endif -%}
{%- endfor -%}
{{ bos_token }}
{% if ns.system is not none %}<|system|>{{ ns.system }}
{% endif %}
{% if tools %}<|system|>tools: {{ tools | tojson }}
{% endif %}
{% for message in messages %}
  {% if message['role'] == 'system' %}{% continue %}{% endif %}
  {% if message['role'] not in ['user', 'assistant'] %}
    {{ raise_exception('unknown role ' + message['role']) }}
  {% endif %}
<|{{ message['role'] }}|>{{ message['content'] | trim }}{% if not loop.last %}{{ eos_token }}{% endif %}

{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "<b>sunny</b> é"}}]


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    write_byte_tokenizer(tmp_path)
    return tmp_path


def hf_render(model_dir: Path, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_tiny_template_renders_as_transformers(
    tiny_dir: Path, index: int, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[index]
    ours = ChatTemplate.from_model_dir(tiny_dir).render(
        messages, add_generation_prompt=add_generation_prompt
    )
    assert ours == hf_render(tiny_dir, messages, add_generation_prompt=add_generation_prompt)
    if index == 0:
        assert ours == "<|bos|><|user|>hi<|eos|>" + (
            "<|assistant|>" if add_generation_prompt else ""
        )


def use_rich_template(model_dir: Path) -> None:
    """As transformers 5 saves it: chat_template.jinja, none in tokenizer_config.json."""
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    (model_dir / TEMPLATE_FILE).write_text(RICH_TEMPLATE)


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_template_file_with_jinja_features_renders_as_transformers(
    tiny_dir: Path, index: int, tools: list[dict[str, Any]] | None
) -> None:
    use_rich_template(tiny_dir)
    messages = CONVERSATIONS[index]
    ours = ChatTemplate.from_model_dir(tiny_dir).render(
        messages, add_generation_prompt=True, tools=tools
    )
    assert ours == hf_render(tiny_dir, messages, add_generation_prompt=True, tools=tools)
    if index == 1 and tools is None:
        assert ours == (
            "<|bos|>\n<|system|>Answer in one word.\n<|user|>Capital of France?<|eos|>\n"
            "<|assistant|>Paris<|eos|>\n<|user|>And of Japan? ünïcödé 🙂\n<|assistant|>"
        )


def test_template_errors_are_typed(tiny_dir: Path) -> None:
    use_rich_template(tiny_dir)
    template = ChatTemplate.from_model_dir(tiny_dir)
    with pytest.raises(ChatTemplateError) as err:
        template.render([{"role": "tool", "content": "42"}])
    assert str(err.value) == f"chat template of {tiny_dir / TEMPLATE_FILE}: unknown role tool"
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        template.render([])
    broken = ChatTemplate("{% for m in messages %}", source="x.jinja")
    with pytest.raises(
        ChatTemplateError, match=re.escape("chat template of x.jinja: Unexpected end")
    ):
        broken.render([{"role": "user", "content": "hi"}])


def test_named_templates_use_the_default(tiny_dir: Path) -> None:
    config_path = tiny_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ eos_token }}{{ messages[0]['content'] }}"},
    ]
    config_path.write_text(json.dumps(config))
    ours = ChatTemplate.from_model_dir(tiny_dir).render([{"role": "user", "content": "x"}])
    assert ours == "<|eos|>x" == hf_render(tiny_dir, [{"role": "user", "content": "x"}])


def test_model_without_a_template_fails_at_the_chat_request(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.template is None
    with pytest.raises(ChatTemplateError) as err:
        template.render([{"role": "user", "content": "hi"}])
    assert str(err.value) == (
        f"the model in {tmp_path} has no chat template (no chat_template.jinja and no "
        "chat_template in tokenizer_config.json): send a completion request with a prompt instead"
    )
