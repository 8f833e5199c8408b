"""The engine over a TP group of two CPU processes (gloo): the same greedy tokens and logits as
TP = 1, under memory pressure (page size 4, chunked prefill, prefix cache, tombstones); rank 1
gets no logits (they are gathered to rank 0 only); a rank that dies or hangs makes rank 0 raise
`TensorParallelError` within the timeout, as does a forward that raises on rank 0; a rank that
fails at start-up fails `Engine(...)` within 10 s with its own error; an idle group outlives the
timeout; however the program was started (stdin, a file without a main guard) its ranks start,
and however it ends (Ctrl-C, SIGKILL) no rank is left behind."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from test_mtp import run_recording_drafts

from swaserve.proto import StructuredOutputs
from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.engine.engine import CALIBRATION_TOKENS
from swaserve.worker.runner.executor import TPLauncher
from swaserve.worker.runner.model_input import ModelInput
from swaserve.worker.runner.parallel import TensorParallelError
from swaserve.worker.runner.process_ranks import RANK_MODULE, ProcessRanks

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
            assert all(p.poll() is not None for p in rank_processes(engine))


def rank_processes(engine: Engine) -> list[subprocess.Popen[bytes]]:
    assert isinstance(engine.launcher, TPLauncher)
    assert isinstance(engine.launcher.ranks, ProcessRanks)
    return engine.launcher.ranks.processes


MODELS = {
    "gpt-oss": dict(num_layers=4, num_heads=4, num_kv_heads=2),
    # One KV head per layer kind < tp = 2: the KV head is replicated on both ranks.
    "gpt-oss-kv1": dict(num_layers=4, num_heads=4, num_kv_heads=1),
    "mimo-v2-flash": dict(num_layers=4, num_heads=4, num_kv_heads=2),
    "gemma3": dict(num_layers=4, num_heads=4, num_kv_heads=2),
    "cohere2": dict(num_layers=4, num_heads=4, num_kv_heads=2),
    "olmo3": dict(num_layers=4, num_heads=4, num_kv_heads=2),
    # One KV head < tp = 2: k_norm's sum of squares counts the replicated head once.
    "olmo3-kv1": dict(num_layers=4, num_heads=4, num_kv_heads=1),
    "exaone4": dict(num_layers=4, num_heads=4, num_kv_heads=2),
    # Chunked attention, MoE with a shared expert (experts split over their intermediate dim).
    "llama4": dict(num_layers=4, num_heads=4, num_kv_heads=2),
    # Per-kind head dims and KV heads (one global KV head, replicated), K = V, KV-shared
    # layers, per-layer inputs.
    "gemma4": dict(num_layers=6, num_heads=4, num_kv_heads=2),
    # Gemma 4's MoE block beside the MLP: experts split over their intermediate dim.
    "gemma4-moe": dict(num_layers=6, num_heads=4, num_kv_heads=2, enable_moe_block=True),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tp2_equals_tp1(
    name: str, tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    arch = "mimo-v2-flash" if name.startswith("mimo") else name.removesuffix("-kv1")
    arch = arch.removesuffix("-moe")
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


@pytest.mark.parametrize("arch", ["gpt-oss", "llama4"])
def test_tp2_with_ngram_drafts_equals_tp1_without(
    arch: str, tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    """Verify steps under TP: every rank runs the step's extends of 1 + k and rank 0 accepts;
    greedy tokens equal plain decoding on one rank, through SWA freeing and prefix hits."""
    model_dir = tiny_model_factory(
        arch, sliding_window_size=W, hidden_size=32, seed=5, **MODELS[arch]
    )
    prompts = [p + p[-12:] * 3 for p in workload(1)]  # phrases that repeat: drafts
    single = make_engine(model_dir, 1)
    engines.append(single)
    want = [o.token_ids for o in single.generate(prompts, GREEDY)]
    tp = make_engine(model_dir, 2, speculative_method="ngram", num_speculative_tokens=4)
    engines.append(tp)
    assert [o.token_ids for o in tp.generate(prompts, GREEDY)] == want
    assert tp.stats.spec_accepted_tokens > 0 and tp.stats.swa_freed_tokens > 0
    tp.check()


def test_tp2_with_mtp_drafts_equals_tp1(
    tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    """MiMo-V2-Flash's MTP depths under TP: every rank runs each draft forward (sharded heads
    and MLP, replicated eh_proj); the drafts after every step and the tokens equal one rank's
    (and the tokens plain decoding's)."""
    model_dir = tiny_model_factory(
        "mimo-v2-flash", sliding_window_size=W, hidden_size=32, seed=5, **MODELS["mimo-v2-flash"]
    )
    prompts = workload(1)
    plain = make_engine(model_dir, 1)
    engines.append(plain)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]

    single = make_engine(model_dir, 1, speculative_method="mtp", num_speculative_tokens=3)
    engines.append(single)
    tokens_1, drafts_1 = run_recording_drafts(single, prompts, GREEDY)
    tp = make_engine(model_dir, 2, speculative_method="mtp", num_speculative_tokens=3)
    engines.append(tp)
    tokens_2, drafts_2 = run_recording_drafts(tp, prompts, GREEDY)
    assert tokens_1 == tokens_2 == want
    assert drafts_2 == drafts_1 and sum(map(len, drafts_1)) > 20
    tp.check()


def test_tp2_structured_output_and_penalties_equal_tp1(
    tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    """Grammar masks, penalties, bias and logprobs are applied on rank 0 after the forward:
    under TP the group draws what one rank draws (seeded sampling at temperature 1)."""
    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=32, seed=5)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(
            max_new_tokens=40,
            temperature=1.0,
            seed=s,
            logprobs=2,
            presence_penalty=0.5 * (s % 2),
            logit_bias={40: 2.0},
            structured_outputs=StructuredOutputs(json_schema=schema) if s % 3 else None,
        )
        for s in range(6)
    ]
    prompts = workload(2)[:6]
    results = []
    for tp_size in (1, 2):
        engine = make_engine(model_dir, tp_size)
        engines.append(engine)
        results.append(engine.generate(prompts, params))
        engine.check()
    one, two = results
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one, two, strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-3
    for out, p in zip(two, params, strict=True):
        if p.structured_outputs is not None and out.finish_reason == "stop":
            assert set(json.loads(out.text)) == {"a", "b"}


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
    victim = rank_processes(engine)[0]
    victim.kill()
    victim.wait(5)
    message = _step_until_error(engine, 15.0)
    assert "TP rank 1" in message, message
    with pytest.raises(TensorParallelError, match="TP group is down"):
        engine.step()
    engine.shutdown()
    assert all(p.poll() is not None for p in rank_processes(engine))


def test_a_forward_that_raises_on_rank_0_takes_the_group_down_cleanly(
    tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    """At TP = 1 a failed forward fails its batch only; at TP = 2 the other rank waits in a
    collective rank 0 never reaches, so the group is down: the batch is released (check()
    passes), step() raises TensorParallelError now and on every later call."""
    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=32, seed=5)
    engine = make_engine(model_dir, 2, tp_timeout_s=10.0)
    engines.append(engine)
    for prompt in workload(4):
        engine.add_request(prompt, GREEDY)
    engine.step()

    def boom(inp: ModelInput) -> torch.Tensor:
        raise RuntimeError("out of memory (injected)")

    engine.runner.forward = boom  # type: ignore[method-assign]
    with pytest.raises(TensorParallelError, match="out of step: RuntimeError: out of memory"):
        engine.step()
    engine.check()
    with pytest.raises(TensorParallelError, match="TP group is down"):
        engine.step()
    engine.shutdown()
    assert all(p.poll() is not None for p in rank_processes(engine))


def test_a_draft_forward_that_raises_on_rank_0_takes_the_group_down_cleanly(
    tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    """The same for an MTP draft forward at TP = 2 (at TP = 1 it costs only the drafts): the
    step's batch is released and every later step raises."""
    model_dir = tiny_model_factory(
        "mimo-v2-flash", sliding_window_size=W, hidden_size=32, seed=5, **MODELS["mimo-v2-flash"]
    )
    engine = make_engine(model_dir, 2, tp_timeout_s=10.0, speculative_method="mtp")
    engines.append(engine)
    for prompt in workload(4):
        engine.add_request(prompt, GREEDY)
    engine.step()

    def boom(*args: object, **options: object) -> torch.Tensor:
        raise RuntimeError("out of memory (injected)")

    engine.runner.draft_forward = boom  # type: ignore[method-assign]
    with pytest.raises(TensorParallelError, match="out of step: RuntimeError: out of memory"):
        engine.step()
    engine.check()
    assert not engine.scheduler.running
    with pytest.raises(TensorParallelError, match="TP group is down"):
        engine.step()
    engine.shutdown()
    assert all(p.poll() is not None for p in rank_processes(engine))


def test_a_hung_rank_raises_within_the_timeout(
    tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=32, seed=5)
    engine = make_engine(model_dir, 2, tp_timeout_s=3.0)
    engines.append(engine)
    for prompt in workload(3):
        engine.add_request(prompt, GREEDY)
    engine.step()
    victim = rank_processes(engine)[0]
    os.kill(victim.pid, signal.SIGSTOP)  # alive but unresponsive
    try:
        message = _step_until_error(engine, 20.0)
    finally:
        engine.shutdown()  # kills the stopped rank
    assert "timeout" in message.lower() or "timed out" in message.lower(), message
    assert victim.poll() is not None


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


# ---- how the rank processes start and end -----------------------------------------------------
SCRIPT_TIMEOUT_S = 120.0

GENERATE_SCRIPT = """
import json
from swaserve.proto import StructuredOutputs
from swaserve.worker import Engine, EngineConfig, SamplingParams
greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
tokens = {}
for tp_size in (2, 1):
    engine = Engine(EngineConfig(model=MODEL, max_total_tokens=256, tp_size=tp_size))
    tokens[tp_size] = [o.token_ids for o in engine.generate([[5, 6, 7], [9, 1]], greedy)]
    engine.shutdown()
print(json.dumps(tokens))
"""


def _generated(out: subprocess.CompletedProcess[str]) -> dict[str, list[list[int]]]:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_engine_built_in_a_script_fed_on_stdin_generates(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """`python - <<EOF`: no file for a child to import as its `__main__`."""
    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=32, seed=5)
    script = f"MODEL = {str(model_dir)!r}\n" + GENERATE_SCRIPT
    out = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )  # fmt: skip
    tokens = _generated(out)
    assert tokens["2"] == tokens["1"] and all(len(t) == 6 for t in tokens["1"])


def test_an_engine_built_in_a_file_without_a_main_guard_generates(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Module-level code that a re-importing child would run again."""
    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=32, seed=5)
    path = tmp_path / "no_main_guard.py"
    path.write_text(f"MODEL = {str(model_dir)!r}\n" + GENERATE_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S
    )
    tokens = _generated(out)
    assert tokens["2"] == tokens["1"] and all(len(t) == 6 for t in tokens["1"])


# A rank that runs the real rank process after a patch (python -c CODE --rank r --world-size n).
FAIL_AT_START = "raise RuntimeError('injected: the rank cannot start')"
FAIL_AT_LOAD = """
import sys
from swaserve.worker.runner import model_runner
from swaserve.worker.runner.process_ranks import rank_main
def fail(*args, **kwargs):
    raise RuntimeError("injected: no memory for the shard")
model_runner.ModelRunner.__init__ = fail
rank_main(sys.argv[1:])
"""


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (FAIL_AT_START, "RuntimeError: injected: the rank cannot start"),
        (FAIL_AT_LOAD, "RuntimeError: injected: no memory for the shard"),
    ],
    ids=["before-joining", "while-loading"],
)
def test_a_rank_that_fails_at_start_up_fails_the_engine_with_its_own_error(
    code: str, error: str, tiny_model_factory: Callable[..., Path]
) -> None:
    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=32, seed=5)
    ranks = ProcessRanks(2, [sys.executable, "-c", code])
    with pytest.raises(TensorParallelError) as err:
        Engine(EngineConfig(model=str(model_dir), max_total_tokens=256, tp_size=2), tp_ranks=ranks)
    # The rank's own error, not the rendezvous timeout: the engine saw the rank die.
    assert error in str(err.value), str(err.value)
    assert "TP rank 1" in str(err.value)
    assert all(p.poll() is not None for p in ranks.processes)


PROBE = """
import json
import sys
from swaserve.worker.runner import model_runner
from swaserve.worker.runner.process_ranks import rank_main
forward = model_runner.ModelRunner.forward
def probe(self, inp):
    comm = self.tp.device_comm
    received, sent = comm.received_bytes, comm.sent_bytes
    out = forward(self, inp)
    step = [inp.num_tokens, list(out.shape), comm.received_bytes - received, comm.sent_bytes - sent]
    print("probe " + json.dumps(step), flush=True)
    return out
model_runner.ModelRunner.forward = probe
rank_main(sys.argv[1:])
"""


def test_rank_1_gets_no_logits_and_receives_only_the_all_reduces(
    tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    """Per step rank 1 sends its logits' shard and receives nothing of the logits: the bytes it
    receives are exactly the 2 · L + 1 all-reduces of [T, D] float32 (each layer's attention
    and MLP, the embedding); rank 0 receives those and rank 1's [N, V / 2] logits."""
    num_layers, hidden, vocab = 4, 32, 288
    model_dir = tiny_model_factory(
        "gpt-oss", sliding_window_size=W, hidden_size=hidden, seed=5, num_layers=num_layers
    )
    probe = ProcessRanks(2, [sys.executable, "-c", PROBE])
    engine = Engine(
        EngineConfig(model=str(model_dir), max_total_tokens=480, tp_size=2, tp_timeout_s=20.0),
        tp_ranks=probe,
    )
    engines.append(engine)
    assert engine.model_config.vocab_size == vocab
    comm = engine.runner.tp.device_comm
    assert comm is not None
    steps: list[tuple[int, int, int]] = []  # (tokens, rows sampled, bytes rank 0 received)
    forward = engine.runner.forward

    def recording(inp: ModelInput) -> torch.Tensor:
        received = comm.received_bytes
        out = forward(inp)
        steps.append((inp.num_tokens, out.shape[0], comm.received_bytes - received))
        return out

    engine.runner.forward = recording  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    engine.generate([[1, 2, 3, 4, 5], [7, 8]], greedy)
    engine.shutdown()  # the rank's output is read to its end

    all_reduce_bytes = (2 * num_layers + 1) * hidden * 4  # per token
    tail = probe._outputs[0].tail
    rank1 = [json.loads(line.split(" ", 1)[1]) for line in tail if line.startswith("probe ")]
    # Before the steps: the two forwards of the prefill the engine times at start (every
    # rank runs them; rank 0's ran before `recording` was installed).
    start_up, rank1 = rank1[: -len(steps)], rank1[-len(steps) :]
    assert [tokens for tokens, *_ in start_up] == [CALIBRATION_TOKENS] * 2
    assert len(steps) >= 5
    for (tokens, rows, received_0), (tokens_1, shape, received_1, sent_1) in zip(
        steps, rank1, strict=True
    ):
        assert tokens_1 == tokens
        assert shape == [0, vocab]  # no row: nothing to sample on rank 1
        assert received_1 == tokens * all_reduce_bytes
        assert sent_1 == tokens * all_reduce_bytes + rows * (vocab // 2) * 4
        assert received_0 == tokens * all_reduce_bytes + rows * (vocab // 2) * 4


def test_an_idle_group_outlives_the_tp_timeout(
    tiny_model_factory: Callable[..., Path], engines: list[Engine]
) -> None:
    """Between steps ranks wait for rank 0 without a timeout: an engine may idle."""
    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=32, seed=5)
    engine = make_engine(model_dir, 2, tp_timeout_s=1.0)
    engines.append(engine)
    greedy = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    first = engine.generate([[3, 4, 5]], greedy)[0].token_ids
    time.sleep(3.0)  # three timeouts with no step: what is tested is that nothing happens
    assert engine.launcher is not None and engine.launcher.ranks.dead() == []
    assert engine.generate([[3, 4, 5]], greedy)[0].token_ids == first


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


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _ranks_of(pid: int) -> list[int]:
    """The TP rank processes among `pid`'s children: `python ... -m swaserve.worker.runner.process_ranks`."""
    return [kid for kid in _children(pid) if f"-m {RANK_MODULE} " in _cmdline(kid)]


# The program takes Ctrl-C as a terminal's foreground program does: started by a test run that
# is itself a background job of a non-interactive shell, it would inherit SIGINT ignored.
STEPPING_SCRIPT = """
import signal
import sys
from swaserve.proto import StructuredOutputs
from swaserve.worker import Engine, EngineConfig, SamplingParams
signal.signal(signal.SIGINT, signal.default_int_handler)
engine = Engine(EngineConfig(model=sys.argv[1], max_total_tokens=4096, tp_size=2))
engine.add_request([1, 2], SamplingParams(max_new_tokens=3000, ignore_eos=True))
while not engine.step():
    pass
print("generating", flush=True)
while engine.has_unfinished_requests():
    engine.step()
"""


def _start_stepping(model_dir: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """A program whose TP = 2 engine is generating (its first token is out); its rank pids."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STEPPING_SCRIPT, str(model_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(SCRIPT_TIMEOUT_S)
    assert line == ["generating\n"], f"the engine did not start generating: {line}"
    ranks = _ranks_of(proc.pid)
    assert len(ranks) == 1, "one TP rank process"
    return proc, ranks


def _wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_however_the_program_ends_no_rank_is_left_behind(
    how: str, tiny_model_factory: Callable[..., Path]
) -> None:
    """Ctrl-C (SIGINT to the program: Python unwinds) or SIGKILL (nothing runs in it: the rank
    sees its stdin end)."""
    model_dir = tiny_model_factory("gpt-oss", sliding_window_size=W, hidden_size=32, seed=5)
    proc, ranks = _start_stepping(model_dir)
    try:
        proc.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _wait_gone(ranks, 10.0), f"TP rank {ranks} outlived its program"
