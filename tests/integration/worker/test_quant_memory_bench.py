"""bench/quant_memory.py --quick, run as a user runs it: a table, then one JSON object whose
figures hold the issue's goals (kept quantized: at most 1.5x the checkpoint's bytes, resident
and RSS; dequantized: several times more)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_quick_bench_reports_resident_bytes_rss_and_step_times() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quant_memory.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("hidden 64, 2 layers, 16 experts of 128")
    assert [line.split()[0] for line in lines[2:4]] == ["gpt-oss-mxfp4", "mimo-fp8"]
    report = json.loads(lines[-1])
    for name in ("gpt-oss-mxfp4", "mimo-fp8"):
        r = report[name]
        assert r["kept_resident_bytes"] <= 1.5 * r["checkpoint_bytes"]
        assert r["dequantized_resident_bytes"] >= 2.5 * r["checkpoint_bytes"]
        assert r["resident_ratio"] == r["kept_resident_bytes"] / r["dequantized_resident_bytes"]
        if r["kept_rss_growth_bytes"] is not None:  # Linux: /proc/self/status
            assert r["kept_rss_growth_bytes"] < r["dequantized_rss_growth_bytes"]
        assert r["kept_decode_step_s"] > 0 and r["dequantized_decode_step_s"] > 0
        assert r["decode_step_ratio"] == r["kept_decode_step_s"] / r["dequantized_decode_step_s"]
