"""The engine's data path: early prefix reuse, exception-safe steps, `ModelInput` as the whole
interface of the model runner, O(new tokens) host → device traffic, admission accounting."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.kv.slot_table import RequestSlotTable
from swaserve.worker.runner.model_input import ModelInput

W = 8
P = 4
GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(
        "gpt-oss", num_layers=4, sliding_window_size=W, hidden_size=32, seed=3
    )


def make_engine(model_dir: Path, **overrides: object) -> Engine:
    options: dict[str, object] = dict(
        model=str(model_dir),
        max_total_tokens=1024,
        swa_full_tokens_ratio=0.5,
        chunked_prefill_size=32,
        page_size=P,
    )
    options.update(overrides)
    return Engine(EngineConfig(**options))  # type: ignore[arg-type]


def run_to_end(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


PREFIX = [(7 * i + 3) % 200 + 1 for i in range(64)]


def test_a_request_reuses_the_prompt_of_one_still_decoding(model_dir: Path) -> None:
    cold = make_engine(model_dir).generate([[*PREFIX, 9, 9, 9]], GREEDY)[0]

    engine = make_engine(model_dir)
    engine.add_request([*PREFIX, 5, 5], GREEDY, request_id="a")
    for _ in range(4):  # A's prefill (two chunks) ends, then it decodes
        engine.step()
    assert engine.request_status("a") is not None and engine._requests["a"].is_decoding
    engine.add_request([*PREFIX, 9, 9, 9], GREEDY, request_id="b")
    cached = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.cached_tokens
    assert cached["b"] >= 64 - W - P
    assert cached["b"] == 64  # the whole shared prefix: A's prompt entered the tree at prefill end
    assert tokens["b"] == cold.token_ids
    engine.check()


def test_a_failing_forward_ends_its_batch_with_error_and_nothing_leaks(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(model_dir)
    engine.add_request([*PREFIX, 1], GREEDY, request_id="cached")
    run_to_end(engine)  # puts PREFIX in the tree
    engine.add_request([*PREFIX, 2, 3], GREEDY, request_id="a")
    engine.add_request([4, 5, 6, 7, 8], GREEDY, request_id="b")
    engine.step()
    real_forward = engine.runner.forward
    calls = {"n": 0}

    def failing(inp: ModelInput) -> torch.Tensor:
        calls["n"] += 1
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(engine.runner, "forward", failing)
    outs = engine.step()
    assert calls["n"] == 1
    assert {(o.request_id, o.finished, o.finish_reason) for o in outs} == {
        ("a", True, "error"),
        ("b", True, "error"),
    }
    assert all(o.error == "RuntimeError: injected device fault" for o in outs)
    assert not engine.has_unfinished_requests()
    assert engine.stats.failed_steps == 1
    engine.check()  # every slot is free or the tree's; the prefix lock was released
    head = engine.headroom()
    assert head.full_protected_tokens == 0 and head.num_running == 0

    monkeypatch.setattr(engine.runner, "forward", real_forward)
    later = engine.generate([[*PREFIX, 2, 3], [4, 5, 6, 7, 8]], GREEDY)
    fresh = make_engine(model_dir).generate([[*PREFIX, 2, 3], [4, 5, 6, 7, 8]], GREEDY)
    assert [o.token_ids for o in later] == [o.token_ids for o in fresh]
    assert [o.finish_reason for o in later] == ["length", "length"]
    engine.check()


def test_the_runner_needs_nothing_but_a_pickled_model_input(model_dir: Path) -> None:
    """Drive a second runner (same weights, own KV and slot tables) with the pickled inputs of
    the first: the logits are identical at every step."""
    engine = make_engine(model_dir)
    twin = make_engine(model_dir).runner
    seen: list[tuple[ModelInput, torch.Tensor]] = []
    real_forward = engine.runner.forward

    def recording(inp: ModelInput) -> torch.Tensor:
        logits = real_forward(inp)
        seen.append((pickle.loads(pickle.dumps(inp)), logits.clone()))
        return logits

    engine.runner.forward = recording  # type: ignore[method-assign]
    engine.generate([[*PREFIX, 1], [*PREFIX, 2, 2], [3, 4, 5]], GREEDY)
    assert len(seen) > 24 and any(inp.writes.num_writes for inp, _ in seen)
    for inp, logits in seen:
        assert torch.equal(twin.forward(inp), logits)


def test_decode_traffic_does_not_grow_with_sequence_length(model_dir: Path) -> None:
    engine = make_engine(model_dir, chunked_prefill_size=256)
    sizes: dict[int, int] = {}
    real_forward = engine.runner.forward

    def recording(inp: ModelInput) -> torch.Tensor:
        if int((inp.seq_lens - inp.prefix_lens).max()) == 1:  # a pure decode step
            sizes[int(inp.seq_lens.max())] = inp.host_to_device_bytes()
        return real_forward(inp)

    engine.runner.forward = recording  # type: ignore[method-assign]
    engine.generate([[1] * 200, [2] * 10], SamplingParams(temperature=0, max_new_tokens=40))
    small = [b for n, b in sizes.items() if n < 220]
    large = [b for n, b in sizes.items() if n >= 230]
    assert small and large
    # Two decodes: ids, positions, rows, lengths, slots (full + SWA), logits rows — 8 bytes each.
    assert set(small) == set(large) == {2 * 8 * 8}


def test_admission_moves_a_matched_prefix_out_of_the_evictable_budget(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    engine.generate([[*PREFIX, 1]], GREEDY)
    tree = engine.tree
    assert tree is not None
    evictable = tree.full_evictable_size()
    assert evictable >= 64
    swa_evictable = tree.swa_evictable_size()
    # When A's decode left its window, the prompt's last C = ceil_P(W + S) + P = 20 tokens
    # (S = 8: window_checkpoint_slack_tokens) stayed live as a window checkpoint, so a match of
    # the same prefix reaches 64 and its lock takes exactly the checkpoint's SWA KV (the
    # tombstone before it stops the lock).
    first = engine.scheduler.kv.attach_prefix(engine._new_request([*PREFIX, 7], GREEDY))
    assert first is not None and first.num_tokens == 64
    assert first.full_newly_protected == 64 == evictable - tree.full_evictable_size()
    assert first.swa_newly_protected == 20 == swa_evictable - tree.swa_evictable_size()
    # A second match of the same prefix protects nothing new.
    second = engine.scheduler.kv.attach_prefix(engine._new_request([*PREFIX, 8], GREEDY))
    assert second is not None and (second.num_tokens, second.full_newly_protected) == (64, 0)


def test_slot_table_check_fails_on_a_lost_or_doubled_row() -> None:
    table = RequestSlotTable(4, 16)
    rows = [table.acquire(), table.acquire()]
    table.check([r for r in rows if r is not None])
    with pytest.raises(AssertionError, match="neither free nor used"):
        table.check([rows[0]])  # type: ignore[list-item]
    with pytest.raises(AssertionError, match="used twice or both"):
        table.check([rows[0], rows[0], rows[1]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not in use"):
        table.release(3)
