"""A local Ray for `swaserve serve`, started in a process of its own session.

`ray.init()` in the serving process would start Ray's daemons in that process's group, so a
SIGTERM sent to the group (`timeout`, systemd's control-group stop) would kill them under the
drain that is meant to stop the actors cleanly. Instead a small keeper process, in a new
session, starts Ray and prints its address; the server joins it, and at exit closes the
keeper's stdin, on which the keeper shuts Ray down. If the server dies, the keeper reads EOF
too, so Ray never outlives it.

    python -m swaserve.cluster.local_ray --num-cpus N    # prints "address=HOST:PORT"
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

ADDRESS_PREFIX = "address="
# A new local Ray enables token auth unless RAY_AUTH_MODE says otherwise; a process that joins
# it must run in the same mode, and Ray reads the mode when it is imported.
DEFAULT_AUTH_MODE = "token"
START_TIMEOUT_S = 120.0


def set_auth_mode() -> None:
    """Call before `import ray` in a process that will join a `LocalRay` (the keeper inherits
    the same environment)."""
    os.environ.setdefault("RAY_AUTH_MODE", DEFAULT_AUTH_MODE)


class LocalRay:
    """Start (`start()` → address) and stop (`stop()`) a keeper process and its Ray."""

    def __init__(self, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> str:
        command = [sys.executable, "-m", "swaserve.cluster.local_ray"]
        if self.num_cpus is not None:
            command += ["--num-cpus", str(self.num_cpus)]
        if self.num_gpus is not None:
            command += ["--num-gpus", str(self.num_gpus)]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        for line in self.proc.stdout:
            if line.startswith(ADDRESS_PREFIX):
                return line[len(ADDRESS_PREFIX) :].strip()
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError("the local Ray did not start (see the output above)")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the keeper to shut Ray down; end its whole session if it does not in time."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="keep a local Ray until stdin closes")
    parser.add_argument("--num-cpus", type=int, default=None)
    parser.add_argument("--num-gpus", type=int, default=None)
    args = parser.parse_args(argv)
    import ray

    context: Any = ray.init(
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        include_dashboard=False,
        log_to_driver=False,
    )
    print(f"{ADDRESS_PREFIX}{context.address_info['gcs_address']}", flush=True)
    os.dup2(2, 1)  # nobody reads the pipe any more: later output goes to stderr
    try:
        sys.stdin.read()  # until the server closes it (or dies)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
