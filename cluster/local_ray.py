"""A local Ray for `swaserve serve`, started in a process of its own session.

`ray.init()` in the serving process would start Ray's daemons in that process's group, so a
SIGTERM sent to the group (`timeout`, systemd's control-group stop) would kill them under the
drain that is meant to stop the actors cleanly. Instead a small keeper process, in a new
session, starts Ray and prints its address; the server joins it, and at exit closes the
keeper's stdin, on which the keeper shuts Ray down. If the server dies, the keeper reads EOF
too, so Ray never outlives it.

    python -m swaserve.cluster.local_ray --num-cpus N    # prints "address=HOST:PORT"

The local Ray binds loopback (`LOOPBACK`): its GCS, raylet and object manager then take no
connection from another machine. An operator who wants other machines to join it names the
address to bind and advertise instead (`swaserve serve --ray-node-ip-address ADDR`).
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
LOOPBACK = "127.0.0.1"
# Ray resolves a loopback node address to the machine's reachable one, and then listens on
# every interface, unless this switch (read when Ray is imported) says the cluster is this one
# machine: then it keeps 127.0.0.1 and binds only that.
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def set_auth_mode() -> None:
    """Call before `import ray` in a process that will join a `LocalRay` (the keeper inherits
    the same environment)."""
    os.environ.setdefault("RAY_AUTH_MODE", DEFAULT_AUTH_MODE)


def is_loopback(address: str) -> bool:
    return address in ("localhost", "::1") or address.startswith("127.")


def set_node_address(node_ip_address: str) -> None:
    """Call before `import ray` in a process that will start or join a `LocalRay` on
    `node_ip_address` (the keeper and Ray's own processes inherit the environment): on a
    loopback address, Ray keeps it and binds only it."""
    if is_loopback(node_ip_address):
        os.environ[SINGLE_MACHINE_ENV] = "0"


class LocalRay:
    """Start (`start()` → address) and stop (`stop()`) a keeper process and its Ray."""

    def __init__(
        self,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        node_ip_address: str = LOOPBACK,
    ) -> None:
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.node_ip_address = node_ip_address
        self.proc: subprocess.Popen[str] | None = None

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "swaserve.cluster.local_ray"]
        command += ["--node-ip-address", self.node_ip_address]
        if self.num_cpus is not None:
            command += ["--num-cpus", str(self.num_cpus)]
        if self.num_gpus is not None:
            command += ["--num-gpus", str(self.num_gpus)]
        return command

    def start(self) -> str:
        """Start the keeper (`set_node_address` must have run in this process); Ray's
        address."""
        self.proc = subprocess.Popen(
            self.command(),
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
    parser.add_argument("--node-ip-address", default=LOOPBACK, help="the address Ray binds")
    args = parser.parse_args(argv)
    set_node_address(args.node_ip_address)
    import ray

    context: Any = ray.init(
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address=args.node_ip_address,
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
