"""Speculative decoding with MTP drafts (MiMo-V2-Flash's `model.mtp.layers.*`): the output is
the target's token for token; the drafts are what the MTP depths compute, checked at every step
against a dense reference written from the checkpoint's tensors and transformers' hidden states
(every depth's cache complete over what was committed: prefill chunks, decodes, verified runs;
chain steps at RoPE position m + s reading their depth's cache up to m); the pools stay whole."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_speculative import assert_pools_whole, greedy, run

from swaserve.worker import Engine, EngineConfig, SamplingParams
from swaserve.worker.engine.request import Request
from swaserve.worker.models.config import SLIDING_ATTENTION
from swaserve.worker.models.mtp import checkpoint_mtp_layers
from swaserve.worker.models.rotary import apply_rotary

W = 8
K = 3


def prompts(seed: int, count: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(shared)]
    return [
        system + [rng.randrange(1, 250) for _ in range(rng.randint(3, 40))] for _ in range(count)
    ]


def run_recording_drafts(
    engine: Engine, batch: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], list[dict[int, list[int]]]]:
    """`test_speculative.run`, and after every step the MTP drafts of each running request (by prompt index)."""
    ids = [engine.add_request(p, params) for p in batch]
    index = {rid: i for i, rid in enumerate(ids)}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        engine.check()
        steps.append(
            {
                index[r.request_id]: r.mtp_drafts
                for r in engine.scheduler.running
                if r.mtp_drafts is not None
            }
        )
    return [tokens[rid] for rid in ids], steps


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("mimo-v2-flash", num_layers=4, sliding_window_size=W, seed=3)


def mtp_engine(model: Path, **options: object) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model),
            speculative_method="mtp",
            num_speculative_tokens=K,
            **options,  # type: ignore[arg-type]
        )
    )


def test_tiny_maker_writes_mtp_layers(model: Path) -> None:
    assert checkpoint_mtp_layers(model) == 3
    # transformers loads the directory as published models load: the MTP tensors are ignored
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    assert not any("mtp" in name for name, _ in hf.named_parameters())


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_equals_plain_decoding(model: Path, page_size: int) -> None:
    """16 requests at once, some sharing a prefix (hits), on pools small enough to retract."""
    batch = prompts(0, 8) + prompts(1, 8, shared=24)
    plain = Engine(EngineConfig(model=str(model), max_total_tokens=4096, page_size=page_size))
    try:
        want = run(plain, batch, greedy(30))
    finally:
        plain.shutdown()
    engine = mtp_engine(model, max_total_tokens=320, page_size=page_size, max_running_requests=16)
    try:
        assert run(engine, batch, greedy(30)) == want
        head = engine.headroom()
        assert head.spec_verifies_total > 0 and head.spec_draft_tokens_total > 0
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


def test_sampled_with_a_seed_equals_plain_decoding(model: Path) -> None:
    batch = prompts(2, 6)
    params = SamplingParams(temperature=0.9, top_k=50, seed=11, max_new_tokens=24, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(model), max_total_tokens=4096))
    try:
        want = run(plain, batch, params)
    finally:
        plain.shutdown()
    engine = mtp_engine(model, max_total_tokens=4096)
    try:
        assert run(engine, batch, params) == want
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


class Reference:
    """The MTP depths computed densely from the checkpoint's tensors (not the engine's
    modules) over transformers' final hidden states: what each draft must be."""

    def __init__(self, model: Path, engine: Engine) -> None:
        self.w = load_file(str(model / "model.safetensors"))
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = engine.model_config
        self.config = config
        self.depths = config.num_mtp_layers
        self.rotary = engine.runner.model.rotary[SLIDING_ATTENTION]
        kind = config.swa_attention
        self.h, self.hkv = config.num_heads, kind.num_kv_heads
        self.dk, self.dv = kind.head_dim, kind.v_head_dim

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.w[name] * x

    def _inputs(
        self, j: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, q, k, v) of depth j for rows (next token, hidden state, RoPE position)."""
        p = f"model.mtp.layers.{j}."
        e = self.w["model.embed_tokens.weight"][tokens]
        cat = torch.cat(
            [self.norm(e, p + "enorm.weight"), self.norm(hidden, p + "hnorm.weight")], -1
        )
        x = cat @ self.w[p + "eh_proj.weight"].T
        a = self.norm(x, p + "input_layernorm.weight")
        t = x.shape[0]
        q = (a @ self.w[p + "self_attn.q_proj.weight"].T).view(t, self.h, self.dk)
        k = (a @ self.w[p + "self_attn.k_proj.weight"].T).view(t, self.hkv, self.dk)
        v = (a @ self.w[p + "self_attn.v_proj.weight"].T).view(t, self.hkv, self.dv)
        v = v * self.config.attention_value_scale
        cos, sin = self.rotary.cos_sin(positions, torch.float32)
        return x, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _finish(
        self, j: int, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Logits of one query row x [D] / q [H, Dk] over keys [n, Hkv, Dk] / values."""
        p = f"model.mtp.layers.{j}."
        group = self.h // self.hkv
        kk = keys.repeat_interleave(group, dim=1)  # [n, H, Dk]
        vv = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q, kk) * self.dk**-0.5  # [H, n]
        sinks = self.w[p + "self_attn.sinks"][:, None]
        probs = torch.softmax(torch.cat([scores, sinks], dim=1), dim=1)[:, :-1]
        out = torch.einsum("hn,nhd->hd", probs, vv).reshape(-1)
        x = x + out @ self.w[p + "self_attn.o_proj.weight"].T
        m = self.norm(x, p + "pre_mlp_layernorm.weight")
        gate = m @ self.w[p + "mlp.gate_proj.weight"].T
        up = m @ self.w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ self.w[p + "mlp.down_proj.weight"].T
        return self.norm(x, p + "final_layernorm.weight") @ self.w["lm_head.weight"].T

    @torch.no_grad()
    def logits(self, seq: list[int], depth: int, token: int, position: int) -> torch.Tensor:
        """Depth `depth`'s logits for a row that follows `seq` (its anchor m = len - 2, whose
        hidden state it reads) with `token` at RoPE `position`: m itself is the refresh's
        row (the cache up to m, window W); a chain step reads the depth's cache at table
        positions [m + 1 - W, m] and itself."""
        ids = torch.tensor(seq)
        hidden = self.hf.model(ids[None]).last_hidden_state[0]  # [N, D] normed
        m = len(seq) - 2
        _, _, k_cache, v_cache = self._inputs(depth, ids[1:], hidden[:-1], torch.arange(m + 1))
        x, q, k, v = self._inputs(
            depth, torch.tensor([token]), hidden[m : m + 1], torch.tensor([position])
        )
        if position == m:
            keys, values = k_cache[max(0, m - W) : m + 1], v_cache[max(0, m - W) : m + 1]
        else:
            lo = max(0, m + 1 - W)
            keys, values = torch.cat([k_cache[lo : m + 1], k]), torch.cat([v_cache[lo : m + 1], v])
        return self._finish(depth, x[0], q[0], keys, values)


class DraftSpy:
    """Records every draft forward that computes logits (its input, depth, logits)."""

    def __init__(self, engine: Engine) -> None:
        self.calls: list[tuple[object, int, torch.Tensor]] = []
        executor = engine.executor
        original = executor.draft_forward

        def spy(inp, hidden_rows, depth, **options):  # type: ignore[no-untyped-def]
            logits = original(inp, hidden_rows, depth, **options)
            if logits is not None:
                self.calls.append((inp, depth, logits.clone()))
            return logits

        executor.draft_forward = spy  # type: ignore[method-assign]

    def check(self, reference: Reference, engine: Engine) -> int:
        """The step's draft s of every request that still runs (the refresh's logits: s = 0,
        then each chain step) against the reference for its tokens and drafts: depth
        min(s, L - 1), token seq[-1] then draft s, RoPE position m + s (1e-4)."""
        by_row = {req.row: req for req in engine.scheduler.running if req.mtp_drafts is not None}
        checked = 0
        for s, (inp, depth, logits) in enumerate(self.calls):
            assert depth == min(s, reference.depths - 1)
            rows = inp.req_rows  # type: ignore[attr-defined]
            lengths = (inp.seq_lens - inp.prefix_lens).tolist()  # type: ignore[attr-defined]
            ends = torch.tensor(lengths).cumsum(0) - 1
            for i, r in enumerate(inp.logits_indices.tolist()):  # type: ignore[attr-defined]
                req = by_row.get(int(rows[int((ends < r).sum())]))  # the entry of token row r
                if req is None or req.mtp_anchor != req.seq_len:
                    continue
                seq, drafts = req.token_ids, req.mtp_drafts
                assert drafts is not None
                token = seq[-1] if s == 0 else drafts[s - 1]
                assert int(inp.input_ids[r]) == token  # type: ignore[attr-defined]
                want = reference.logits(seq, depth, token, len(seq) - 2 + s)
                torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=1e-4)
                assert s >= len(drafts) or drafts[s] == int(logits[i].argmax())
                checked += 1
        self.calls.clear()
        return checked


@pytest.mark.parametrize(("page_size", "oracle"), [(1, False), (4, False), (4, True)])
def test_drafts_are_the_mtp_depths(model: Path, page_size: int, oracle: bool) -> None:
    """At every step, the logits behind every request's drafts against `Reference`. Prefill in chunks of 16
    (the refresh spans chunks); with `oracle`, the verified drafts are the target's own tokens
    (all accepted: the refresh covers 1 + k committed rows per decode)."""
    batch = prompts(5, 4)
    batch[0] = batch[0] + batch[0][:20]  # a longer prompt: several chunks
    plain = Engine(EngineConfig(model=str(model), max_total_tokens=4096))
    try:
        want = {
            tuple(p): out.token_ids
            for p, out in zip(batch, plain.generate(batch, greedy(12)), strict=True)
        }
    finally:
        plain.shutdown()
    engine = mtp_engine(
        model,
        max_total_tokens=4096,
        page_size=page_size,
        chunked_prefill_size=16,
        max_prefill_tokens=16,
        enable_prefix_cache=False,
    )
    try:
        reference = Reference(model, engine)
        drafter = engine.scheduler.drafter
        assert drafter is not None
        if oracle:

            def propose(req: Request, k: int) -> list[int]:
                return want[tuple(req.prompt_ids)][len(req.output_ids) :][:k]

            drafter.propose = propose  # type: ignore[method-assign]
        spy = DraftSpy(engine)
        ids = [engine.add_request(p, greedy(12)) for p in batch]
        got: dict[str, list[int]] = {rid: [] for rid in ids}
        checked = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
            engine.check()
            checked += spy.check(reference, engine)
        assert [got[rid] for rid in ids] == [want[tuple(p)] for p in batch]
        assert checked >= 8
        if oracle:
            head = engine.headroom()
            assert head.spec_accepted_tokens_total > head.spec_verifies_total
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


def test_mtp_is_refused_without_its_layers(tiny_model_factory: Callable[..., Path]) -> None:
    gpt = tiny_model_factory("gpt-oss", num_layers=2, sliding_window_size=W)
    with pytest.raises(ValueError, match="multi-token-prediction layers"):
        mtp_engine(gpt, max_total_tokens=256)
    bare = tiny_model_factory("mimo-v2-flash", num_layers=2, sliding_window_size=W, mtp_layers=0)
    with pytest.raises(ValueError, match="multi-token-prediction layers"):
        mtp_engine(bare, max_total_tokens=256)


def test_a_failed_draft_forward_costs_only_the_drafts(model: Path) -> None:
    """At TP = 1 a draft forward that raises (every seventh call here) leaves the step's tokens
    as they are: the next step decodes without drafts, and the output is plain decoding's."""
    batch = prompts(6, 4)
    plain = Engine(EngineConfig(model=str(model), max_total_tokens=4096))
    try:
        want = run(plain, batch, greedy(20))
    finally:
        plain.shutdown()
    engine = mtp_engine(model, max_total_tokens=4096)
    original = engine.executor.draft_forward
    calls = [0]

    def flaky(*args, **options):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] % 7 == 0:
            raise RuntimeError("injected")
        return original(*args, **options)

    engine.executor.draft_forward = flaky  # type: ignore[method-assign]
    try:
        assert run(engine, batch, greedy(20)) == want
        assert engine.stats.failed_steps == 0 and engine.stats.spec_verifies > 0
        assert_pools_whole(engine)
    finally:
        engine.shutdown()


def test_generate_cli_with_mtp_drafts(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`swaserve generate --speculative-method mtp`: the flag reaches the engine, the text is
    plain decoding's."""
    from swaserve.cluster.cli import main

    argv = ["generate", "--model", str(model), "--prompt", "a model with MTP layers"]
    argv += ["--max-new-tokens", "24", "--max-total-tokens", "512", "--json"]
    assert main(argv) == 0
    plain = capsys.readouterr().out.strip().splitlines()[-1]
    assert main([*argv, "--speculative-method", "mtp", "--num-speculative-tokens", "2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == plain
