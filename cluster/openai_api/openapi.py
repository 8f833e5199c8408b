"""The OpenAPI document of the OpenAI-compatible app (`GET /openapi.json`): its routes, the
request bodies as the pydantic models that parse them (`CompletionRequest`,
`ChatCompletionRequest`, `ResponsesRequest`), and every status a route may answer with, in
OpenAI's error shape. The routes parse their bodies themselves (unknown and unsupported fields
are refused by name, `protocol.parse_body`), so FastAPI cannot see the models: this module puts
them into the document. A fuzzer reads it (`bench/api_fuzz.py`); a status not listed here is a
bug."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from swaserve.cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from swaserve.cluster.openai_api.responses import ResponsesRequest

REF = "#/components/schemas/{model}"
BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
}
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
HEALTH = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
WHY = {
    "400": "a malformed body or field, or a field over the server's caps",
    "401": "a missing or wrong API key",
    "404": "an unknown model, route or stored response",
    "413": "a body over the size limit",
    "429": "no worker has room, or the client is over its rate or open-request limit",
    "503": "draining, or no live worker",
}
"""What each error status means; `routes.py` answers with no other (500 is a bug)."""
STATUSES = {
    "POST": ("400", "401", "404", "413", "429", "503"),
    "GET": ("401", "404", "503"),
    "DELETE": ("401", "404", "503"),
}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The app's document (made once, then kept on the app)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title="swaserve", version="1", routes=app.routes)
    keys, defs = models_json_schema(
        [(model, "validation") for model in BODIES.values()], ref_template=REF
    )
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    components["Error"] = ERROR
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            ok: dict[str, Any] = {"description": "the answer"}
            if method == "post" and path in BODIES:
                schema = keys[(BODIES[path], "validation")]
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                }
                ok["content"] = {"application/json": {}, "text/event-stream": {}}
            error = {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}
            statuses = ("401", "404") if path == "/metrics" else STATUSES[method.upper()]
            operation["responses"] = {
                "200": ok,
                **{s: {"description": WHY[s], "content": error} for s in statuses},
            }
            if path == "/health":  # {"status": ...}, 503 while not serving
                status = {"application/json": {"schema": HEALTH}}
                operation["responses"] = {
                    "200": {"description": "serving", "content": status},
                    "503": {
                        "description": "starting, draining or no live worker",
                        "content": status,
                    },
                }
    app.openapi_schema = doc
    return doc
