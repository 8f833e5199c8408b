"""The OpenAI app's OpenAPI document (`GET /openapi.json`): every route, its request body as
the model that parses it, the statuses it answers with; schemathesis (the fuzzer of
bench/api_fuzz.py) reads it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import requests
import schemathesis
from routed_fakes import FakeCluster, serve_over_http

from swaserve.cluster.openai_api.openapi import BODIES, openapi_document
from swaserve.cluster.openai_api.routes import build_openai_app


def test_the_document_lists_every_route_with_its_body_and_statuses(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model = tiny_model_factory("gpt-oss", num_layers=1)
    with serve_over_http(FakeCluster(model, None, ["w0"])) as base:
        doc = requests.get(base.removesuffix("/v1") + "/openapi.json", timeout=30).json()
    app = build_openai_app()
    assert doc == openapi_document(app)
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert documented == {
        ("post", "/v1/completions"),
        ("post", "/v1/chat/completions"),
        ("post", "/v1/responses"),
        ("get", "/v1/responses/{response_id}"),
        ("delete", "/v1/responses/{response_id}"),
        ("get", "/v1/models"),
        ("get", "/v1/models/{model_id}"),
        ("get", "/metrics"),
        ("get", "/health"),
    }
    for path, model_class in BODIES.items():
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        name = body["schema"]["$ref"].rsplit("/", 1)[1]
        schema = doc["components"]["schemas"][name]
        assert set(schema["properties"]) == set(model_class.model_fields)
        assert {"200", "400", "401", "413", "429"} <= set(doc["paths"][path]["post"]["responses"])
    for operations in doc["paths"].values():
        for operation in operations.values():
            assert not any(s.startswith("5") and s != "503" for s in operation["responses"])
    labels = {op.ok().label for op in schemathesis.openapi.from_dict(doc).get_all_operations()}
    assert "POST /v1/chat/completions" in labels and len(labels) == len(documented)
