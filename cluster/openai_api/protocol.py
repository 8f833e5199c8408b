"""The OpenAI wire protocol as swaserve speaks it: request bodies, the fields it refuses, and
errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`).

    body  →  fields: unknown → 400, unsupported (tools, audio, echo, ...) → 400 naming
             them (values that leave a feature off are accepted; none is ignored)  →  pydantic
             (a bad field is a 400 naming it)

`api_error` maps every error an ingress meets (a bad request, a `ClusterError`, anything else)
to its OpenAI answer: 400, 429 with `Retry-After`, 503, 500.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from swaserve.cluster.ingress_limits import MAX_CHOICES
from swaserve.cluster.request_checks import BadRequest
from swaserve.cluster.routed import ClusterBusy, GenerationFailed, InvalidRequest, Unavailable
from swaserve.proto.sampling_params import MAX_TOP_LOGPROBS
from swaserve.proto.text.chat_template import ChatTemplateError

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

ID_PREFIXES = {"text_completion": "cmpl", "chat.completion": "chatcmpl"}
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _off(*neutral: object) -> Callable[[Any], bool]:
    """A predicate: the value leaves the feature off (None, false, 0, empty, or `neutral`)."""

    def check(value: Any) -> bool:
        if value is None or value is False or value in ("", [], {}):
            return True
        if type(value) in (int, float) and value == 0:
            return True
        return any(type(value) is type(n) and value == n for n in neutral)

    return check


# Fields of OpenAI's API that swaserve does not implement: a request that turns one on gets a
# 400 naming it (none is ignored). Values that leave the feature off are accepted.
COMMON_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {}
COMPLETION_UNSUPPORTED = COMMON_UNSUPPORTED | {
    "best_of": _off(1),
    "echo": _off(),
    "suffix": _off(),
}
CHAT_UNSUPPORTED = COMMON_UNSUPPORTED | {
    "functions": _off(),
    "function_call": _off("none"),
    "audio": _off(),
    "modalities": _off(["text"]),
    "prediction": _off(),
    "web_search_options": _off(),
    "verbosity": _off(),
    "store": _off(),
    "metadata": _off(),
    "service_tier": _off("auto", "default"),
}


class APIError(Exception):
    """An error answer in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, error_type
        self.param, self.code, self.headers = param, code, dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(exc: Exception) -> APIError:
    """The OpenAI error of a cluster error (any other exception is a 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (BadRequest, InvalidRequest, ChatTemplateError)):
        return APIError(400, str(exc))
    if isinstance(exc, ClusterBusy):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return APIError(
            429,
            str(exc),
            error_type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": retry},
        )
    if isinstance(exc, Unavailable):
        return APIError(503, str(exc), error_type="server_error", code="service_unavailable")
    if isinstance(exc, GenerationFailed):
        return APIError(500, str(exc), error_type="server_error")
    logger.error("unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", error_type="server_error")


def validation_error(errors: list[Any]) -> APIError:
    first = errors[0]
    loc = [p for p in first["loc"] if p != "body"]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    return APIError(400, f"{param or 'body'}: {first['msg']}", param=param or None)


def parse_body(body: Any, model: type[M], unsupported: Mapping[str, Callable[[Any], bool]]) -> M:
    """The request model of a JSON body; raises `APIError` (400) naming the offending fields."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    rejected = sorted(k for k, v in body.items() if k in unsupported and not unsupported[k](v))
    if rejected:
        raise APIError(
            400,
            f"not supported by swaserve: {', '.join(rejected)}",
            param=rejected[0],
            code="unsupported_parameter",
        )
    unknown = sorted(k for k in body if k not in model.model_fields and k not in unsupported)
    if unknown:
        raise APIError(
            400,
            f"unrecognized request argument(s): {', '.join(unknown)}",
            param=unknown[0],
            code="unknown_parameter",
        )
    try:
        return model.model_validate({k: v for k, v in body.items() if k not in unsupported})
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class BaseGenerateRequest(BaseModel):
    """Fields both endpoints take: OpenAI's, then vLLM-style extras."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None  # a string or a list of them
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    user: str | None = Field(None, max_length=1024, description="session key (hashed if need be)")
    prompt_cache_key: str | None = Field(None, max_length=1024, description="session key too")
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    session_id: str | None = None
    return_token_ids: bool = False  # vLLM's: each choice gets token_ids and prompt_token_ids
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are: a string) → bias
    repetition_penalty: float | None = None  # vLLM's extras from here on
    min_tokens: int | None = None
    num_speculative_tokens: int | None = None  # drafts per step (server with speculation)
    structured_outputs: dict[str, Any] | None = (
        None  # json | json_object | regex | grammar | choice
    )
    guided_json: Any = None  # vLLM's earlier names of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(BaseGenerateRequest):
    prompt: Any  # a string, a list of token ids, or a list of one of those
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str


class ToolCall(BaseModel):
    """An earlier assistant turn's tool call, as the client sends it back."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # a string or a list of {"type": "text", "text": ...} parts
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant: its reasoning, sent back (vLLM's name)
    reasoning: str | None = None  # ... and its other name


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")  # dots: namespaced (Responses)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(BaseGenerateRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def message_text(content: Any, index: int) -> str:
    """A message's text: a string, or the text parts of a list joined by newlines."""
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(
                400, f"{param}[{j}]: only text parts are supported, not {kind!r}", param=param
            )
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{param}[{j}].text must be a string", param=param)
        texts.append(part["text"])
    return "\n".join(texts)
