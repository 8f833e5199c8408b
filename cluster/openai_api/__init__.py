"""The OpenAI-compatible HTTP API over a `RoutedCluster` (FastAPI): `POST /v1/completions`,
`POST /v1/chat/completions`, `GET /v1/models`, `GET /health`, `GET /metrics`.

    body  →  fields: unknown → 400, unsupported (tools, audio, echo, ...) → 400 naming
             them  →  pydantic  →  prompt ids (text: tokenizer, with BOS; messages: the chat
             template, which places BOS itself; ids: as given)  →  SamplingParams, limits
          →  n choices, each its own cluster request (id `<id>`, or `<id>-<i>` when n > 1)
          →  detokenize (UTF-8 safe, stop strings)  →  one JSON body, or SSE chunks
             (`data: {json}`, the last `data: [DONE]`)

By concern:

| module | what |
|---|---|
| `protocol.py` | the wire protocol and its errors: request models, refused fields, `APIError`, `api_error`, `parse_body` |
| `jobs.py` | a request's job: `Job`, `JobBuilder` (prompt ids, limits, sampling parameters, session key) |
| `stream.py` | a job's stream: `Responder` (choices from the cluster, one JSON body or SSE), `Delta`, `Usage` |
| `server.py` | `OpenAIServer`: the cluster, metrics and API key the routes serve from |
| `routes.py` | the routes, the body limit, auth and `build_openai_app()` |
"""

from __future__ import annotations

from swaserve.cluster.openai_api.jobs import Job, JobBuilder
from swaserve.cluster.openai_api.protocol import (
    CHAT_UNSUPPORTED,
    COMMON_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    DEFAULT_COMPLETION_MAX_TOKENS,
    ID_PREFIXES,
    MAX_CHOICES,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    api_error,
    parse_body,
)
from swaserve.cluster.openai_api.routes import MAX_BODY_BYTES, MAX_DRAIN_BYTES, build_openai_app
from swaserve.cluster.openai_api.server import OpenAIServer
from swaserve.cluster.openai_api.stream import Responder

__all__ = [
    "CHAT_UNSUPPORTED",
    "COMMON_UNSUPPORTED",
    "COMPLETION_UNSUPPORTED",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "ID_PREFIXES",
    "MAX_BODY_BYTES",
    "MAX_CHOICES",
    "MAX_DRAIN_BYTES",
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "Job",
    "JobBuilder",
    "OpenAIServer",
    "Responder",
    "StreamOptions",
    "api_error",
    "build_openai_app",
    "parse_body",
]
