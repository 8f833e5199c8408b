"""bench/gpu_check.py as CI runs it, on a machine without CUDA: one command, exit status 0, every
check reported once as skipped with the reason, and a closing JSON line that says the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
CHECKS = ["attn", "logits", "sync", "mxfp4", "fp8", "decode", "graphs", "grammar", "spec"]

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA the script runs its checks: run it by hand"
)


def test_without_cuda_every_check_is_skipped_and_the_script_exits_0() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    checks = [line.split()[0] for line in lines[1:-2]]
    assert checks == CHECKS
    for line in lines[1:-2]:
        assert line.split()[1:3] == ["all", "SKIPPED"]
        assert line.endswith("no CUDA device (torch.cuda.is_available() is False)")
    assert lines[-2].startswith("gpu_check: 0 failed")
    summary = json.loads(lines[-1])
    assert [r["check"] for r in summary["results"]] == CHECKS
    assert {r["status"] for r in summary["results"]} == {"skipped"}
    assert (summary["failed"], summary["device"], summary["ratios"]) == (0, "none", {})
