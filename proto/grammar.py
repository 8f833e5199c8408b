"""A request's `StructuredOutputs` as an llguidance grammar, and the check an ingress runs on it
before anything is routed (no tokenizer, no torch: llguidance's core is a Rust library).

    StructuredOutputs ─ grammar_text ─► llguidance grammar (JSON) ─ check_grammar ─► ok, or
                                                                       GrammarError naming why

JSON schemas compile with compact separators (`{"a": 1}` style is still accepted by the
parser but whitespace between tokens is not free), so a model cannot run to `max_tokens` on
whitespace. llguidance supports most of JSON Schema (nested objects, arrays, enums, `anyOf`,
`$ref`, `pattern`, `format`, `multipleOf`, numeric and length bounds); a keyword it does not
implement (`uniqueItems`, `contains`, ...) makes the grammar invalid, and the request is refused
with the keyword named, never served with the keyword silently dropped.
"""

from __future__ import annotations

import json
import re

import llguidance

from swaserve.proto.sampling_params import StructuredOutputs

JSON_OPTIONS = {"whitespace_flexible": False}
"""How JSON schemas compile: the compact separators only (no runaway whitespace)."""

_ANY_JSON_OBJECT: dict[str, object] = {"type": "object"}


class GrammarError(ValueError):
    """A grammar that does not compile, or uses what llguidance does not implement."""


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar of `spec` (raises `GrammarError` when it cannot be built)."""
    kind = spec.kind
    try:
        if kind == "json_schema":
            schema = spec.json_schema
            if isinstance(schema, str):
                schema = json.loads(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                _ANY_JSON_OBJECT,
                defaults=JSON_OPTIONS,  # type: ignore[arg-type]
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex or "")
        if kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(spec.grammar or "")
        choices = "|".join(re.escape(c) for c in spec.choice or ())
        return llguidance.LLMatcher.grammar_from_regex(f"({choices})")
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"structured_outputs.{kind}: {exc}") from None


def check_grammar(spec: StructuredOutputs) -> str:
    """`grammar_text(spec)` once llguidance validated it (raises `GrammarError` naming the
    problem: a syntax error, an unimplemented JSON-schema keyword)."""
    text = grammar_text(spec)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, None)
    if failed:
        raise GrammarError(f"structured_outputs.{spec.kind}: {_first_line(messages[0])}")
    unsupported = [m for m in messages if "Unimplemented" in m or "unsupported" in m.lower()]
    if unsupported:
        raise GrammarError(f"structured_outputs.{spec.kind}: {_first_line(unsupported[0])}")
    return text


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"
