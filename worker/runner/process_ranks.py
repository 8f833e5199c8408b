"""`ProcessRanks`: TP ranks 1..tp-1 as child processes of rank 0's process, and the rank
process's own side (`rank_main`, run by `python -m swaserve.worker.runner.process_ranks`).

    rank 0                                       rank r (python -m swaserve.worker.runner.process_ranks
                                                          --rank r --world-size n)
    Popen(rank_command(), env=rank_env())  ──▶  stdin: one JSON line {store, RankSpec}
    RankOutput thread  ◀── stdout + stderr ───  run_worker_rank(...); a failure is reported
      forwards each line to fd 2, keeps a tail     as one ERROR_MARK line, traceback included
    holds the stdin pipe  ───────── EOF ──────▶  rank0-watch thread: os._exit

The rank is started with rank 0's interpreter and import path and imports nothing of the user's
program, so it does not matter how that program was started (a file, stdin, a notebook, with or
without a main guard). It ignores SIGINT (a terminal's Ctrl-C reaches the whole foreground
group; rank 0 decides) and ends when its stdin ends, that is when rank 0 closes it or dies
however it dies. `PR_SET_PDEATHSIG` would not do: it fires when the *thread* that started the
process ends, so an engine built in a worker thread would lose its ranks.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import IO, Any

from swaserve.worker.runner.executor import RankSpec, run_worker_rank

RANK_MODULE = "swaserve.worker.runner.process_ranks"
ERROR_MARK = "swaserve-tp-rank-error: "  # a rank's own failure report: this, then JSON, one line
TAIL_LINES = 40  # output lines kept per rank, for the failure message of a rank that died
EXIT_GRACE_S = 1.0  # a rank that failed may still be writing its report and exiting


def rank_command() -> list[str]:
    """The command of a rank process (its --rank / --world-size follow): this interpreter, the
    rank module. runpy's warning that the module is already imported (its package imports it)
    is expected and silenced."""
    return [sys.executable, "-W", "ignore::RuntimeWarning:runpy", "-m", RANK_MODULE]


def rank_env() -> dict[str, str]:
    """This process's environment with its import path in front of PYTHONPATH, so that a rank
    imports what rank 0 imports (a notebook's or a script's own `sys.path` edits included)."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


class RankOutput:
    """One rank process's stdout + stderr, read by a thread: every line goes on to this process's
    stderr (fd 2, as an inherited stream would), prefixed `[tp rank r]`; the last `TAIL_LINES`
    are kept, and the rank's own failure reports (`ERROR_MARK` lines) are collected."""

    def __init__(self, stream: IO[bytes], rank: int) -> None:
        self.rank = rank
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.reports: list[str] = []  # not yet taken
        self.reported = False  # the rank sent a report, ever
        self._lock = threading.Lock()
        self._stream = stream
        self._thread = threading.Thread(
            target=self._read, name=f"swaserve-tp-rank{rank}-output", daemon=True
        )
        self._thread.start()

    def _read(self) -> None:
        for raw in iter(self._stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._lock:
                if line.startswith(ERROR_MARK):
                    line = str(json.loads(line[len(ERROR_MARK) :]))
                    self.reports.append(line)
                    self.reported = True
                else:
                    self.tail.append(line)
            text = "".join(f"[tp rank {self.rank}] {part}\n" for part in line.splitlines())
            with contextlib.suppress(OSError):  # no stderr (a daemon): the tail is still kept
                os.write(2, text.encode())
        self._stream.close()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def last_line(self) -> str:
        with self._lock:
            return next((line for line in reversed(self.tail) if line.strip()), "")

    def take_reports(self) -> list[str]:
        with self._lock:
            reports, self.reports = self.reports, []
        return reports


class ProcessRanks:
    """`RankHandles` over child processes: `command` (default `rank_command()`) followed by
    `--rank r --world-size n`, for r in 1..n-1. Each reads its start-up line from its stdin and
    exits when that pipe ends."""

    def __init__(self, world_size: int, command: Sequence[str] | None = None) -> None:
        self.world_size = world_size
        self.command = list(command) if command is not None else rank_command()
        self.processes: list[subprocess.Popen[bytes]] = []
        self._outputs: list[RankOutput] = []
        self._told: set[int] = set()  # ranks whose exit errors() has reported
        self._finalizer: Any = None

    def start(self, store_host: str, store_port: int, spec: RankSpec) -> None:
        launch = {"store_host": store_host, "store_port": store_port, "spec": spec.to_json()}
        line = (json.dumps(launch) + "\n").encode()
        env = rank_env()
        for rank in range(1, self.world_size):
            proc = subprocess.Popen(
                [*self.command, "--rank", str(rank), "--world-size", str(self.world_size)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
            )
            self.processes.append(proc)
            assert proc.stdin is not None and proc.stdout is not None  # both are PIPE
            self._outputs.append(RankOutput(proc.stdout, rank))
            with contextlib.suppress(OSError):  # it died before reading: see dead() / errors()
                proc.stdin.write(line)
                proc.stdin.flush()
        # At interpreter exit without stop(): end them rather than leave them to their stdin.
        self._finalizer = weakref.finalize(self, _stop_processes, list(self.processes), 0.0)

    def dead(self) -> list[str]:
        return [
            f"TP rank {rank} (pid {proc.pid}, exit code {proc.returncode})"
            for rank, proc in enumerate(self.processes, start=1)
            if proc.poll() is not None
        ]

    def errors(self) -> list[str]:
        """The ranks' own reports since the last call, and for a rank that exited without one,
        its last line of output. Gives a rank that is failing `EXIT_GRACE_S` to finish."""
        deadline = time.monotonic() + EXIT_GRACE_S
        messages = []
        for rank, (proc, out) in enumerate(zip(self.processes, self._outputs, strict=True), 1):
            with contextlib.suppress(subprocess.TimeoutExpired):  # alive: hung, or waiting
                proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.returncode is not None:
                out.join(max(0.0, deadline - time.monotonic()))
            messages += out.take_reports()
            if proc.returncode is not None and rank not in self._told:
                self._told.add(rank)
                if not out.reported:
                    messages.append(
                        f"TP rank {rank} exited with code {proc.returncode}: "
                        f"{out.last_line() or 'no output'}"
                    )
        return messages

    def stop(self, join_timeout_s: float) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        _stop_processes(self.processes, join_timeout_s)
        for out in self._outputs:
            out.join(2.0)


def _stop_processes(procs: list[subprocess.Popen[bytes]], join_timeout_s: float) -> None:
    """Wait up to `join_timeout_s` for the ranks, then terminate, then kill what is left; then
    close their stdin."""
    deadline = time.monotonic() + join_timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(2.0)
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()


# ---- the rank process ------------------------------------------------------------------------
class _ReportToRank0:
    """`run_worker_rank`'s `errors` in a rank process: one `ERROR_MARK` line on stderr."""

    def put(self, message: str) -> None:
        sys.stderr.write(ERROR_MARK + json.dumps(message) + "\n")
        sys.stderr.flush()


def _exit_with_parent(fd: int) -> None:
    """Block until rank 0 closes this process's stdin or dies, then end this process. Reads
    the file descriptor itself: a daemon thread inside `sys.stdin`'s buffer would hold its
    lock at interpreter exit, which Python treats as fatal."""
    while os.read(fd, 1 << 16):
        pass
    os._exit(0)


def rank_main(argv: Sequence[str] | None = None) -> None:
    """A rank process: its start-up line from stdin, then `run_worker_rank` until rank 0 says
    stop or goes away."""
    parser = argparse.ArgumentParser(prog=f"python -m {RANK_MODULE}")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line:
        raise SystemExit("no start-up line on stdin: TP ranks are started by rank 0")
    threading.Thread(
        target=_exit_with_parent, args=(sys.stdin.fileno(),), name="rank0-watch", daemon=True
    ).start()
    report = _ReportToRank0()
    try:
        launch = json.loads(line)
        spec = RankSpec.from_json(launch["spec"])
    except (ValueError, KeyError, TypeError) as exc:
        report.put(f"TP rank {args.rank}: its start-up line holds no RankSpec: {exc!r}")
        raise SystemExit(1) from None
    code = 1
    try:
        run_worker_rank(
            args.rank, args.world_size, launch["store_host"], launch["store_port"], spec, report
        )
        code = 0
    except SystemExit as exc:  # the group went away (reported)
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception:  # reported to rank 0 already, with its traceback
        pass
    finally:
        # No interpreter shutdown: a process group's destructor waits for what it still runs,
        # which a failed collective may leave running for its group's whole timeout.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":  # a rank process (`rank_command`)
    rank_main()
