"""The OpenAI-compatible HTTP API over a `Cluster` (FastAPI): `POST /v1/completions`,
`POST /v1/chat/completions`, `GET /v1/models`, `GET /health`, `GET /metrics`.

    body  →  fields: unknown → 400, unsupported (logprobs, penalties, tools, ...) → 400 naming
             them  →  pydantic  →  prompt ids (text: tokenizer, with BOS; messages: the chat
             template, which places BOS itself; ids: as given)  →  SamplingParams, limits
          →  n choices, each its own cluster request (id `<id>`, or `<id>-<i>` when n > 1)
          →  detokenize (UTF-8 safe, stop strings)  →  one JSON body, or SSE chunks
             (`data: {json}`, the last `data: [DONE]`)

A body is at most `MAX_BODY_BYTES`, counted as it streams (a chunked body has no
Content-Length): past the limit nothing more is kept, the rest is read and dropped (up to
`MAX_DRAIN_BYTES`, so that a client that sends its whole body before it reads gets the answer,
not a reset connection), and the answer is a 413 in OpenAI's error shape. Tokenizing a prompt
and rendering a chat template run off the event loop, so one huge prompt does not stall the
other streams.

The app keeps no state: routes read `request.app.state.openai`, an `OpenAIServer`, so the same
app runs standalone (`HttpServer`) and as a Ray Serve ingress. A streaming request's first
token is awaited before the response starts, so that routing errors keep their status (429 with
`Retry-After`, 503, 400); an error after that is a last `data: {"error": ...}` event. A client
that leaves (closed connection) closes its streams: the requests are aborted on their workers
and their KV freed. The engine's "abort" never reaches a client as a finish reason: a request
aborted on the server side ends in a 503 error.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from swaserve.cluster.detokenizer import IncrementalDetokenizer
from swaserve.cluster.grpc_server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_ID_CHARS,
    BadRequest,
    check_id,
    check_stop_strings,
)
from swaserve.cluster.metrics import CONTENT_TYPE, ServingMetrics
from swaserve.cluster.routed import (
    ClusterBusy,
    ClusterError,
    GenerationFailed,
    InvalidRequest,
    ModelInfo,
    RoutedCluster,
    Unavailable,
)
from swaserve.worker import SamplingParams
from swaserve.worker.models.chat_template import ChatTemplate
from swaserve.worker.models.errors import ChatTemplateError
from swaserve.worker.tokenizer import encode_text

logger = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

MAX_CHOICES = 16
ID_PREFIXES = {"text_completion": "cmpl", "chat.completion": "chatcmpl"}
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_BYTES = DEFAULT_MAX_MESSAGE_BYTES  # as the gRPC server's message limit
MAX_DRAIN_BYTES = 4 * MAX_BODY_BYTES  # of a body past the limit, read and dropped at most


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
COMMON_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logprobs": _off(),
    "logit_bias": _off(),
    "presence_penalty": _off(),
    "frequency_penalty": _off(),
}
COMPLETION_UNSUPPORTED = COMMON_UNSUPPORTED | {
    "best_of": _off(1),
    "echo": _off(),
    "suffix": _off(),
}
CHAT_UNSUPPORTED = COMMON_UNSUPPORTED | {
    "top_logprobs": _off(),
    "tools": _off(),
    "tool_choice": _off("none"),
    "parallel_tool_calls": _off(True),
    "functions": _off(),
    "function_call": _off("none"),
    "response_format": _off({"type": "text"}),
    "audio": _off(),
    "modalities": _off(["text"]),
    "prediction": _off(),
    "web_search_options": _off(),
    "reasoning_effort": _off(),
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


def _validation_error(errors: list[Any]) -> APIError:
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
        raise _validation_error(exc.errors()) from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _GenerateRequest(BaseModel):
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


class CompletionRequest(_GenerateRequest):
    prompt: Any  # a string, a list of token ids, or a list of one of those


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: Any  # a string or a list of {"type": "text", "text": ...} parts
    name: str | None = None


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


@dataclass(slots=True)
class _Job:
    """One validated request: what every choice shares."""

    kind: str  # "text_completion" | "chat.completion"
    response_id: str
    created: int
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    session_id: str | None
    n: int
    include_usage: bool
    return_token_ids: bool
    arrival_s: float

    def request_id(self, index: int) -> str:
        return self.response_id if self.n == 1 else f"{self.response_id}-{index}"


@dataclass(slots=True)
class _Delta:
    """One step of one choice: new text and tokens; `finish_reason` on its last."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int


@dataclass(slots=True)
class _Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached: dict[int, int] = field(default_factory=dict)  # choice -> its cached prompt tokens
    # (the prompt is counted once, so its cached tokens are the most any choice had cached)

    def add(self, delta: _Delta) -> None:
        self.completion_tokens += len(delta.token_ids)
        self.cached[delta.index] = delta.cached_tokens

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": max(self.cached.values(), default=0)},
        }


class OpenAIServer:
    """What the routes serve from: the cluster, the metrics (None: no /metrics) and the API key
    (None: no auth). Set it as `app.state.openai`."""

    def __init__(
        self,
        cluster: RoutedCluster,
        metrics: ServingMetrics | None = None,
        api_key: str | None = None,
    ) -> None:
        if api_key is not None and not api_key.strip():
            raise ValueError("api_key must not be empty")
        self.cluster, self.metrics = cluster, metrics
        self._expected_auth = f"Bearer {api_key}".encode() if api_key else None
        self._template: ChatTemplate | None = None
        self.started = int(time.time())

    @property
    def info(self) -> ModelInfo:
        info = self.cluster.model_info
        assert info is not None, "await cluster.ready() first"
        return info

    @property
    def template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate.from_model_dir(self.info.model_path)
        return self._template

    @property
    def serving(self) -> bool:
        ready = self.cluster.model_info is not None
        return ready and not self.cluster.draining and bool(self.cluster.live_workers)

    def authorized(self, header: str) -> bool:
        if self._expected_auth is None:
            return True
        return hmac.compare_digest(header.encode(), self._expected_auth)

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.info.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "swaserve",
            "max_model_len": self.info.limits.max_model_len,
        }

    # ---- requests -> jobs ----------------------------------------------------------------
    def completion_job(self, req: CompletionRequest, arrival_s: float) -> _Job:
        self._check_common(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > 1:
                raise APIError(400, "one prompt per request (no batches)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.cluster.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
            ids = self.cluster.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
            ids = list(prompt)
        else:
            raise APIError(400, "prompt must be a string or a list of token ids", param="prompt")
        return self._job("text_completion", req, ids, arrival_s, "prompt", req.max_tokens)

    def chat_job(self, req: ChatCompletionRequest, arrival_s: float) -> _Job:
        self._check_common(req)
        tokenizer = self.cluster.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids")
        both = (req.max_tokens, req.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise APIError(400, "max_tokens and max_completion_tokens differ", param="max_tokens")
        messages = [
            {"role": m.role, "content": _message_text(m.content, i), "name": m.name}
            for i, m in enumerate(req.messages)
        ]
        try:
            text = self.template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        # The template places BOS itself: encode without adding it again.
        ids = encode_text(tokenizer.tokenizer, text)
        if req.max_completion_tokens is not None:
            return self._job(
                "chat.completion",
                req,
                ids,
                arrival_s,
                "messages",
                req.max_completion_tokens,
                "max_completion_tokens",
            )
        return self._job("chat.completion", req, ids, arrival_s, "messages", req.max_tokens)

    def _check_common(self, req: _GenerateRequest) -> None:
        name = self.info.model_name
        if req.model is not None and req.model != name:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")

    def _job(
        self,
        kind: str,
        req: _GenerateRequest,
        ids: list[int],
        arrival_s: float,
        prompt_field: str,
        max_tokens: int | None,
        max_tokens_field: str = "max_tokens",
    ) -> _Job:
        """The job of a request whose prompt is `ids`; checks the lengths and the sampling
        parameters (a bad one is a 400 naming its field)."""
        default = DEFAULT_COMPLETION_MAX_TOKENS if kind == "text_completion" else None
        max_new = self._max_new_tokens(ids, max_tokens, default, prompt_field, max_tokens_field)
        params = self._sampling_params(req, max_new, max_tokens_field)
        try:
            self.cluster.check_request(ids, params)
        except InvalidRequest as exc:
            raise APIError(400, str(exc), param=prompt_field) from None
        return _Job(
            kind=kind,
            response_id=f"{ID_PREFIXES[kind]}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.info.model_name,
            prompt_ids=ids,
            params=params,
            stop=self._stop(req.stop),
            session_id=self._session(req),
            n=req.n,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            return_token_ids=req.return_token_ids,
            arrival_s=arrival_s,
        )

    def _max_new_tokens(
        self, ids: list[int], asked: int | None, default: int | None, prompt: str, field: str
    ) -> int:
        """`asked`, or the default (None: all the room) clipped to the room the prompt leaves
        (requests are refused up front, never cut short). A request over a limit is a 400
        naming the prompt or `field`, whichever the limit blames."""
        limits = self.info.limits
        if asked is None:
            room = limits.max_new_tokens_room(len(ids))
            asked = max(1, room if default is None else min(default, room))
        refused = limits.check(len(ids), asked, max_new_name=field)
        if refused is not None:
            raise APIError(
                400, refused.message, param=prompt if refused.field == "prompt" else field
            )
        return asked

    def _sampling_params(
        self, req: _GenerateRequest, max_new: int, max_tokens_field: str
    ) -> SamplingParams:
        values: dict[str, Any] = {"max_new_tokens": max_new, "ignore_eos": req.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
            if getattr(req, name) is not None:
                values[name] = getattr(req, name)
        if req.stop_token_ids:
            bad = [t for t in req.stop_token_ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"stop_token_ids: {bad[0]} is outside [0, {self.info.vocab_size})",
                    param="stop_token_ids",
                )
            values["stop_token_ids"] = tuple(req.stop_token_ids)
        try:
            return SamplingParams(**values)
        except ValidationError as exc:
            first = exc.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else "sampling parameters"
            name = max_tokens_field if name == "max_new_tokens" else name
            raise APIError(400, f"{name}: {first['msg']}", param=name) from None

    def _stop(self, stop: Any) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise APIError(400, "stop must be a string or a list of strings", param="stop")
        try:
            checked = check_stop_strings(stops)
        except BadRequest as exc:
            raise APIError(400, str(exc).replace("sampling_params.", ""), param="stop") from None
        if checked and self.cluster.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer: use stop_token_ids", param="stop")
        return checked

    def _session(self, req: _GenerateRequest) -> str | None:
        """The router's session key: `session_id` (checked as gRPC checks it), else
        `prompt_cache_key` or `user` (hashed when not a valid id, e.g. an e-mail address)."""
        if req.session_id is not None:
            try:
                return check_id(req.session_id, "session_id")
            except BadRequest as exc:
                raise APIError(400, str(exc), param="session_id") from None
        key = req.prompt_cache_key or req.user
        if not key:
            return None
        try:
            return check_id(key, "user")
        except BadRequest:
            return "user-" + hashlib.sha256(key.encode()).hexdigest()[: MAX_ID_CHARS // 4]

    # ---- jobs -> choices -----------------------------------------------------------------
    async def choice(self, job: _Job, index: int) -> AsyncGenerator[_Delta, None]:
        """One choice's deltas; the last has `finish_reason` ("stop" | "length"). Closing it
        early aborts the request on its worker. Raises a `ClusterError`."""
        request_id = job.request_id(index)
        tokenizer = self.cluster.tokenizer
        detok = (
            IncrementalDetokenizer(tokenizer.tokenizer, job.prompt_ids, job.stop)
            if tokenizer is not None
            else None
        )
        timer = self.metrics.tracker(job.arrival_s) if self.metrics is not None else None
        stream = self.cluster.generate(
            request_id, job.prompt_ids, job.params, session_id=job.session_id
        )
        new_tokens, cached, worker, outcome = 0, 0, "", "client left"
        try:
            async for chunk in stream:
                worker, cached = chunk.worker_id, chunk.cached_tokens
                new_tokens += len(chunk.token_ids)
                if timer is not None:
                    timer.tokens(len(chunk.token_ids), worker, time.monotonic())
                text = detok.push(chunk.token_ids) if detok is not None else ""
                reason = chunk.finish_reason
                if detok is not None and detok.stopped:
                    reason = "stop"  # a stop string: end here; closing the stream aborts
                elif chunk.finished and detok is not None:
                    text += detok.flush()
                if reason == "abort":
                    raise Unavailable(f"request {request_id} was aborted on the server")
                outcome = reason or outcome
                yield _Delta(index, text, chunk.token_ids, reason, cached)
                if reason:
                    return
        except ClusterError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            await stream.aclose()  # not finished: aborts on the worker, frees the KV
            if timer is not None:
                timer.finish(time.monotonic())
            logger.info(
                "request %s: %d prompt tokens (%d cached) + %d new on %s, %s, %.3f s",
                request_id,
                len(job.prompt_ids),
                cached,
                new_tokens,
                worker or "-",
                outcome,
                time.monotonic() - job.arrival_s,
            )

    async def respond(self, request: Request, job: _Job, stream: bool) -> Response:
        choices = [self.choice(job, i) for i in range(job.n)]
        if not stream:
            collected = await _unless_client_leaves(request, [_collect(c) for c in choices])
            return Response(status_code=499) if collected is None else self._body(job, collected)
        try:
            firsts = await _unless_client_leaves(request, [_first(c) for c in choices])
        except BaseException:
            await _close(choices)  # each is done or waits at a yield: none is running
            raise
        if firsts is None:
            await _close(choices)
            return Response(status_code=499)
        return _EventStream(self._events(job, choices, firsts))

    def _body(self, job: _Job, choices: list[list[_Delta]]) -> JSONResponse:
        usage = _Usage(len(job.prompt_ids))
        out = []
        for index, deltas in enumerate(choices):
            for d in deltas:
                usage.add(d)
            text = "".join(d.text for d in deltas)
            choice: dict[str, Any] = {"index": index}
            if job.kind == "chat.completion":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice |= {"logprobs": None, "finish_reason": deltas[-1].finish_reason}
            if job.return_token_ids:
                choice["token_ids"] = [t for d in deltas for t in d.token_ids]
                choice["prompt_token_ids"] = job.prompt_ids
            out.append(choice)
        return JSONResponse(self._envelope(job, job.kind, out) | {"usage": usage.body()})

    def _envelope(self, job: _Job, kind: str, choices: list[Any]) -> dict[str, Any]:
        return {
            "id": job.response_id,
            "object": kind,
            "created": job.created,
            "model": job.model,
            "choices": choices,
        }

    async def _events(
        self, job: _Job, choices: list[AsyncGenerator[_Delta, None]], firsts: list[_Delta]
    ) -> AsyncGenerator[str, None]:
        chat = job.kind == "chat.completion"
        kind = "chat.completion.chunk" if chat else "text_completion"
        usage = _Usage(len(job.prompt_ids))

        def event(d: _Delta, first: bool) -> str | None:
            usage.add(d)
            if not (first or d.text or d.finish_reason or job.return_token_ids):
                return None
            choice: dict[str, Any] = {"index": d.index}
            if chat:
                delta = {"role": "assistant"} if first else {}
                choice["delta"] = delta | ({"content": d.text} if d.text or first else {})
            else:
                choice["text"] = d.text
            choice |= {"logprobs": None, "finish_reason": d.finish_reason}
            if job.return_token_ids:
                choice["token_ids"] = d.token_ids
                if first:
                    choice["prompt_token_ids"] = job.prompt_ids
            body = self._envelope(job, kind, [choice])
            return _sse(body | {"usage": None} if job.include_usage else body)

        done_early = [c for c, d in zip(choices, firsts, strict=True) if d.finish_reason]
        merged = _merge([c for c, d in zip(choices, firsts, strict=True) if not d.finish_reason])
        try:
            for d in firsts:
                if (line := event(d, first=True)) is not None:
                    yield line
            async for d in merged:
                if (line := event(d, first=False)) is not None:
                    yield line
            if job.include_usage:
                yield _sse(self._envelope(job, kind, []) | {"usage": usage.body()})
            yield "data: [DONE]\n\n"
        except Exception as exc:
            yield _sse(api_error(exc).body())
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()  # closes the choices it merges
            await _close(done_early)


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends, so that its
    requests are aborted as soon as the client leaves (not when the generator is collected)."""

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass  # ASGI 2.4 servers: the client left while a chunk was being sent
        finally:
            await self.events.aclose()


async def _close(choices: list[AsyncGenerator[_Delta, None]]) -> None:
    for choice in choices:
        await choice.aclose()


async def _first(choice: AsyncGenerator[_Delta, None]) -> _Delta:
    return await anext(choice)


async def _collect(choice: AsyncGenerator[_Delta, None]) -> list[_Delta]:
    try:
        return [d async for d in choice]
    finally:
        await choice.aclose()


async def _merge(choices: list[AsyncGenerator[_Delta, None]]) -> AsyncGenerator[_Delta, None]:
    """The deltas of several choices as they come; closes them all however it ends."""
    queue: asyncio.Queue[_Delta | Exception | None] = asyncio.Queue()

    async def pump(choice: AsyncGenerator[_Delta, None]) -> None:
        try:
            async for d in choice:
                queue.put_nowait(d)
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            await choice.aclose()

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has closed the connection (the body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(request: Request, coros: list[Awaitable[T]]) -> list[T] | None:
    """Runs `coros` concurrently: their results, or None when the client leaves first. The
    first exception cancels the rest and is raised. Returns only once every task ended."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    left = asyncio.ensure_future(_disconnected(request.receive))
    try:
        pending: set[asyncio.Future[Any]] = {*tasks, left}
        while True:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if left in done:
                return None
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if all(t.done() for t in tasks):
                return [t.result() for t in tasks]
    finally:
        for task in (*tasks, left):
            task.cancel()
        await asyncio.gather(*tasks, left, return_exceptions=True)


def _message_text(content: Any, index: int) -> str:
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


# ---- the app -----------------------------------------------------------------------------
def _server(request: Request) -> OpenAIServer:
    server: OpenAIServer = request.app.state.openai
    return server


async def _ready_server(request: Request) -> OpenAIServer:
    server = _server(request)
    await server.cluster.ready()
    return server


async def _authorize(request: Request) -> None:
    if not _server(request).authorized(request.headers.get("authorization", "")):
        raise APIError(
            401,
            "missing or wrong API key: send Authorization: Bearer <key>",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def _json(request: Request) -> Any:
    body = await _read_body(request)
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None


async def _read_body(request: Request) -> bytes:
    """The body, or `APIError` 413 once more than `MAX_BODY_BYTES` came (see the module
    docstring). The 413 closes the connection, so the part of the body not read is never
    parsed as a next request; a client that sent `Expect: 100-continue` gets it before it sends
    the body."""
    too_large = APIError(
        413,
        f"the request body is larger than {MAX_BODY_BYTES} bytes",
        code="request_too_large",
        headers={"Connection": "close"},
    )
    declared = request.headers.get("content-length", "")
    declared_bytes = int(declared) if declared.isdigit() else None
    stream = request.stream()
    read = 0
    if declared_bytes is None or declared_bytes <= MAX_BODY_BYTES:
        chunks: list[bytes] = []
        async for chunk in stream:
            read += len(chunk)
            if read > MAX_BODY_BYTES:
                break
            chunks.append(chunk)
        else:
            return b"".join(chunks)
        chunks.clear()
    elif declared_bytes > MAX_DRAIN_BYTES or _expects_continue(request):
        raise too_large  # not worth reading, or not sent yet
    async for chunk in stream:  # drop the rest, up to the drain limit
        read += len(chunk)
        if read > MAX_DRAIN_BYTES:
            break
    raise too_large


def _expects_continue(request: Request) -> bool:
    return request.headers.get("expect", "").lower() == "100-continue"


async def completions(request: Request) -> Response:
    arrival_s = time.monotonic()
    server = await _ready_server(request)
    req = parse_body(await _json(request), CompletionRequest, COMPLETION_UNSUPPORTED)
    job = await asyncio.to_thread(server.completion_job, req, arrival_s)  # tokenizes
    return await server.respond(request, job, req.stream)


async def chat_completions(request: Request) -> Response:
    arrival_s = time.monotonic()
    server = await _ready_server(request)
    req = parse_body(await _json(request), ChatCompletionRequest, CHAT_UNSUPPORTED)
    job = await asyncio.to_thread(server.chat_job, req, arrival_s)  # renders, tokenizes
    return await server.respond(request, job, req.stream)


async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [(await _ready_server(request)).model_card()]}


async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    card = (await _ready_server(request)).model_card()
    if model_id != card["id"]:
        raise APIError(
            404, f"the model {model_id!r} does not exist", param="model", code="model_not_found"
        )
    return card


async def health(request: Request) -> Response:
    server = _server(request)
    if server.serving:
        return JSONResponse({"status": "serving"})
    if server.cluster.model_info is None:
        why = "starting"
    else:
        why = "draining" if server.cluster.draining else "no live worker"
    return JSONResponse({"status": why}, status_code=503)


async def metrics(request: Request) -> Response:
    server = _server(request)
    if server.metrics is None:
        raise APIError(404, "metrics are not enabled on this server", code="not_found")
    return Response(await server.metrics.render(server.cluster), media_type=CONTENT_TYPE)


async def _on_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, RequestValidationError):
        return _validation_error(list(exc.errors())).response()
    if isinstance(exc, HTTPException):
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), error_type=error_type).response()
    return api_error(exc).response()


def build_openai_app() -> FastAPI:
    """The app; set `app.state.openai = OpenAIServer(...)` before it serves."""
    app = FastAPI(title="swaserve", docs_url=None, redoc_url=None, openapi_url=None)
    api = APIRouter(dependencies=[Depends(_authorize)])
    api.add_api_route("/v1/completions", completions, methods=["POST"])
    api.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    api.add_api_route("/v1/models", list_models, methods=["GET"])
    api.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    api.add_api_route("/metrics", metrics, methods=["GET"])
    app.include_router(api)
    app.add_api_route("/health", health, methods=["GET"])
    for kind in (APIError, ClusterError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(kind, _on_error)
    return app
