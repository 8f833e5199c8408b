"""The engine over a TP group of two CPU processes (gloo): the same greedy tokens and logits as
TP = 1, under memory pressure (page size 4, chunked prefill, prefix cache, tombstones); a rank
that dies or hangs makes rank 0 raise `TensorParallelError` within the timeout; no process is
left behind."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.model_input import ModelInput
from swaserve.worker.parallel import TensorParallelError

pytestmark = pytest.mark.slow

W = 8
GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)


def workload(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(40)]
    return [
        (system if i % 2 else []) + [rng.randrange(1, 250) for _ in range(rng.randint(3, 90))]
        for i in range(8)
    ]


def make_engine(model_dir: Path, tp_size: int, **overrides: object) -> Engine:
    options: dict[str, object] = dict(
        model=str(model_dir),
        max_total_tokens=480,
        swa_full_tokens_ratio=0.3,
        chunked_prefill_size=32,
        page_size=4,
        swa_eviction_interval=8,
        max_running_requests=6,
        tp_size=tp_size,
        tp_timeout_s=20.0,
    )
    options.update(overrides)
    return Engine(EngineConfig(**options))  # type: ignore[arg-type]


def recorded_run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list]:
    logits: list[torch.Tensor] = []
    forward = engine._forward

    def recording(inp: ModelInput) -> torch.Tensor:
        out = forward(inp)
        logits.append(out.clone())
        return out

    engine._forward = recording  # type: ignore[method-assign]
    outs = engine.generate(prompts, GREEDY)
    return [o.token_ids for o in outs], logits


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test made; shut down (and their ranks stopped) even when the test fails."""
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.shutdown()
    for engine in made:
        if engine.launcher is not None:
            assert not any(p.is_alive() for p in engine.launcher.ranks._procs)


MODELS = {
    "gpt-oss": dict(num_layers=4, num_heads=4, num_kv_heads=2),
    # One KV head per layer kind < tp = 2: the KV head is replicated on both ranks.
    "gpt-oss-kv1": dict(num_layers=4, num_heads=4, num_kv_heads=1),
    "mimo-v2-flash": dict(num_layers=4, num_heads=4, num_kv_heads=2),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tp2_equals_tp1(
    name: str, tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    arch = "mimo-v2-flash" if name.startswith("mimo") else "gpt-oss"
    model_dir = tiny_model_factory(
        arch, sliding_window_size=W, hidden_size=32, seed=5, **MODELS[name]
    )
    prompts = workload(1)
    single = make_engine(model_dir, 1)
    engines.append(single)
    tokens_1, logits_1 = recorded_run(single, prompts)
    tp = make_engine(model_dir, 2)
    engines.append(tp)
    tokens_2, logits_2 = recorded_run(tp, prompts)

    assert tokens_2 == tokens_1
    assert len(logits_2) == len(logits_1) > 20
    worst = max(float((a - b).abs().max()) for a, b in zip(logits_1, logits_2, strict=True))
    assert worst < 1e-4
    # The scenario did exercise the SWA machinery under TP.
    assert tp.stats.swa_freed_tokens > 0 and tp.stats.tombstoned_pages > 0
    assert tp.stats.cached_tokens > 0 and tp.stats.prefill_chunks > 0
    tp.check()


def _step_until_error(engine: Engine, budget_s: float) -> str:
    """Step until the engine raises `TensorParallelError` (failing after `budget_s`); its
    message."""
    start = time.monotonic()
    with pytest.raises(TensorParallelError) as err:
        while time.monotonic() - start < budget_s:
            engine.step()
    return str(err.value)


def test_a_killed_rank_makes_rank0_raise_and_nothing_is_left(
    tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=32, seed=5)
    engine = make_engine(model_dir, 2, tp_timeout_s=10.0)
    engines.append(engine)
    for prompt in workload(2):
        engine.add_request(prompt, GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.launcher is not None
    victim = engine.launcher.ranks._procs[0]
    victim.kill()
    victim.join(5)
    message = _step_until_error(engine, 15.0)
    assert "TP rank" in message, message
    with pytest.raises(TensorParallelError, match="TP group is down"):
        engine.step()
    engine.shutdown()
    assert not any(p.is_alive() for p in engine.launcher.ranks._procs)


def test_a_hung_rank_raises_within_the_timeout(
    tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=32, seed=5)
    engine = make_engine(model_dir, 2, tp_timeout_s=3.0)
    engines.append(engine)
    for prompt in workload(3):
        engine.add_request(prompt, GREEDY)
    engine.step()
    assert engine.launcher is not None
    victim = engine.launcher.ranks._procs[0]
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGSTOP)  # alive but unresponsive
    try:
        message = _step_until_error(engine, 20.0)
    finally:
        engine.shutdown()  # kills the stopped rank
    assert "timeout" in message.lower() or "timed out" in message.lower(), message
    assert not victim.is_alive()


def test_generate_cli_with_tp_2(
    tiny_model_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from swaserve.cluster.cli import main

    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=32, seed=5)
    argv = ["generate", "--model", str(model_dir), "--prompt", "ab", "--max-new-tokens", "4"]
    assert main([*argv, "--max-total-tokens", "256", "--tp-size", "2", "--json"]) == 0
    tp_out = capsys.readouterr().out.strip().splitlines()[-1]
    assert main([*argv, "--max-total-tokens", "256", "--json"]) == 0
    single_out = capsys.readouterr().out.strip().splitlines()[-1]
    assert tp_out == single_out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_over_nccl_equals_tp1(
    tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=64, seed=5)
    prompts = workload(4)
    single = make_engine(model_dir, 1, device="cuda", dtype="float32")
    engines.append(single)
    tokens_1, _ = recorded_run(single, prompts)
    tp = make_engine(model_dir, 2, device="cuda", dtype="float32")
    engines.append(tp)
    tokens_2, _ = recorded_run(tp, prompts)
    assert tokens_2 == tokens_1


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_ctrl_c_leaves_no_rank_behind(tiny_model_factory: Callable[..., Path]) -> None:
    import subprocess
    import sys

    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=32, seed=5)
    code = "import sys; from swaserve.cluster.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["generate", "--model", str(model_dir), "--prompt", "ab", "--max-new-tokens", "3000"]
    argv += ["--max-total-tokens", "4096", "--tp-size", "2"]
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ranks:
            ranks = [p for p in _children(proc.pid) if "spawn_main" in _cmdline(p)]
            time.sleep(0.2)
        assert ranks, "the TP rank never started"
        time.sleep(3.0)  # let generation start
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in ranks):
        time.sleep(0.2)
    assert not any(_alive(p) for p in ranks)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
