"""Shared helpers of the deployment tests: render the Helm chart with Helm's own Go library
(helm-python-sdk, no helm binary), split it into documents, validate them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "helm" / "swaserve"
SCHEMAS = REPO / "tests" / "data" / "kuberay"  # vendored: see its README.md
KUBE_VERSION = "1.37.0"
CRD_SCHEMAS = {
    "RayService": "rayservice-ray.io-v1.schema.json",
    "RayCluster": "raycluster-ray.io-v1.schema.json",
}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's manifests for `values` (release `sw`, namespace `serving`)."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's library) missing")
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values=values or {}, name="sw", namespace="serving")
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def notes(values: dict[str, Any] | None = None) -> str:
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values=values or {}, name="sw", namespace="serving")
    return rendered["swaserve/templates/NOTES.txt"]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def crd_schema(kind: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / CRD_SCHEMAS[kind]).read_text())


def validate_crd(doc: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.Draft7Validator(crd_schema(doc["kind"])).validate(doc)


def validate_builtin(doc: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
