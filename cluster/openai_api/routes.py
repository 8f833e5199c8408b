"""The routes of the OpenAI-compatible app: `POST /v1/completions`, `POST /v1/chat/completions`,
`POST /v1/responses` (with GET / DELETE of a stored one), `GET /v1/models`, `GET /health`,
`GET /metrics`, and `GET /openapi.json`, their document (`openapi.py`).

A body is at most `MAX_BODY_BYTES`, counted as it streams (a chunked body has no
Content-Length): past the limit nothing more is kept, the rest is read and dropped (up to
`MAX_DRAIN_BYTES`, so that a client that sends its whole body before it reads gets the answer,
not a reset connection), and the answer is a 413 in OpenAI's error shape. Tokenizing a prompt
and rendering a chat template run off the event loop, so one huge prompt does not stall the
other streams.

The app keeps no state: routes read `request.app.state.openai`, an `OpenAIServer`, so the same
app runs standalone (`HttpServer`) and as a Ray Serve ingress.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from swaserve.cluster.metrics import CONTENT_TYPE
from swaserve.cluster.openai_api.openapi import openapi_document
from swaserve.cluster.openai_api.protocol import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    api_error,
    parse_body,
    validation_error,
)
from swaserve.cluster.openai_api.responses import UNSUPPORTED as RESPONSES_UNSUPPORTED
from swaserve.cluster.openai_api.responses import ResponsesRequest
from swaserve.cluster.openai_api.server import OpenAIServer
from swaserve.cluster.request_checks import DEFAULT_MAX_MESSAGE_BYTES
from swaserve.cluster.routed import ClusterError, RateLimited

MAX_BODY_BYTES = DEFAULT_MAX_MESSAGE_BYTES  # as the gRPC server's message limit
MAX_DRAIN_BYTES = 4 * MAX_BODY_BYTES  # of a body past the limit, read and dropped at most
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
"""The POST routes that start requests: each counts against its client's budget."""


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
    job = await asyncio.to_thread(server.jobs.completion_job, req, arrival_s)  # tokenizes
    return await server.responder.respond(request, job, req.stream)


async def chat_completions(request: Request) -> Response:
    arrival_s = time.monotonic()
    server = await _ready_server(request)
    req = parse_body(await _json(request), ChatCompletionRequest, CHAT_UNSUPPORTED)
    job = await asyncio.to_thread(server.jobs.chat_job, req, arrival_s)  # renders, tokenizes
    return await server.responder.respond(request, job, req.stream)


async def create_response(request: Request) -> Response:
    arrival_s = time.monotonic()
    server = await _ready_server(request)
    req = parse_body(await _json(request), ResponsesRequest, RESPONSES_UNSUPPORTED)
    service = server.responses
    history = await service.history(req)
    job, translated = await asyncio.to_thread(service.prepare, req, history, arrival_s)
    events = service.run(req, job, translated, history)
    if not req.stream:
        last: dict[str, Any] = {}
        try:
            async for _, data in events:
                last = data
        finally:
            await events.aclose()
        return JSONResponse(last["response"])
    return StreamingResponse(_sse_events(events), media_type="text/event-stream")


async def _sse_events(
    events: AsyncGenerator[tuple[str, dict[str, Any]], None],
) -> AsyncGenerator[str, None]:
    """Server-sent events with `event:` names and a monotonic `sequence_number`; an error after
    the stream began is an `error` event."""
    sequence = 0
    try:
        async for name, data in events:
            body = {"type": name, "sequence_number": sequence, **data}
            sequence += 1
            yield f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
    except Exception as exc:
        error = api_error(exc).body()["error"]
        body = {"type": "error", "sequence_number": sequence, **error}
        yield f"event: error\ndata: {json.dumps(body)}\n\n"
    finally:
        await events.aclose()


async def get_response(request: Request, response_id: str) -> dict[str, Any]:
    server = await _ready_server(request)
    return (await server.responses.store.get(response_id)).response


async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
    server = await _ready_server(request)
    await server.responses.store.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


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
        return validation_error(list(exc.errors())).response()
    if isinstance(exc, HTTPException):
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), error_type=error_type).response()
    return api_error(exc).response()


class ClientLimits:
    """ASGI middleware: a POST to `GENERATE_PATHS` takes a place in its client's budget
    (`RoutedCluster.admit`: rate and open requests) before its body is read, and holds it until
    the response is sent, streamed or not (or the client left); over the budget, a 429 with
    `Retry-After`. A request with a wrong key passes untouched to its 401."""

    def __init__(self, app: ASGIApp, owner: FastAPI) -> None:
        self.app, self.owner = app, owner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if scope["type"] != "http" or scope["method"] != "POST" or path not in GENERATE_PATHS:
            await self.app(scope, receive, send)
            return
        server: OpenAIServer = self.owner.state.openai
        peer = scope.get("client")
        client = server.client_of(
            Headers(scope=scope).get("authorization", ""), peer[0] if peer else None
        )
        if client is None:
            await self.app(scope, receive, send)
            return
        try:
            lease = server.cluster.admit(client)
        except RateLimited as exc:
            await api_error(exc).response()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            lease.release()


def build_openai_app() -> FastAPI:
    """The app; set `app.state.openai = OpenAIServer(...)` before it serves."""
    app = FastAPI(title="swaserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    api = APIRouter(dependencies=[Depends(_authorize)])
    api.add_api_route("/v1/completions", completions, methods=["POST"])
    api.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    api.add_api_route("/v1/responses", create_response, methods=["POST"])
    api.add_api_route("/v1/responses/{response_id}", get_response, methods=["GET"])
    api.add_api_route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])
    api.add_api_route("/v1/models", list_models, methods=["GET"])
    api.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    api.add_api_route("/metrics", metrics, methods=["GET"])
    app.include_router(api)
    app.add_api_route("/health", health, methods=["GET"])
    for kind in (APIError, ClusterError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(kind, _on_error)
    app.add_middleware(ClientLimits, owner=app)
    return app
