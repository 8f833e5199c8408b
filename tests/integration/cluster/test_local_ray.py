"""The local Ray of `swaserve serve`: it binds loopback unless the operator names another
address (`--ray-node-ip-address`, `$SWASERVE_RAY_NODE_IP_ADDRESS`)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

import pytest

from swaserve.cluster.local_ray import LOOPBACK, LocalRay
from swaserve.cluster.serve_command import add_arguments
from swaserve.proto.environment import NODE_IP_ADDRESS_ENV

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def descendants(root: int) -> set[int]:
    """`root` and every process under it (from /proc/<pid>/stat's parent ids)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return found


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """The TCP addresses that `pids` listen on (/proc/net/tcp{,6} joined to their fds)."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes |= {int(link[8:-1]) for link in links if link.startswith("socket:[")}
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A: LISTEN
                out.append(_address(fields[1]))
    return out


def is_loopback(host: str) -> bool:
    ip = ipaddress.ip_address(host)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_the_node_address_flag_defaults_to_loopback_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def parsed(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return parser.parse_args(list(argv))

    monkeypatch.delenv(NODE_IP_ADDRESS_ENV, raising=False)
    assert parsed().ray_node_ip_address == LOOPBACK
    assert parsed("--ray-node-ip-address", "10.1.2.3").ray_node_ip_address == "10.1.2.3"
    monkeypatch.setenv(NODE_IP_ADDRESS_ENV, "10.9.8.7")
    assert parsed().ray_node_ip_address == "10.9.8.7"
    command = LocalRay(num_cpus=2, node_ip_address="10.9.8.7").command()
    assert command[command.index("--node-ip-address") + 1] == "10.9.8.7"


@pytest.mark.slow
@linux_only
def test_a_local_ray_listens_on_loopback_only() -> None:
    local = LocalRay(num_cpus=1)
    address = local.start()
    try:
        assert local.proc is not None
        host, port = address.rsplit(":", 1)
        assert host == LOOPBACK
        bound = listening(descendants(local.proc.pid))
        assert int(port) in {p for _, p in bound}  # the GCS is among them
        assert len(bound) >= 3  # GCS, raylet, object manager at least
        assert [a for a in bound if not is_loopback(a[0])] == []
    finally:
        local.stop()
