"""The repository keeps its promises: README commands, packaging, lint."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", setup, flags=re.S)
    return [
        line for block in blocks for line in block.splitlines() if line and not line.startswith("#")
    ]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    assert "swaserve" in commands[0]
    assert "pytest" in commands[1]
    ci = (REPO / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()


def test_every_source_package_is_packaged() -> None:
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    mapping = conf["package-dir"]
    found = set()
    for name, folder in mapping.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == listed


def test_router_never_imports_worker_or_torch() -> None:
    for path in (REPO / "router").rglob("*.py"):
        text = path.read_text()
        assert not re.search(
            r"^\s*(import|from)\s+(torch|swaserve\.worker|ray)\b", text, flags=re.M
        ), path


def test_worker_never_imports_ray_grpc_or_router() -> None:
    for path in (REPO / "worker").rglob("*.py"):
        text = path.read_text()
        assert not re.search(
            r"^\s*(import|from)\s+(ray|grpc|swaserve\.router)\b", text, flags=re.M
        ), path


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
    reason="ruff not installed",
)
def test_ruff_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    result = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_clean_on_kv_router_and_cluster() -> None:
    pytest.importorskip("mypy")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "worker/kv", "router", "cluster"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.toml", "*.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [REPO / name for name in out]


def test_section_references_resolve_in_docs_architecture() -> None:
    """Code cites `architecture §N` (docs/architecture.md, numbered top-level headings); every
    cited number is a heading there, and no reference points outside the repository."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    headings = {int(n) for n in re.findall(r"^## (\d+)\. ", doc, flags=re.M)}
    assert headings >= {2, 3, 5, 6}
    cited: dict[int, list[str]] = {}
    outside = []
    for path in tracked_text_files():
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        rel = str(path.relative_to(REPO))
        for n in re.findall(r"architecture §(\d+)", text):
            cited.setdefault(int(n), []).append(rel)
        if "DESIGN §" in text and rel != "tests/project/test_repository.py":
            outside.append(rel)
    assert cited, "no references found: the pattern is stale"
    assert set(cited) <= headings, {n: f for n, f in cited.items() if n not in headings}
    assert outside == []


INGRESS_MODULES = [
    "swaserve.proto",
    "swaserve.proto.grammar",
    "swaserve.proto.text.chat_template",
    "swaserve.proto.text.detokenizer",
    "swaserve.proto.text.tokenizer",
    "swaserve.cluster.grpc_server",
    "swaserve.cluster.http_server",
    "swaserve.cluster.openai_api",
    "swaserve.cluster.routed",
    "swaserve.cluster.router_actor",
    "swaserve.cluster.serve",
]
ENGINE_PACKAGES = (
    "torch",
    "swaserve.worker.engine",
    "swaserve.worker.runner",
    "swaserve.worker.models",
)


def test_ingresses_and_proto_import_neither_torch_nor_the_engine() -> None:
    """An HTTP or gRPC proxy replica loads the contract and the ingress, never the engine: each
    module is imported alone in a fresh interpreter and what it pulled in is listed."""
    probe = (
        "import importlib, json, sys\n"
        "importlib.import_module(sys.argv[1])\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    for module in INGRESS_MODULES:
        out = subprocess.run(
            [sys.executable, "-c", probe, module], capture_output=True, text=True, check=True
        ).stdout
        loaded = json.loads(out.splitlines()[-1])
        engine = [m for m in loaded if m.split(".")[0] == "torch" or m.startswith(ENGINE_PACKAGES)]
        assert engine == [], (module, engine[:5])


def test_proto_imports_nothing_of_the_other_packages() -> None:
    for path in (REPO / "proto").rglob("*.py"):
        text = path.read_text()
        assert not re.search(
            r"^\s*(import|from)\s+(torch|ray|swaserve\.(worker|router|cluster))\b", text, flags=re.M
        ), path


def test_the_host_side_of_the_engine_touches_no_device_code() -> None:
    """worker/engine/ holds host policy: it never imports models/ or attention/ and never calls
    torch.cuda (the runner owns the device)."""
    for path in (REPO / "worker" / "engine").rglob("*.py"):
        text = path.read_text()
        assert not re.search(
            r"^\s*(import|from)\s+swaserve\.worker\.(models|attention)\b", text, flags=re.M
        ), path
        assert "torch.cuda" not in text, path


def test_environment_variables_are_read_in_one_module() -> None:
    """proto/environment.py reads every variable swaserve reads (and lists them); elsewhere
    the environment is only passed on to child processes or set for a library."""
    reads = re.compile(
        r"os\.environ\.get\(|os\.getenv\(|\bin os\.environ\b|os\.environ\[[^\]]+\](?!\s*=)"
    )
    for folder in ("worker", "router", "cluster", "proto"):
        for path in (REPO / folder).rglob("*.py"):
            if path == REPO / "proto" / "environment.py":
                continue
            assert not reads.search(path.read_text()), path
