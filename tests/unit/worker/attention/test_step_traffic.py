"""What one step moves between host and device, and what it does on the host, measured with the
meta device standing in for the accelerator (`device_traffic`): the real model runner, slot
tables, KV pools and attention backends of both models' layer layouts (the model's own layers
are replaced by an attention stack: empty q/k/v of each layer's shape through the backend), the
flash backend over a shape-checking stand-in of the kernel.

- a decode step's host → device bytes and host ops do not grow with the sequence length (2 and
  64 requests at 100 vs 10,000 tokens), paged (P = 16) and gathered (P = 1); paged, no layer
  copies K/V out of the pool (MiMo's K dim > V dim included);
- every host → device copy of a step is non-blocking from a pinned buffer, and nothing is read
  back (a read of a meta tensor raises).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from device_traffic import DEVICE, Traffic, device_traffic
from fake_flash_attn import FakeFlashAttn

from swaserve.worker.attention import FlashAttentionBackend, TorchAttentionBackend
from swaserve.worker.attention.base import AttentionBackend, AttentionLayer, ForwardBatch
from swaserve.worker.kv.memory import KVMemoryConfig, build_kv_pool, plan_kv_memory
from swaserve.worker.kv.slot_table import DeviceSlotTable
from swaserve.worker.models.config import ModelConfig, load_model_config
from swaserve.worker.runner.host_tensors import int_tensor
from swaserve.worker.runner.model_input import ModelInput, SlotWrites, build_model_input
from swaserve.worker.runner.model_runner import ModelRunner
from swaserve.worker.runner.sampler import Sampler, SamplingParams, filtered_probs

W = 16
ARCHS = ["gpt-oss", "mimo-v2-flash"]
MAX_LEN = 10_016
BACKENDS = [("flash", 16), ("flash", 1), ("torch", 1)]  # (backend, page size)


class AttentionStack(torch.nn.Module):
    """The attention of every layer of a model, on empty q/k/v: what the backend sees."""

    def __init__(self, backend: AttentionBackend, layers: list[AttentionLayer]) -> None:
        super().__init__()
        self.backend, self.layers = backend, layers

    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # [N, 8]
        self.backend.init_forward_metadata(batch)
        t = batch.num_tokens
        for x in self.layers:
            q = torch.empty(t, x.num_heads, x.head_dim, dtype=torch.bfloat16, device=DEVICE)
            k = torch.empty(t, x.num_kv_heads, x.head_dim, dtype=torch.bfloat16, device=DEVICE)
            v = torch.empty(t, x.num_kv_heads, x.v_head_dim, dtype=torch.bfloat16, device=DEVICE)
            sinks = torch.empty(x.num_heads, device=DEVICE)  # [H] float32
            self.backend.forward(q, k, v, x, batch, sinks=sinks)
        return torch.empty(batch.logits_indices().numel(), 8, device=DEVICE)


def meta_runner(mc: ModelConfig, backend: str, page_size: int, rows: int) -> ModelRunner:
    """A `ModelRunner` on the meta device (built field by field: no weights to load)."""
    spec = mc.kv_spec()
    plan = plan_kv_memory(
        spec,
        KVMemoryConfig(page_size=page_size, max_total_tokens=1 << 20, swa_full_tokens_ratio=0.5),
        torch.bfloat16,
    )
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = DEVICE
    runner.kv_pool = build_kv_pool(spec, plan, dtype=torch.bfloat16, device=DEVICE)
    runner.slot_table = DeviceSlotTable(rows, MAX_LEN, with_swa=not plan.single_pool, device=DEVICE)
    if backend == "flash":
        kernel = FakeFlashAttn(compute=False).v2_6
        runner.backend = FlashAttentionBackend(
            runner.kv_pool, mc.sliding_window_size, kernel=kernel
        )
        assert runner.backend.paged == (page_size % 16 == 0)
    else:
        runner.backend = TorchAttentionBackend(runner.kv_pool, mc.sliding_window_size)
    layers = [mc.attention_layer(i) for i in range(mc.num_layers)]
    runner.model = AttentionStack(runner.backend, layers)
    return runner


def step_input(prefix_lens: list[int], extend_lens: list[int], window: int) -> ModelInput:
    """A step of requests in slot-table rows 0..B-1 (slot ids are arbitrary: meta holds none)."""
    num_tokens = sum(extend_lens)
    return build_model_input(
        token_ids=[1] * num_tokens,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        req_rows=list(range(len(prefix_lens))),
        samples=[True] * len(prefix_lens),
        out_full_loc=int_tensor(range(16, 16 + num_tokens)),
        writes=SlotWrites.empty(two_pools=True),
        translate=lambda full: full.clone(),
        sliding_window_size=window,
    )


def decode_traffic(runner: ModelRunner, batch: int, seq_len: int) -> Traffic:
    inp = step_input([seq_len - 1] * batch, [1] * batch, W)
    with device_traffic() as traffic:
        runner.forward(inp)
    return traffic


@pytest.fixture(scope="module", params=ARCHS)
def model_config(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]):
    arch = request.param
    return load_model_config(tiny_model_factory(arch, num_layers=6, sliding_window_size=W))


@pytest.mark.parametrize(("backend", "page_size"), BACKENDS)
def test_decode_traffic_and_host_work_do_not_grow_with_sequence_length(
    model_config: ModelConfig, backend: str, page_size: int
) -> None:
    for batch in (2, 64):
        runner = meta_runner(model_config, backend, page_size, rows=64)
        short, long = decode_traffic(runner, batch, 100), decode_traffic(runner, batch, 10_000)
        assert short.unsafe_copies() == long.unsafe_copies() == []
        assert short.host_to_device_bytes == long.host_to_device_bytes
        assert short.host_ops == long.host_ops
        assert short.host_elements == long.host_elements
        # The runner: positions, token rows, full and SWA slots, input ids, logits rows; the
        # metadata: rows, seq lens, SWA starts, query offsets (B + 1), decode ids and rows.
        assert long.host_to_device_bytes == 8 * (6 * batch + 6 * batch + 1)
        if backend == "flash" and page_size == 16:  # the kernel reads the pool in place
            assert short.device_gather_bytes == long.device_gather_bytes == 0
        else:  # P = 1: each layer gathers its keys on the device (grows with the length)
            assert long.device_gather_bytes > 50 * short.device_gather_bytes > 0


@pytest.mark.parametrize(("backend", "page_size"), BACKENDS)
def test_every_copy_of_a_mixed_step_is_pinned_and_non_blocking(
    model_config: ModelConfig, backend: str, page_size: int
) -> None:
    runner = meta_runner(model_config, backend, page_size, rows=4)
    inp = step_input([0, 40, 300, 9_000], [33, 1, 17, 1], W)  # prefill chunks and decodes
    with device_traffic() as traffic:
        runner.forward(inp)
    assert traffic.copies and traffic.unsafe_copies() == []


def test_the_samplers_copies_are_pinned_and_non_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed rows (greedy, temperature, top-k, top-p, min-p): the per-row parameters and row
    indices reach the device through the pinned, non-blocking path."""
    logits = torch.empty(5, 300, device=DEVICE)  # [B, V]
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.9, top_k=20),
        SamplingParams(temperature=1.1, top_p=0.9),
        SamplingParams(temperature=0.8, min_p=0.1),
    ]
    sampler = Sampler(torch.device("cpu"))
    monkeypatch.setattr(  # the draw itself: a generator on the device, nothing to copy
        Sampler, "race", lambda self, probs, gens: torch.empty(probs.shape[0], device=DEVICE)
    )
    with device_traffic() as traffic:
        filtered_probs(logits[1:], params[1:])
        sampler.sample(logits, params, [None] * 5)
    assert traffic.copies and traffic.unsafe_copies() == []


def test_the_checker_sees_blocking_and_implicit_copies() -> None:
    """The checker can fail: a plain `.to`, `torch.tensor(..., device=)` and a device tensor
    indexed by a host index are all reported as copies that would make the host wait."""
    table = torch.empty(4, 8, device=DEVICE)
    with device_traffic() as traffic:
        torch.arange(3).to(DEVICE)
        torch.tensor([1, 2], device=DEVICE)
        table[torch.tensor([0, 1])]
    assert [c.how for c in traffic.unsafe_copies()] == ["_to_copy", "tensor", "implicit:index"]
    with pytest.raises(Exception, match="meta"):
        int(table.sum())  # a read back
