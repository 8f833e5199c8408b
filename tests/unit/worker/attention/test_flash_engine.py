"""The flash backend in the engine, on CPU with the kernel faked (`fake_flash_attn`: the real
signature, computing from the paged cache): a runner on the flash backend, fed the `ModelInput`s
an engine on the torch backend ran, gives the same logits (float32, 1e-5) at every step —
prefill chunks, decodes and mixed steps, P = 1 (gathered) and P = 16 (paged), both models,
with SWA layers whose windows slide and whose out-of-window KV is freed as they go."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fake_flash_attn import FakeFlashAttn

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.attention import FlashAttentionBackend
from swaserve.worker.attention.flash_backend import decode_block_table
from swaserve.worker.attention.static_decode import decode_metadata
from swaserve.worker.runner import model_runner as model_runner_module
from swaserve.worker.runner.model_input import ModelInput

W = 8
PREFIX = [(5 * i + 2) % 200 + 1 for i in range(40)]


def engine(model_dir: Path, page_size: int, **options: object) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir),
            max_total_tokens=2048,
            swa_full_tokens_ratio=0.5,
            chunked_prefill_size=32,
            page_size=page_size,
            swa_eviction_interval=8,
            **options,  # type: ignore[arg-type]
        )
    )


def flash_engine(
    model_dir: Path, page_size: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[Engine, FakeFlashAttn]:
    """An engine whose runner got the flash backend over the fake kernel."""
    fake = FakeFlashAttn()
    backend = functools.partial(FlashAttentionBackend, kernel=fake.v2_6)
    with monkeypatch.context() as patch:
        patch.setattr(model_runner_module, "select_backend", lambda *a, **k: backend)
        built = engine(model_dir, page_size)
    assert isinstance(built.runner.backend, FlashAttentionBackend)
    return built, fake


def record_steps(eng: Engine) -> list[tuple[ModelInput, torch.Tensor]]:
    """Greedy requests arriving over time (a shared prefix, so later ones hit the prefix cache),
    decoding well past the window; returns every step's input and logits."""
    seen: list[tuple[ModelInput, torch.Tensor]] = []
    forward = eng.runner.forward

    def recording(inp: ModelInput) -> torch.Tensor:
        logits = forward(inp)
        seen.append((inp, logits.clone()))
        return logits

    eng.runner.forward = recording  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    arrivals = {0: [PREFIX + [7] * 30], 3: [[*PREFIX, 9, 9]], 6: [[3, 1, 4, 1, 5]], 9: [PREFIX]}
    step = 0
    while step < 10 or eng.has_unfinished_requests():
        for prompt in arrivals.get(step, []):
            eng.add_request(prompt, greedy)
        eng.step()
        step += 1
    eng.check()
    return seen


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["gpt-oss", "mimo-v2-flash"])
def test_flash_logits_equal_the_torch_backend(
    tiny_model_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    page_size: int,
) -> None:
    model_dir = tiny_model_factory(arch, num_layers=6, sliding_window_size=W, seed=5)
    steps = record_steps(engine(model_dir, page_size))
    twin, fake = flash_engine(model_dir, page_size, monkeypatch)
    assert twin.runner.backend.paged == (page_size == 16)
    kinds = set()
    for inp, want in steps:
        extend = (inp.seq_lens - inp.prefix_lens).tolist()
        kinds.add("decode" if max(extend) == 1 else "prefill" if min(extend) > 1 else "mixed")
        got = twin.runner.forward(inp)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert kinds == {"prefill", "decode", "mixed"}
    assert max(int(inp.seq_lens.max()) for inp, _ in steps) > 4 * W  # windows slid
    assert any(inp.writes.num_writes for inp, _ in steps)  # a prefix-cache hit re-addressed
    assert {c.paged for c in fake.calls} == {page_size == 16}
    assert {c.window for c in fake.calls} == {(-1, -1), (W, 0)}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama4", "gemma4"])
def test_flash_logits_equal_the_torch_backend_on_chunks_and_wide_heads(
    tiny_model_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    page_size: int,
) -> None:
    """Llama 4's chunked layers read from their chunk's start, a block boundary: the kernel gets
    the window C - 1 and the blocks of the chunk. Gemma 4's global layers have heads of 320
    (> 256, what the kernel takes: its 512 published): they run the torch path over the same
    pools, and the kernel sees only the local layers."""
    if arch == "llama4":
        options: dict = dict(num_layers=4, sliding_window_size=16)  # C = 16
        window = (15, 0)
    else:
        wide = {"head_dim": 320, "num_key_value_heads": 1}
        options = dict(num_layers=6, sliding_window_size=W, per_layer_config={"2": wide, "5": wide})
        window = (W, 0)
    model_dir = tiny_model_factory(arch, seed=5, **options)
    steps = record_steps(engine(model_dir, page_size))
    twin, fake = flash_engine(model_dir, page_size, monkeypatch)
    tolerance = 1e-4 if arch == "gemma4" else 1e-5  # its softmax scale 1 amplifies rounding
    for inp, want in steps:
        got = twin.runner.forward(inp)
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    twin.check()
    windows = {c.window for c in fake.calls}
    assert windows == ({window} if arch == "gemma4" else {(-1, -1), window})
    assert max(c.head_dim for c in fake.calls) <= 256


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["gpt-oss", "llama4"])
def test_flash_logits_equal_the_torch_backend_on_verify_steps(
    tiny_model_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    page_size: int,
) -> None:
    """Steps that verify n-gram drafts (a decode and its drafts as decode rows of one
    slot-table row, beside other decodes and prefill chunks) give the torch backend's logits on
    the flash kernel, windowed and chunked."""
    model_dir = tiny_model_factory(arch, num_layers=4, sliding_window_size=16, seed=5)
    steps = record_steps(engine(model_dir, page_size, speculative_method="ngram"))
    twin, _ = flash_engine(model_dir, page_size, monkeypatch)
    verifies = 0
    for inp, want in steps:
        verifies += inp.req_rows.unique().numel() < inp.batch_size
        torch.testing.assert_close(twin.runner.forward(inp), want, rtol=1e-5, atol=1e-5)
    assert verifies > 3


class ReplayedGraph:
    """A CPU stand-in for a CUDA graph (capture runs `fn`, replay runs it again into the
    captured output; new inputs reach it only through the buffers `fn` closed over)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


@pytest.mark.parametrize("api", ["v2_6", "newer"])
@pytest.mark.parametrize("arch", ["gpt-oss", "mimo-v2-flash", "llama4"])
def test_a_captured_decode_step_reads_the_pool_through_block_tables(
    tiny_model_factory: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    api: str,
) -> None:
    """At P = 16 the fixed-shape decode step calls the paged kernel, with block tables built on
    the device from its padded reads (`decode_block_table`), and gives the torch backend's
    greedy tokens while windows slide past the lead-in keys and SWA KV is freed (Llama 4,
    C = 16: the tables start at each row's chunk, whose predecessors are freed)."""
    window = 16 if arch == "llama4" else W  # a chunk must be a multiple of the page
    model_dir = tiny_model_factory(arch, num_layers=6, sliding_window_size=window, seed=5)
    greedy = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    prompts = [PREFIX + [7] * 30, [*PREFIX, 9, 9], [3, 1, 4, 1, 5], PREFIX[:21]]
    want = [o.token_ids for o in engine(model_dir, 16).generate(prompts, greedy)]
    fake = FakeFlashAttn()
    backend = functools.partial(FlashAttentionBackend, kernel=getattr(fake, api))
    with monkeypatch.context() as patch:
        patch.setattr(model_runner_module, "select_backend", lambda *a, **k: backend)
        twin = engine(model_dir, 16)
    step = twin.runner.decode_step = twin.runner.make_decode_step("graphs", ReplayedGraph)
    assert [o.token_ids for o in twin.generate(prompts, greedy)] == want
    twin.check()
    assert step.stats.steps == greedy.max_new_tokens - 1  # every decode, as one graph
    assert twin.stats.swa_freed_tokens > 0
    decode_calls = [c for c in fake.calls if c.paged and c.seqused_k == (api == "newer")]
    assert {c.window for c in decode_calls} == {(-1, -1), (W if arch != "llama4" else 15, 0)}
    assert not any(not c.paged for c in fake.calls)
    assert len(fake.calls) >= 6 * step.stats.steps  # each decode step: one call per layer


@pytest.mark.parametrize("arch", ["gpt-oss", "llama4"])
def test_verify_steps_run_as_captured_decode_steps(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """With n-gram drafts, a step that only decodes and verifies is one new token per row (a
    request's drafts are rows of its own slot-table row), so the captured decode step runs it
    too: on the paged kernel, P = 16, the greedy tokens are plain decoding's."""
    window = 16 if arch == "llama4" else W
    model_dir = tiny_model_factory(arch, num_layers=6, sliding_window_size=window, seed=5)
    greedy = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    prompts = [[3, 4, 5, 6] * 8, [*PREFIX, 9, 9], [7, 7, 8] * 9, PREFIX[:21]]
    want = [o.token_ids for o in engine(model_dir, 16).generate(prompts, greedy)]
    fake = FakeFlashAttn()
    backend = functools.partial(FlashAttentionBackend, kernel=fake.v2_6)
    with monkeypatch.context() as patch:
        patch.setattr(model_runner_module, "select_backend", lambda *a, **k: backend)
        twin = engine(model_dir, 16, speculative_method="ngram", num_speculative_tokens=4)
    step = twin.runner.decode_step = twin.runner.make_decode_step("graphs", ReplayedGraph)
    assert [o.token_ids for o in twin.generate(prompts, greedy)] == want
    twin.check()
    assert twin.stats.spec_accepted_tokens > 0
    assert step.stats.steps == twin.stats.decode_steps  # every decode-only step, verifies too
    assert max(step.stats.buckets) > len(prompts)  # a batch of more rows than requests


@pytest.mark.parametrize("page_size", [1, 16])
def test_mtp_drafts_on_the_flash_kernel_and_captured_steps_equal_the_torch_backend(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, page_size: int
) -> None:
    """MiMo-V2-Flash's MTP depths read their caches through the kernel (P = 16: paged, a chain
    step's KV at the request's page tail or at its scratch page, where the block table finds
    it), and the captured decode step keeps the hidden states the drafts read: the drafts
    after every step and the tokens equal the torch backend's eager engine."""
    model_dir = tiny_model_factory("mimo-v2-flash", num_layers=6, sliding_window_size=W, seed=5)
    greedy = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    prompts = [[3, 4, 5, 6] * 8, [*PREFIX, 9, 9], [7, 7, 8] * 9, PREFIX[:21]]

    def drafted(eng: Engine) -> tuple[list[list[int]], list[dict[int, list[int]]]]:
        ids = [eng.add_request(p, greedy) for p in prompts]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        steps = []
        while eng.has_unfinished_requests():
            for out in eng.step():
                tokens[out.request_id] += out.new_token_ids
            eng.check()
            steps.append({ids.index(r.request_id): r.mtp_drafts for r in eng.scheduler.running})
        return [tokens[rid] for rid in ids], steps

    options = dict(speculative_method="mtp", num_speculative_tokens=3)
    want_tokens, want_drafts = drafted(engine(model_dir, page_size, **options))
    fake = FakeFlashAttn()
    backend = functools.partial(FlashAttentionBackend, kernel=fake.v2_6)
    with monkeypatch.context() as patch:
        patch.setattr(model_runner_module, "select_backend", lambda *a, **k: backend)
        twin = engine(model_dir, page_size, **options)
    step = twin.runner.decode_step = twin.runner.make_decode_step("graphs", ReplayedGraph)
    tokens, drafts = drafted(twin)
    assert tokens == want_tokens and drafts == want_drafts
    assert sum(len(d) for s in drafts for d in s.values() if d) > 40
    assert step.stats.steps > 0 and {c.paged for c in fake.calls} == {page_size == 16}


def test_decode_block_tables_start_at_the_window_page() -> None:
    """Row 0 at position 40 with W = 8 reads from position 32 (its block) on SWA layers, from
    0 on full ones; row 1 (position 3) from 0 on both; block ids are pool rows // 16 - 1."""
    table = torch.arange(2 * 64).view(2, 64) + 16  # [rows, positions] → pool row, from block 1
    positions = torch.tensor([40, 3])
    meta = decode_metadata(
        full_table=table,
        swa_table=table,
        rows=torch.tensor([0, 1]),
        positions=positions,
        out_full_loc=torch.tensor([56, 83]),
        out_swa_loc=torch.tensor([56, 83]),
        full_cols=torch.arange(64),
        sliding_window_size=W,
    )
    assert meta.swa is not None
    swa = decode_block_table(meta.swa, positions, W)
    assert swa.seqused_k.tolist() == [9, 4]  # 40 - 32 + 1, 3 + 1
    assert swa.max_seqlen_k == 32  # cdiv(W + 16, 16) = 2 blocks
    assert swa.block_table.tolist() == [[(16 + 32) // 16 - 1, (16 + 40) // 16 - 1], [4, 4]]
    full = decode_block_table(meta.full, positions, None)
    assert full.seqused_k.tolist() == [41, 4] and full.max_seqlen_k == 64
    assert full.block_table.tolist()[0] == [0, 1, 2, 2]  # positions 0, 16, 32, then the last
    assert full.cu_seqlens_k.tolist() == [0, 41, 45]
    with pytest.raises(ValueError, match="multiple of 16"):
        decode_block_table(meta.swa, positions, None)


def test_chunked_decode_block_tables_start_at_the_chunk() -> None:
    """C = 32: row 0 at position 40 reads [32, 40], row 1 at 70 reads [64, 70]: one block each
    from the chunk's start, never a key of the chunk before."""
    table = torch.arange(2 * 96).view(2, 96) + 16  # [rows, positions] → pool row, from block 1
    positions = torch.tensor([40, 70])
    meta = decode_metadata(
        full_table=table,
        swa_table=table,
        rows=torch.tensor([0, 1]),
        positions=positions,
        out_full_loc=torch.tensor([56, 182]),
        out_swa_loc=torch.tensor([56, 182]),
        full_cols=torch.arange(96),
        sliding_window_size=31,
        attention_chunk_size=32,
    )
    assert meta.swa is not None and meta.attention_chunk_size == 32
    swa = decode_block_table(meta.swa, positions, 31, meta.attention_chunk_size)
    assert swa.seqused_k.tolist() == [9, 7]  # 40 - 32 + 1, 70 - 64 + 1
    first = swa.block_table[:, 0].tolist()
    assert first == [(16 + 32) // 16 - 1, (16 + 96 + 64) // 16 - 1]
