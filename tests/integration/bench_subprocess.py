"""Run a bench script in a subprocess, as a user would, and read its closing JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench_script(name: str, argv: list[str]) -> dict:
    """`python bench/<name>.py <argv> --json` from the repo root; its last stdout line."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), *argv, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
