"""`ProcessRanks` over stand-in rank commands (`python -c ...`, no model): each rank gets its
start-up line (the store's address and its `RankSpec` as JSON) on stdin; a rank that dies is
reported by its own report or, without one, by its last line of output; every line it writes
reaches this process's stderr, prefixed; a rank ends when its stdin ends. The real rank
process is exercised in tests/integration/worker/test_engine_tp.py."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from swaserve.worker.config import EngineConfig
from swaserve.worker.kv.pool_plan import PoolPlan
from swaserve.worker.runner.executor import RankSpec
from swaserve.worker.runner.process_ranks import ERROR_MARK, ProcessRanks, rank_env

SPEC = RankSpec(
    EngineConfig(model="/models/tiny", tp_size=2, page_size=4, max_total_tokens=256),
    PoolPlan(
        full_tokens=256,
        swa_tokens=64,
        full_bytes=1 << 20,
        swa_bytes=1 << 18,
        page_size=4,
        swa_full_tokens_ratio=0.25,
    ),
    (6, 64),
)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def wait_dead(ranks: ProcessRanks, timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while not (dead := ranks.dead()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return dead


def test_a_rank_spec_survives_json() -> None:
    assert RankSpec.from_json(json.loads(json.dumps(SPEC.to_json()))) == SPEC


def test_rank_env_puts_this_import_path_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    monkeypatch.setattr(sys, "path", ["", "/my/notebook/dir", "/usr/lib/python3"])
    assert rank_env()["PYTHONPATH"] == os.pathsep.join(
        ["/my/notebook/dir", "/usr/lib/python3", "/somewhere/else"]
    )


def test_each_rank_reads_its_start_up_line_and_its_rank() -> None:
    code = "import sys; print(sys.argv[1:]); print(sys.stdin.readline().strip())"
    ranks = ProcessRanks(3, python(code))
    ranks.start("127.0.0.1", 4567, SPEC)
    ranks.stop(10.0)
    for rank, out in enumerate(ranks._outputs, start=1):
        argv, line = list(out.tail)
        assert argv == str(["--rank", str(rank), "--world-size", "3"])
        launch = json.loads(line)
        assert (launch["store_host"], launch["store_port"]) == ("127.0.0.1", 4567)
        assert RankSpec.from_json(launch["spec"]) == SPEC
    assert [p.returncode for p in ranks.processes] == [0, 0]


def test_a_rank_that_dies_without_a_report_is_told_by_its_last_line() -> None:
    ranks = ProcessRanks(2, python("print('loading'); print('out of memory'); raise SystemExit(3)"))
    ranks.start("127.0.0.1", 1, SPEC)
    try:
        pid = ranks.processes[0].pid
        assert wait_dead(ranks) == [f"TP rank 1 (pid {pid}, exit code 3)"]
        assert ranks.errors() == ["TP rank 1 exited with code 3: out of memory"]
        assert ranks.errors() == []  # told once
    finally:
        ranks.stop(0.0)


def test_a_rank_that_reports_is_told_by_its_report() -> None:
    report = ERROR_MARK + json.dumps("TP rank 1: RuntimeError: no shard\nTraceback ...")
    code = f"import sys; sys.stderr.write({report!r} + '\\n'); raise SystemExit(1)"
    ranks = ProcessRanks(2, python(code))
    ranks.start("127.0.0.1", 1, SPEC)
    try:
        assert wait_dead(ranks)
        assert ranks.errors() == ["TP rank 1: RuntimeError: no shard\nTraceback ..."]
    finally:
        ranks.stop(0.0)


def test_a_ranks_output_reaches_stderr_prefixed(capfd: pytest.CaptureFixture[str]) -> None:
    ranks = ProcessRanks(2, python("import sys; print('hello'); sys.stderr.write('warn\\n')"))
    ranks.start("127.0.0.1", 1, SPEC)
    ranks.stop(10.0)
    err = capfd.readouterr().err
    assert "[tp rank 1] hello\n" in err and "[tp rank 1] warn\n" in err


def test_a_rank_ends_when_its_stdin_ends() -> None:
    """What happens when rank 0's process dies: the pipe's end is the rank's signal."""
    code = (
        "import sys; sys.stdin.buffer.readline(); "
        "from swaserve.worker.runner.process_ranks import _exit_with_parent; "
        "print('watching', flush=True); _exit_with_parent(0)"
    )
    ranks = ProcessRanks(2, python(code))
    ranks.start("127.0.0.1", 1, SPEC)
    try:
        out = ranks._outputs[0]
        deadline = time.monotonic() + 60
        while "watching" not in out.tail and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ranks.dead() == []
        stdin = ranks.processes[0].stdin
        assert stdin is not None
        stdin.close()
        assert wait_dead(ranks)
        assert ranks.processes[0].returncode == 0
    finally:
        ranks.stop(0.0)


def test_stop_ends_a_rank_that_does_not_stop() -> None:
    ranks = ProcessRanks(
        2,
        python("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"),
    )
    ranks.start("127.0.0.1", 1, SPEC)
    ranks.stop(0.5)
    assert ranks.processes[0].returncode is not None  # killed: it ignored the stop
