"""The fixed-shape decode step without compiling: buckets, padding, the persistent inputs a
captured graph replays over (a stand-in graph that re-runs its recorded function, as a CUDA
graph replays its recorded kernels), no host read inside the step, the MoE's static path, and
the fused projections."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from swaserve.proto.environment import CPU_AUTO_COMPILE_ENV
from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.models.layers import (
    GATHER_BUDGET_ELEMENTS,
    BatchedExperts,
    FusedLinear,
)
from swaserve.worker.models.static_step import static_shapes
from swaserve.worker.runner import model_runner
from swaserve.worker.runner.decode_step import (
    DecodeStep,
    InductorBackend,
    batch_buckets,
    bucket_of,
    key_width,
)
from swaserve.worker.runner.model_input import padding_decode_input
from swaserve.worker.runner.model_runner import (
    compile_mode,
    compiles_in_background,
    cpu_compile_supported,
)

W = 8
GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)


class ReplayGraph:
    """A CPU stand-in for a CUDA graph: `capture` runs `fn` once (the warm-up) and keeps it and
    its output buffer; `replay` runs `fn` again into that buffer. Like a real graph, it sees new
    inputs only through the buffers `fn` closed over. Host reads raise while it records."""

    captured: ClassVar[list[ReplayGraph]] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with no_host_reads():
            self.out = fn()
        self.fn = fn
        self.replays = 0
        ReplayGraph.captured.append(self)
        return self.out

    def replay(self) -> None:
        self.replays += 1
        self.out.copy_(self.fn())


class HostRead(AssertionError):
    pass


def _refuse(*args: object, **kwargs: object) -> None:
    raise HostRead("a fixed-shape step read a device value on the host")


class no_host_reads:
    """While active, `item`, `tolist`, `bool`/`int`/`float` of a tensor and `.cpu()` /
    `.numpy()` raise: what a CUDA graph capture (or `set_sync_debug_mode("error")`) refuses."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")

    def __enter__(self) -> None:
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(torch.Tensor, n, _refuse)

    def __exit__(self, *exc: object) -> None:
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def replay_step(engine: Engine) -> DecodeStep:
    step = engine.runner.decode_step = engine.runner.make_decode_step("graphs", ReplayGraph)
    return step


def workload(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(40)]
    return [
        (system if i % 2 else []) + [rng.randrange(1, 250) for _ in range(rng.randint(2, 60))]
        for i in range(7)
    ]


def make_engine(model: Path, page_size: int) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model),
            max_total_tokens=640,
            swa_full_tokens_ratio=0.5,
            chunked_prefill_size=32,
            page_size=page_size,
            swa_eviction_interval=8,
            max_running_requests=8,
            compile=False,
        )
    )


@pytest.fixture
def reset_graphs() -> Iterator[None]:
    ReplayGraph.captured = []
    yield
    ReplayGraph.captured = []


def test_buckets_and_widths() -> None:
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(10) == (1, 2, 4, 8, 10)
    assert [bucket_of(n, batch_buckets(64)) for n in (1, 3, 17, 64)] == [1, 4, 24, 64]
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        bucket_of(9, batch_buckets(8))
    assert key_width(1, 4096, graphs=False) == 64
    assert key_width(65, 4096, graphs=False) == 128
    assert key_width(65, 4096, graphs=True) == 256
    assert key_width(300, 4096, graphs=True) == 512
    assert key_width(3000, 2048, graphs=True) == 2048


def test_a_compiled_graph_is_called_directly_only_when_it_is_all_its_function_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU step calls a recorded graph with its recorded arguments only when dynamo ran
    nothing around it: a function with a side effect (state dynamo sets after the graph) is
    not recorded as callable."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    backend = InductorBackend({})
    x = torch.arange(4.0)

    def pure(t: torch.Tensor) -> torch.Tensor:
        return t * 2 + 1

    out = torch.compile(pure, fullgraph=True, backend=backend)(x)
    [call] = backend.calls
    assert call.returned(out)
    x.add_(10)  # the recorded arguments are the caller's tensors: a call sees their new values
    assert torch.equal(call.fn(*call.args)[0], x * 2 + 1)

    backend.calls.clear()
    kept: dict[str, torch.Tensor] = {}

    def keeps(t: torch.Tensor) -> torch.Tensor:
        kept["y"] = t * 3
        return t + 1

    out = torch.compile(keeps, fullgraph=True, backend=backend)(x)
    [call] = backend.calls
    assert torch.equal(out, x + 1) and torch.equal(kept["y"], x * 3)
    assert not call.returned(out)


def test_compile_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    config = EngineConfig(model="m", device="cpu")
    assert compile_mode(config, cpu) is None  # auto with SWASERVE_CPU_AUTO_COMPILE=0: eager
    monkeypatch.delenv(CPU_AUTO_COMPILE_ENV)
    assert compile_mode(config, cpu) == "compile" and compiles_in_background(config, cpu)
    tp2 = EngineConfig(model="m", device="cpu", tp_size=2)
    assert compile_mode(tp2, cpu) is None and not compiles_in_background(tp2, cpu)
    assert compile_mode(config, cuda) == "graphs" and not compiles_in_background(config, cuda)
    on = EngineConfig(model="m", compile=True)
    assert compile_mode(on, cpu) == "compile" and compile_mode(on, cuda) == "graphs"
    assert not compiles_in_background(on, cpu)  # compile=True: compiled before serving
    assert compile_mode(EngineConfig(model="m", compile=False), cuda) is None


def test_the_cpu_step_compiles_only_with_a_torch_whose_inductor_is_known_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11's inductor wrote past a buffer in the MXFP4 MoE step: older torches serve
    eagerly under "auto" and refuse compile=True on CPU; CUDA graphs are not inductor's."""
    assert cpu_compile_supported()  # the torch the tests run
    assert not cpu_compile_supported("2.11.0+cu130") and not cpu_compile_supported("2.4.1")
    assert cpu_compile_supported("2.13.0+cpu") and cpu_compile_supported("2.14.0.dev20270101")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(CPU_AUTO_COMPILE_ENV)
    monkeypatch.setattr(model_runner, "cpu_compile_supported", lambda: False)
    auto = EngineConfig(model="m", device="cpu")
    assert compile_mode(auto, cpu) is None and not compiles_in_background(auto, cpu)
    on = EngineConfig(model="m", compile=True)
    with pytest.raises(ValueError, match=r"compile=True on CPU needs torch >= 2\.13"):
        compile_mode(on, cpu)
    assert compile_mode(on, cuda) == "graphs" and compile_mode(auto, cuda) == "graphs"


@pytest.mark.parametrize("arch", ["gpt-oss", "mimo-v2-flash"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_replayed_graphs_give_the_eager_tokens_with_the_prefix_cache_and_swa_freeing(
    arch: str, page_size: int, tiny_model_factory: Callable[..., Path], reset_graphs: None
) -> None:
    model = tiny_model_factory(arch, num_layers=4, sliding_window_size=W, hidden_size=32, seed=2)
    prompts = workload(3)
    eager = make_engine(model, page_size)
    want = [o.token_ids for o in eager.generate(prompts, GREEDY)]
    engine = make_engine(model, page_size)
    step = replay_step(engine)
    first = [o.token_ids for o in engine.generate(prompts[:3], GREEDY)]
    assert first == want[:3]
    got = [o.token_ids for o in engine.generate(prompts, GREEDY)]  # prefix hits this time
    assert got == want
    engine.check()
    assert engine.stats.cached_tokens > 0 and engine.stats.swa_freed_tokens > 0
    # Every decode step ran as a captured graph: one capture per (bucket, width), then replays.
    assert step.stats.steps >= 2 * (GREEDY.max_new_tokens - 1)  # all but the first tokens
    assert len(ReplayGraph.captured) == step.stats.captures == len(step._graphs)
    assert sum(g.replays for g in ReplayGraph.captured) == step.stats.steps - step.stats.captures
    assert set(step.stats.buckets) <= set(step.buckets) and len(step.stats.buckets) > 1


def test_padded_rows_touch_only_the_padding_slot(
    tiny_model_factory: Callable[..., Path], reset_graphs: None
) -> None:
    model = tiny_model_factory("gpt-oss", num_layers=4, sliding_window_size=W, hidden_size=32)
    engine = make_engine(model, 1)
    step = replay_step(engine)
    for i in range(3):  # three requests: decodes padded to a bucket of 4
        engine.add_request([5 + i, 6, 7, 8, 9], GREEDY)
    engine.step()  # the prefills (eager)
    table = engine.runner.slot_table
    full_before, swa_before = table.full.clone(), table.swa.clone()
    pool = engine.runner.kv_pool
    keys_before = [pool.get_kv_buffer(layer)[0].clone() for layer in range(4)]
    engine.step()  # one decode of 3 requests in bucket 4
    assert step.stats.buckets == {4: 1}
    changed = (table.full != full_before).nonzero().tolist()
    rows = sorted(r.row for r in engine.scheduler.running)
    assert sorted(r for r, _ in changed) == rows  # the real requests' new positions only
    assert all(p == 5 for _, p in changed)
    assert torch.equal(table.swa[0, 0], swa_before[0, 0])
    new_slots = {int(table.full[r, 5]) for r in rows}
    for layer in range(4):
        keys = pool.get_kv_buffer(layer)[0]
        moved = set((keys != keys_before[layer]).any(-1).any(-1).nonzero().flatten().tolist())
        assert moved <= new_slots | {0}  # a padded row writes the padding slot 0 only
    engine.check()


def test_a_padding_only_step_changes_no_slot_table_entry(
    tiny_model_factory: Callable[..., Path], reset_graphs: None
) -> None:
    model = tiny_model_factory("mimo-v2-flash", num_layers=4, sliding_window_size=W, hidden_size=32)
    engine = make_engine(model, 4)
    step = replay_step(engine)
    engine.generate([[1, 2, 3, 4, 5, 6]], GREEDY)
    table = engine.runner.slot_table
    before = (table.full.clone(), table.swa.clone())
    inp = padding_decode_input(3, two_pools=True, sliding_window_size=W, row=step.padding_row)
    assert step.accepts(inp)
    assert engine.runner.forward(inp).shape == (3, engine.runner.model_config.vocab_size)
    assert torch.equal(table.full, before[0]) and torch.equal(table.swa, before[1])


def test_steps_the_graph_does_not_take(
    tiny_model_factory: Callable[..., Path], reset_graphs: None
) -> None:
    model = tiny_model_factory("gpt-oss", num_layers=4, sliding_window_size=W, hidden_size=32)
    engine = make_engine(model, 1)
    step = replay_step(engine)
    row = step.padding_row
    decode = padding_decode_input(2, two_pools=True, sliding_window_size=W, row=row)
    assert step.accepts(decode)
    assert not step.accepts(
        padding_decode_input(2, two_pools=False, sliding_window_size=W, row=row)
    )
    assert not step.accepts(padding_decode_input(9, two_pools=True, sliding_window_size=W, row=row))
    prefill = decode.__class__(
        **{
            **{f: getattr(decode, f) for f in decode.__dataclass_fields__},
            "input_ids": torch.zeros(3, dtype=torch.int64),
            "positions": torch.zeros(3, dtype=torch.int64),
            "out_full_loc": torch.zeros(3, dtype=torch.int64),
            "out_swa_loc": torch.zeros(3, dtype=torch.int64),
        }
    )
    assert not step.accepts(prefill)  # a request with two new tokens


class DenseExperts(BatchedExperts):
    """E linear experts, to compare the MoE paths."""

    def __init__(self, num_experts: int, dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.expert_elements = dim * dim
        self.w = torch.nn.Parameter(torch.randn(num_experts, dim, dim))

    def expert_outputs(self, xs: torch.Tensor, experts: torch.Tensor | None) -> torch.Tensor:
        return torch.bmm(xs, self.expert_weight("w", experts))


@pytest.mark.parametrize("tokens", [1, 2, 7])
def test_the_static_moe_path_equals_the_eager_one_and_reads_nothing_back(tokens: int) -> None:
    torch.manual_seed(0)
    experts = DenseExperts(4, 16)
    x = torch.randn(tokens, 16)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(tokens)])  # [T, 2]
    weights = torch.rand(tokens, 2)
    want = experts(x, index, weights)
    with static_shapes(), no_host_reads():
        got = experts(x, index, weights)
    torch.testing.assert_close(got, want)
    assert tokens * 2 * experts.expert_elements <= GATHER_BUDGET_ELEMENTS


def test_fused_projections_keep_the_outputs_and_the_checkpoint_names(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model_dir = tiny_model_factory(
        "mimo-v2-flash", num_layers=4, sliding_window_size=W, hidden_size=32
    )
    eager = make_engine(model_dir, 1)
    model = eager.runner.model
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, FusedLinear) and not hasattr(attn, "q_proj")
    dense = [m for m in model.modules() if isinstance(m, FusedLinear) and "gate_proj" in m.names]
    assert dense, "MiMo's dense MLP layers fuse gate and up"
    state = model.checkpoint_state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in state
    assert not any(".qkv_proj." in k or k.endswith("mlp.gate_up_proj.weight") for k in state)
    from safetensors.torch import load_file

    stored = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        stored.update(load_file(f))
    for name in ("q_proj", "k_proj", "v_proj"):
        key = f"model.layers.1.self_attn.{name}.weight"
        torch.testing.assert_close(state[key], stored[key].to(state[key].dtype))
