"""`SamplingParams`: how a request's tokens are chosen. Part of the wire contract: the ingresses
build it, the router reads `max_new_tokens`, the engine's sampler applies it. Pydantic only, no
torch (architecture §3).

The options applications rely on carry vLLM's names: `logprobs` (how many top alternatives to
return with each sampled token's log-probability; None: none at all), `presence_penalty`,
`frequency_penalty` (OpenAI's, over the generated tokens), `repetition_penalty` (over prompt
and generated tokens), `logit_bias`, `min_tokens`, `stop` (strings, matched by the engine) and
`structured_outputs` (`StructuredOutputs`: a JSON schema, any JSON object, a regex, a Lark
grammar or a choice of strings).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_TOP_LOGPROBS = 20
"""OpenAI's bound on `top_logprobs` (and vLLM's default `max_logprobs`)."""

LOGIT_BIAS_LIMIT = 100.0
"""A `logit_bias` value is clamped to [-100, 100], as OpenAI does."""

MAX_LOGIT_BIAS_ENTRIES = 1024
"""Tokens one request may bias (OpenAI allows 300; vLLM does not bound it)."""

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

MAX_GRAMMAR_CHARS = 128 * 1024
"""The longest grammar text (a JSON schema as JSON, a regex, a Lark grammar, the choices):
a larger one is refused before anything compiles it."""

GREEDY_TEMPERATURE = 1e-5
"""A temperature below this samples greedily (vLLM's epsilon): logits over a smaller one
overflow float32, and the distribution is the argmax's to float precision anyway."""
MIN_REPETITION_PENALTY = 0.01
"""A repetition penalty divides positive logits: a smaller one overflows them to infinity."""

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


class StructuredOutputs(BaseModel):
    """Constrain the output: exactly one of a JSON schema (`json_schema`, an object or its JSON
    text), any JSON object (`json_object`), a regex (`regex`), a Lark grammar (`grammar`, with
    llguidance's extensions: `%json`, `%regex`), or one string of `choice`. vLLM names these
    `json`, `json_object`, `regex`, `grammar`, `choice`; the ingresses take those names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        kinds = [k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json_schema, json_object, regex, "
                f"grammar, choice (got {', '.join(kinds) or 'none'})"
            )
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of non-empty strings"
            )
        if isinstance(self.json_schema, str):
            try:
                parsed = json.loads(self.json_schema)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json_schema is not JSON: {exc}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured_outputs.json_schema must be a JSON object")
        if len(self.key) > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"structured_outputs: the {self.kind} is {len(self.key)} characters, over the "
                f"limit of {MAX_GRAMMAR_CHARS}"
            )
        return self

    @property
    def kind(self) -> str:
        return next(k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """The grammar as one string (kind and text): equal keys compile to the same grammar,
        so compiled grammars are cached by it."""
        value = getattr(self, self.kind)
        if self.kind == "json_schema" and isinstance(value, str):
            value = json.loads(value)
        return json.dumps([self.kind, value], sort_keys=True, separators=(",", ":"))


class SamplingParams(BaseModel):
    """Per-request sampling knobs (validated; bad values raise `pydantic.ValidationError`, a
    `ValueError`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(default=128, ge=1, description="tokens to generate at most")
    temperature: float = Field(
        default=1.0, ge=0.0, le=100.0, description="0 (below 1e-5) means greedy"
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, description="-1 (or 0) disables")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop_token_ids: tuple[int, ...] = Field(default=(), description="finish when one is sampled")
    ignore_eos: bool = False
    stop: tuple[str, ...] = Field(
        default=(), description="finish when the text ends in one (it is cut from the text)"
    )
    min_tokens: int = Field(default=0, ge=0, description="EOS and stop ids are masked before")
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="return each sampled token's log-probability and this many top ones",
    )
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=10.0)
    logit_bias: dict[int, float] | None = Field(
        default=None, description="token id → bias added to its logit, clamped to ±100"
    )
    structured_outputs: StructuredOutputs | None = None
    num_speculative_tokens: int | None = Field(
        default=None,
        ge=0,
        le=16,
        description="draft tokens per step for this request on a server with speculative "
        "decoding: None its default k, 0 none, fewer than k caps them (more is k)",
    )

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < -1:
            raise ValueError("top_k must be -1 (disabled), 0 (disabled) or a positive int")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        for s in value:
            if not s:
                raise ValueError("a stop string must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if not value:
            return None
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias biases at most {MAX_LOGIT_BIAS_ENTRIES} tokens")
        out = {}
        for token, bias in value.items():
            if token < 0:
                raise ValueError(f"logit_bias key {token} is not a token id")
            if bias != bias:  # NaN
                raise ValueError(f"logit_bias[{token}] is not a number")
            out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, bias))
        return out

    @property
    def greedy(self) -> bool:
        """Take the argmax: temperature below `GREEDY_TEMPERATURE` (dividing by a smaller one
        overflows float32 logits) or top_k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes this request's logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def processed(self) -> bool:
        """Whether anything besides the grammar changes this request's logits before the
        draw: a penalty, a bias, or `min_tokens`."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    def check_vocab(self, vocab_size: int, *, stop_token_ids: bool = True) -> None:
        """`ValueError` naming the field when a token id is outside [0, `vocab_size`) (of
        `logit_bias`, and of `stop_token_ids` unless told not to: one that is never sampled
        does no harm to the engine)."""
        fields: list[tuple[str, Iterable[int]]] = [("logit_bias", self.logit_bias or ())]
        if stop_token_ids:
            fields.insert(0, ("stop_token_ids", self.stop_token_ids))
        for name, ids in fields:
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside [0, {vocab_size})")
