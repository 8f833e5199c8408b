"""The compiled decode step for real (`EngineConfig(compile=True)`: torch.compile on CPU):
greedy tokens equal to transformers and to the eager engine for both architectures, pages of 1
and 4, with the prefix cache and SWA freeing on; TP = 2 compiled equals TP = 1; a second start
in a new process loads the compiled step from the on-disk cache.

Slow: each engine compiles its decode graphs at start (tens of seconds cold on a 2-core
machine). The inductor cache is shared by the module's engines, as by a server's restarts."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from swaserve.proto import StructuredOutputs
from swaserve.proto.environment import CPU_AUTO_COMPILE_ENV
from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.models import prepacked
from swaserve.worker.runner.model_executor import ModelExecutor

W = 8
MAX_NEW = 30
GREEDY = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)

STARTUP_TIMEOUT_S = 600.0  # a bound on a cold compile on a loaded machine, not a wait

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


def workload(seed: int) -> list[list[int]]:
    """10 prompts of 1..120 tokens; every other one shares a 40-token system prefix."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(40)]
    return [
        (system if i % 2 else []) + [rng.randrange(1, 250) for _ in range(rng.randint(1, 80))]
        for i in range(10)
    ]


def reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    out = []
    for prompt in prompts:
        ids = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


def make_engine(model: Path, *, compile_: bool, page_size: int = 1, tp_size: int = 1) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model),
            max_total_tokens=640,
            swa_full_tokens_ratio=0.5,
            chunked_prefill_size=32,
            page_size=page_size,
            swa_eviction_interval=8,
            max_running_requests=6,
            compile=compile_,
            tp_size=tp_size,
            tp_timeout_s=120.0,
        )
    )


def run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """The workload twice: the second pass resumes from the prefix cache."""
    engine.generate(prompts[::3], GREEDY)
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


# More experts than twice those a token chooses: the compiled step runs each token through its
# own experts only (`BatchedExperts.forward_prepacked_sparse`).
MANY_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2}
# Weights stored in bfloat16, as the published checkpoints: the step's panels hold them in
# bfloat16 (`prepacked.panel_dtype`), half the bytes, the same products.
BF16_WEIGHTS = {"weights_dtype": "bfloat16"}
OPTION_IDS = {
    repr({}): "as-made",
    repr(MANY_EXPERTS): "8-experts",
    repr(BF16_WEIGHTS): "bf16-weights",
}


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("gpt-oss", BF16_WEIGHTS),
        ("gpt-oss", MANY_EXPERTS),
        ("mimo-v2-flash", {}),
        ("mimo-v2-flash", MANY_EXPERTS),
        ("gemma3", {}),
        ("gemma4", {}),
        ("cohere2", {}),
        ("olmo3", {}),
        ("exaone4", {}),
        ("llama4", {}),
    ],
    ids=lambda v: v if isinstance(v, str) else OPTION_IDS[repr(v)],
)
def test_compiled_decode_equals_transformers_and_eager(
    arch: str, options: dict[str, int | str], tiny_model_factory: Callable[..., Path]
) -> None:
    layers = 6 if arch == "gemma4" else 4  # Gemma 4's last two share KV
    model = tiny_model_factory(
        arch, num_layers=layers, sliding_window_size=W, hidden_size=32, seed=7, **options
    )
    prompts = workload(1)
    want = reference(model, prompts)
    eager = make_engine(model, compile_=False)
    assert run(eager, prompts) == want
    for page_size in (1, 4):
        engine = make_engine(model, compile_=True, page_size=page_size)
        step = engine.runner.decode_step
        assert step is not None and step.mode == "compile"
        held = [prepacked.held_for(p) for p in engine.runner.model.parameters()]
        panels = {copy.dtype for copy in held if copy is not None}
        assert panels == ({torch.bfloat16} if options is BF16_WEIGHTS else {torch.float32})
        warmed = step.stats.steps  # the start-up's padding-only steps
        assert warmed == len(step.buckets)
        assert run(engine, prompts) == want
        engine.check()
        if page_size == 1:  # the logits' processing and the grammar follow the compiled step
            processed = [
                SamplingParams(
                    max_new_tokens=MAX_NEW,
                    temperature=0,
                    presence_penalty=0.7,
                    repetition_penalty=1.3,
                    logit_bias={40: 1.5},
                    logprobs=1,
                    structured_outputs=StructuredOutputs(regex="[a-z ]{8,40}") if i % 2 else None,
                )
                for i in range(6)
            ]
            outs = engine.generate(prompts[:6], processed)
            assert [o.token_ids for o in outs] == [
                o.token_ids for o in eager.generate(prompts[:6], processed)
            ]
            assert all(re.fullmatch("[a-z ]{8,40}", o.text) for o in outs[1::2])
        assert step.stats.steps - warmed >= MAX_NEW  # decodes went through the compiled step
        assert step.stats.direct >= MAX_NEW  # most called their shape's graph directly
        assert engine.stats.cached_tokens > 0 and engine.stats.swa_freed_tokens > 0
        engine.shutdown()


def test_compiled_decode_keeps_the_hidden_states_mtp_drafts_read(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """MiMo-V2-Flash with MTP drafts, compiled: decode and verify steps run the compiled graph,
    which writes each row's hidden state into a persistent buffer the drafts read (called
    directly, without dynamo), and the MTP depths' forwards run the compiled draft step (one
    graph per depth and bucket): the drafts after every step and the tokens are the eager
    engine's."""
    from test_mtp import run_recording_drafts

    model = tiny_model_factory("mimo-v2-flash", num_layers=4, sliding_window_size=W, seed=7)
    prompts = workload(2)[:6]
    options = dict(
        model=str(model),
        max_total_tokens=640,
        speculative_method="mtp",
        num_speculative_tokens=3,
        max_running_requests=6,
    )
    eager = Engine(EngineConfig(compile=False, **options))  # type: ignore[arg-type]
    want = run_recording_drafts(eager, prompts, GREEDY)
    eager.shutdown()
    engine = Engine(EngineConfig(compile=True, **options))  # type: ignore[arg-type]
    try:
        step, drafts = engine.runner.decode_step, engine.runner.draft_step
        assert step is not None and step.hidden is not None and drafts is not None
        warmed, drafts_warmed = step.stats.steps, drafts.stats.steps
        assert drafts.ready == {(d, b) for d in range(3) for b in drafts.buckets}
        assert run_recording_drafts(engine, prompts, GREEDY) == want
        assert step.stats.steps - warmed >= MAX_NEW // 4
        assert step.stats.direct > 0
        # every step after a decode: three depth forwards, compiled (a prefill's refresh of
        # more rows than the largest bucket runs eagerly)
        assert drafts.stats.steps - drafts_warmed >= 3 * (MAX_NEW // 4)
        assert drafts.stats.direct > 0
    finally:
        engine.shutdown()


class Gated(list):  # type: ignore[type-arg]
    """The background compile's padding steps, handed out once `gate` is set."""

    gate = threading.Event()

    def __iter__(self):  # type: ignore[no-untyped-def]
        self.gate.wait()
        return super().__iter__()


@pytest.mark.parametrize("arch", ["gpt-oss", "mimo-v2-flash"])
def test_auto_serves_eagerly_while_it_compiles_then_runs_the_compiled_step(
    arch: str, tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`compile="auto"` on CPU: the engine serves before any graph exists (the compile is held
    at a gate: every decode runs eagerly), then serves while the thread compiles beside it,
    then runs the compiled step; the tokens are the eager engine's throughout (MiMo with MTP
    drafts: the compiled steps hand the drafts their hidden states), the pools whole."""
    monkeypatch.delenv(CPU_AUTO_COMPILE_ENV)
    padding_steps = ModelExecutor._padding_steps
    monkeypatch.setattr(
        ModelExecutor, "_padding_steps", staticmethod(lambda *a: Gated(padding_steps(*a)))
    )
    Gated.gate.clear()
    model = tiny_model_factory(arch, num_layers=4, sliding_window_size=W, hidden_size=32, seed=3)
    prompts = workload(3)
    spec = {"speculative_method": "mtp"} if arch == "mimo-v2-flash" else {}
    eager = Engine(EngineConfig(model=str(model), max_total_tokens=640, compile=False, **spec))
    want = run(eager, prompts)
    eager.shutdown()
    engine = Engine(EngineConfig(model=str(model), max_total_tokens=640, **spec))
    try:
        step = engine.runner.decode_step
        assert step is not None and step.background and not step.compiled.is_set()
        assert run(engine, prompts) == want  # nothing compiled yet
        assert step.stats.steps == 0 and step.stats.eager >= MAX_NEW and not step.ready
        engine.check()
        Gated.gate.set()  # the thread compiles the buckets while the engine decodes
        engine.flush_cache()
        assert run(engine, prompts) == want
        engine.check()
        assert step.compiled.wait(STARTUP_TIMEOUT_S) and step.compile_error is None
        assert step.ready == set(step.buckets)
        drafts = engine.runner.draft_step  # MTP: its graphs compile after the decode step's
        if drafts is not None:
            assert drafts.compiled.wait(STARTUP_TIMEOUT_S) and drafts.compile_error is None
            assert drafts.ready == {
                (d, b) for d in range(drafts.num_depths) for b in drafts.buckets
            }
            drafted = drafts.stats.direct
        before = step.stats.direct
        engine.flush_cache()
        assert run(engine, prompts) == want
        assert step.stats.direct - before >= MAX_NEW  # decodes ran the compiled graphs
        if drafts is not None:
            assert drafts.stats.direct - drafted >= MAX_NEW  # and the depths theirs
        engine.check()
    finally:
        Gated.gate.set()
        engine.shutdown()


def test_a_shutdown_that_does_not_wait_leaves_the_compile_to_stop_on_its_own(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shutdown(wait_compiles=False)` (a worker actor's, a Serve replica's: their process
    ends next) returns while the background compile is held inside its work; the thread then
    stops before its next graph."""
    monkeypatch.delenv(CPU_AUTO_COMPILE_ENV)
    padding_steps = ModelExecutor._padding_steps
    monkeypatch.setattr(
        ModelExecutor, "_padding_steps", staticmethod(lambda *a: Gated(padding_steps(*a)))
    )
    Gated.gate.clear()
    model = tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=W, hidden_size=32)
    engine = Engine(EngineConfig(model=str(model), max_total_tokens=640))
    step = engine.runner.decode_step
    try:
        assert step is not None and step.background
        engine.shutdown(wait_compiles=False)  # returns with the thread held at the gate
        assert not step.compiled.is_set()
    finally:
        Gated.gate.set()
    assert step.compiled.wait(STARTUP_TIMEOUT_S)
    assert step.ready == set() and step.compile_error is None  # stopped before its first graph


def test_tp2_compiled_equals_tp1(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory(
        "gpt-oss", num_layers=4, num_heads=4, num_kv_heads=2, sliding_window_size=W, seed=5
    )
    prompts = workload(2)
    single = make_engine(model, compile_=False, page_size=4)
    want = run(single, prompts)
    tp = make_engine(model, compile_=True, page_size=4, tp_size=2)
    try:
        assert run(tp, prompts) == want
        step = tp.runner.decode_step
        assert step is not None and step.stats.steps > len(step.buckets) + MAX_NEW
        tp.check()
    finally:
        tp.shutdown()


EXIT_WHILE_COMPILING = """
import sys, threading
from swaserve.worker import Engine, EngineConfig
from swaserve.worker.runner.decode_step import DecodeStep
first_graph = threading.Event()
run = DecodeStep._run
def counted(self, *args, **kwargs):
    out = run(self, *args, **kwargs)
    if threading.current_thread().name == "swaserve-decode-compile":
        first_graph.set()  # the thread goes on to the second graph
    return out
DecodeStep._run = counted
engine = Engine(EngineConfig(model=sys.argv[1], max_total_tokens=640, max_running_requests=4))
step = engine.runner.decode_step
first_graph.wait(600)
print(step.background, step.compiled.is_set())
"""


def test_an_engine_never_shut_down_exits_cleanly_while_it_compiles(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """A script that ends with the default engine's background compile under way (no
    `shutdown`; it ends as the second graph starts compiling) exits with 0: the compile stops
    after that graph at exit. A thread left inside inductor had aborted the process
    ("terminate called without an active exception", exit status 134, in 4 of 5 runs)."""
    model = tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=W, hidden_size=32)
    env = {k: v for k, v in os.environ.items() if k != CPU_AUTO_COMPILE_ENV}
    done = subprocess.run(
        [sys.executable, "-c", EXIT_WHILE_COMPILING, str(model)],
        env=env | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},  # cold: it compiles
        capture_output=True,
        text=True,
    )
    assert done.stdout.split() == ["True", "False"], done.stdout  # it was compiling at the end
    assert "terminate called" not in done.stderr
    assert done.returncode == 0, done.stderr[-2000:]


START_AND_COUNT = """
import json, sys
from torch._dynamo.utils import counters
from swaserve.worker import Engine, EngineConfig
Engine(EngineConfig(model=sys.argv[1], max_total_tokens=640, max_running_requests=2, compile=True))
print(json.dumps({k: dict(v) for k, v in counters.items()}))
"""


def test_a_second_start_loads_the_compiled_step_from_the_cache(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Two starts in new processes over one inductor cache, with different string-hash seeds
    (what two `swaserve serve` runs get): the second compiles nothing."""
    model = tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=W, hidden_size=32)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))

    def start(hash_seed: int) -> dict[str, dict[str, int]]:
        done = subprocess.run(
            [sys.executable, "-c", START_AND_COUNT, str(model)],
            env=env | {"PYTHONHASHSEED": str(hash_seed)},
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold = start(0)
    assert cold["aot_autograd"].get("autograd_cache_saved", 0) > 0
    cached = start(1)  # a set of the two layer kinds iterates the other way under this seed
    assert cached["aot_autograd"].get("autograd_cache_miss", 0) == 0
    assert (
        cached["aot_autograd"]["autograd_cache_hit"] == cold["aot_autograd"]["autograd_cache_saved"]
    )
    assert cached["inductor"].get("fxgraph_cache_miss", 0) == 0
