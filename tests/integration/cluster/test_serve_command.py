"""`swaserve serve` as a user runs it (a subprocess joining the session's Ray), `swaserve client`
against it, and SIGTERM: health NOT_SERVING, open streams drain, new calls UNAVAILABLE, every
actor stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import ray
from cluster_harness import STARTUP_TIMEOUT_S, greedy, stopped
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swaserve.cluster.serve_command import DEMO_MODEL_NAME, ensure_demo_model
from swaserve.proto.swaserve.v1 import inference_pb2 as pb
from swaserve.proto.swaserve.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

SWASERVE = [sys.executable, "-m", "swaserve.cluster.cli"]
LISTEN = re.compile(r"^swaserve: serving (\S+) .* on 127\.0\.0\.1:(\d+)")


class ServeProcess:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [*SWASERVE, "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_listening(self, timeout_s: float = STARTUP_TIMEOUT_S) -> tuple[str, int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines:
                if m := LISTEN.match(line):
                    return m.group(1), int(m.group(2))
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError("swaserve serve did not start:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._reader.join(10)


def engine_pids_of_other_drivers() -> list[int]:
    """The rank-0 processes (`EngineWorker` actors) alive on the session's Ray that another
    driver than this test's started: those of the `swaserve serve` subprocess."""
    from ray._private import state

    mine = ray.get_runtime_context().get_job_id()
    pids = [
        a["Pid"]
        for a in state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"] == "EngineWorker" and a["JobID"] != mine
    ]
    assert pids, "the subprocess has no live worker"
    return pids


@pytest.fixture
def serve_env(tmp_path: Path, ray_session: str) -> dict[str, str]:
    env = dict(os.environ)
    env["SWASERVE_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def served(serve_env: dict[str, str], ray_session: str) -> Iterator[ServeProcess]:
    """The README's command, with no --model (the demo model), joining the session's Ray."""
    process = ServeProcess(
        [
            "--ray-address",
            ray_session,
            "--grpc-port",
            "0",
            "--device",
            "cpu",
            "--max-total-tokens",
            "4096",
            "--status-interval-s",
            "0.5",
        ],
        serve_env,
    )
    try:
        yield process
    finally:
        process.stop()


def test_demo_model_is_made_once(tmp_path: Path) -> None:
    first = ensure_demo_model(tmp_path)
    assert first == tmp_path / DEMO_MODEL_NAME
    stamp = (first / "config.json").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEMO_MODEL_NAME]  # no leftovers


def test_serve_client_and_sigterm_drain(served: ServeProcess, serve_env: dict[str, str]) -> None:
    name, port = served.wait_listening()
    assert name == DEMO_MODEL_NAME
    assert any(f"swaserve client --server 127.0.0.1:{port}" in line for line in served.lines)
    address = f"127.0.0.1:{port}"
    client = subprocess.run(
        [*SWASERVE, "client", "--server", address, "--max-new-tokens", "5", "Hello"],
        capture_output=True,
        text=True,
        timeout=120,
        env=serve_env,
    )
    assert client.returncode == 0, client.stderr
    assert re.search(
        r"\[(length|stop); \d+ prompt tokens \(0 cached\), \d+ new; worker-0\]", client.stdout
    )
    load = subprocess.run(
        [*SWASERVE, "client", "--server", address, "--load"],
        capture_output=True,
        text=True,
        timeout=60,
        env=serve_env,
    )
    workers = json.loads(load.stdout)["workers"]
    assert [w["workerId"] for w in workers] == ["worker-0"]

    channel = grpc.insecure_channel(address)
    stub = pb_grpc.InferenceStub(channel)
    items: list[pb.GenerateResponse] = []
    started = threading.Event()

    def long_stream() -> None:
        request = pb.GenerateRequest(
            token_ids=[5] * 10, sampling_params=greedy(300, ignore_eos=True)
        )
        for item in stub.Generate(request, timeout=120):
            items.append(item)
            started.set()

    streaming = threading.Thread(target=long_stream)
    streaming.start()
    assert started.wait(60)
    with stopped(engine_pids_of_other_drivers()):  # the stream stays open through the drain
        served.proc.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.02)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(token_ids=[1, 2]), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    streaming.join(120)
    assert items[-1].finish_reason == "length"  # the open stream drained to its end
    assert sum(len(i.token_ids) for i in items) == 300
    channel.close()
    assert served.proc.wait(60) == 0
    served._reader.join(10)
    assert served.lines[-1] == "swaserve: stopped"
    assert any("request req-" in line for line in served.lines), "it logs each request's id"
    assert any("status | worker-0: run" in line for line in served.lines)
    deadline = time.monotonic() + 60  # its actors are gone: the session's CPUs are free again
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


def test_serve_rejects_bad_flags_before_starting_anything(serve_env: dict[str, str]) -> None:
    out = subprocess.run(
        [*SWASERVE, "serve", "--page-size", "0", "--model", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
        env=serve_env,
    )
    assert out.returncode == 2
    assert "page_size" in out.stderr


def raylet_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-x", "raylet"], capture_output=True, text=True)
    return {int(pid) for pid in out.stdout.split()}


def test_serve_starts_its_own_ray_and_survives_a_group_sigterm(
    serve_env: dict[str, str], cluster_model: Path
) -> None:
    """Without --ray-address the command starts a local Ray in a session of its own, so a
    SIGTERM to the command's whole process group (`timeout`, systemd) still drains cleanly;
    the local Ray is gone afterwards."""
    before = raylet_pids()
    process = ServeProcess(
        ["--model", str(cluster_model), "--grpc-port", "0", "--num-cpus", "2", "--device", "cpu"],
        serve_env,
    )
    try:
        _, port = process.wait_listening()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(token_ids=[1, 2, 3], sampling_params=greedy(4))
            assert sum(len(i.token_ids) for i in stub.Generate(request, timeout=60)) == 4
        assert len(raylet_pids() - before) == 1  # its own Ray
        os.killpg(process.proc.pid, signal.SIGTERM)
        assert process.proc.wait(60) == 0
        process._reader.join(10)
        assert process.lines[-1] == "swaserve: stopped"
        deadline = time.monotonic() + 30
        while raylet_pids() - before:
            assert time.monotonic() < deadline, "the local Ray outlived the server"
            time.sleep(0.2)
    finally:
        process.stop()
