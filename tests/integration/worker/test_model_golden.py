"""Golden tests through the real KV path: GPT-OSS and MiMo-V2-Flash loaded by our loader, run on the
paged two-pool KV memory (`build_kv_memory`) with the `TorchAttentionBackend`, against
transformers (float32, eager) and against themselves run differently.

    (b) greedy decode of 3·W tokens, one token per step, SWA freed as it slides out (P = 1, 4)
        == HF `generate`'s greedy tokens;
    (c) one batch mixing fresh prefills, prefill chunks after a prefix and decodes of different
        lengths == each request run alone (same chunks), within 1e-5;
    (d) prefill resumed after a cached prefix (own earlier chunk, or another request's prefix)
        == a full prefill, within 1e-5 (and the full prefill == HF within 1e-4);
    (e) the SWA read path reads only the window: after freeing out-of-window SWA slots and filling
        every SWA row no live token maps to (and every unused full row) with NaN, the logits stay
        finite and equal to a clean run's.

Configs cover W = 1 and larger windows, several layer patterns, MHA / GQA / MQA and MiMo's SWA KV
heads = 2 × full.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from swaserve.worker.attention.base import ForwardBatch
from swaserve.worker.attention.torch_backend import TorchAttentionBackend
from swaserve.worker.kv import (
    NO_LAST_LOC,
    KVMemoryConfig,
    SWAFreeState,
    SWAKVPool,
    SWATokenAllocator,
    build_kv_memory,
    free_swa_out_of_window_slots,
    swa_free_boundary,
)
from swaserve.worker.models.config import load_model_config
from swaserve.worker.models.loader import load_model

transformers = pytest.importorskip("transformers")

F, S = "full_attention", "sliding_attention"
HF_TOLERANCE = 1e-4  # ours vs transformers, float32
SELF_TOLERANCE = 1e-5  # ours vs ours, computed in another batch / chunking

CONFIGS: dict[str, dict[str, Any]] = {
    # W = 1; GQA 2; HF's alternating pattern (SWA first).
    "gpt-oss-w1-gqa2": dict(arch="gpt-oss", num_layers=2, sliding_window_size=1, num_kv_heads=2),
    # W = 4; MQA; full layers at both ends.
    "gpt-oss-w4-mqa-fssf": dict(
        arch="gpt-oss",
        num_layers=4,
        sliding_window_size=4,
        num_kv_heads=1,
        layer_types=[F, S, S, F],
    ),
    # W = 6; MHA; two SWA layers, then a full one.
    "gpt-oss-w6-mha-ssf": dict(
        arch="gpt-oss",
        num_layers=3,
        sliding_window_size=6,
        num_kv_heads=4,
        layer_types=[S, S, F],
    ),
    # W = 1; full KV heads 1, SWA 2; MiMo's pattern (full first); dense layer 0 then MoE.
    "mimo-w1-kv1x2": dict(
        arch="mimo-v2-flash", num_layers=2, sliding_window_size=1, num_kv_heads=1
    ),
    # W = 4; full KV heads 2, SWA 4 (MHA on SWA layers); grouped top-k.
    "mimo-w4-kv2x4-sfss": dict(
        arch="mimo-v2-flash",
        num_layers=4,
        sliding_window_size=4,
        num_kv_heads=2,
        layer_types=[S, F, S, S],
        num_experts=8,
        n_group=4,
        topk_group=2,
    ),
    # W = 7; 8 heads, full KV heads 1 (MQA), SWA 2; SWA first and last.
    "mimo-w7-kv1x2-sfs": dict(
        arch="mimo-v2-flash",
        num_layers=3,
        sliding_window_size=7,
        num_heads=8,
        num_kv_heads=1,
        hidden_size=64,
        layer_types=[S, F, S],
    ),
    # Heavier: W = 16 over 4 / 6 layers of hidden 64.
    "gpt-oss-w16-gqa4": dict(
        arch="gpt-oss",
        num_layers=4,
        sliding_window_size=16,
        num_heads=8,
        num_kv_heads=2,
        hidden_size=64,
    ),
    # MiMo's own pattern over 6 layers: full, 4 × SWA, full.
    "mimo-w16-kv2x4-fssssf": dict(
        arch="mimo-v2-flash",
        num_layers=6,
        sliding_window_size=16,
        num_kv_heads=2,
        hidden_size=64,
    ),
    # Gemma 3: W = 4, GQA 2, local and global alternating (per-kind RoPE: linear on global).
    "gemma3-w4-gqa2-sfsf": dict(
        arch="gemma3", num_layers=4, sliding_window_size=4, num_kv_heads=2, layer_types=[S, F, S, F]
    ),
    # Gemma 3's own 5:1 pattern, W = 3, MQA, head_dim 16 over hidden 32 (Dk != D / H).
    "gemma3-w3-mqa-5to1": dict(
        arch="gemma3", num_layers=6, sliding_window_size=3, num_kv_heads=1, head_dim=16
    ),
    # Cohere2: 3 sliding (interleaved RoPE) : 1 global (NoPE), W = 4, GQA 2, parallel blocks.
    "cohere2-w4-gqa2-sssf": dict(
        arch="cohere2", num_layers=4, sliding_window_size=4, num_kv_heads=2
    ),
    # Global first and last, W = 2, MHA.
    "cohere2-w2-mha-fssf": dict(
        arch="cohere2",
        num_layers=4,
        sliding_window_size=2,
        num_kv_heads=4,
        layer_types=[F, S, S, F],
    ),
    # OLMo 3: post-norm blocks, q/k norms over the whole projection, YaRN on global layers.
    "olmo3-w4-gqa2-sssf": dict(arch="olmo3", num_layers=4, sliding_window_size=4, num_kv_heads=2),
    "olmo3-w3-mqa-sfsf": dict(
        arch="olmo3", num_layers=4, sliding_window_size=3, num_kv_heads=1, layer_types=[S, F, S, F]
    ),
    # EXAONE 4: LLLG, NoPE global layers, per-head q/k norms, post-norm blocks, Llama 3 RoPE.
    "exaone4-w4-gqa2-lllg": dict(
        arch="exaone4", num_layers=4, sliding_window_size=4, num_kv_heads=2
    ),
}
SLOW = {"gpt-oss-w16-gqa4", "mimo-w16-kv2x4-fssssf"}
NAMES = [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in sorted(CONFIGS)
]
PAGE_SIZES = [1, 4]


def random_tokens(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=gen).tolist()


@dataclass
class Sequence:
    """One request on the paged KV: its tokens, the full slots of its cached positions."""

    token_ids: list[int]
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    cached: int = 0  # positions [0, cached) have KV in the pools
    swa: SWAFreeState = field(default_factory=SWAFreeState)


class PagedLM:
    """Our model on a real two-pool KV memory, with requests driven step by step the way the
    scheduler does it: prefill chunks take slots through `alloc_extend`, one-token steps through
    `alloc_decode`, and out-of-window SWA slots are given back through
    `free_swa_out_of_window_slots`."""

    def __init__(self, model_dir: Path, *, page_size: int, max_total_tokens: int = 256) -> None:
        config = load_model_config(model_dir)
        assert config.sliding_window_size is not None
        self.window = config.sliding_window_size
        self.page_size = page_size
        self.memory = build_kv_memory(
            config.kv_spec(),
            KVMemoryConfig(
                max_total_tokens=max_total_tokens,
                swa_full_tokens_ratio=0.5,
                page_size=page_size,
            ),
        )
        assert isinstance(self.memory.allocator, SWATokenAllocator)
        assert isinstance(self.memory.kv_pool, SWAKVPool)
        self.allocator: SWATokenAllocator = self.memory.allocator
        self.kv_pool: SWAKVPool = self.memory.kv_pool
        self.model = load_model(model_dir, TorchAttentionBackend(self.memory.kv_pool, self.window))
        self.seqs: dict[str, Sequence] = {}

    def add(
        self, rid: str, token_ids: list[int], *, share_prefix_of: str = "", prefix_len: int = 0
    ) -> None:
        """A new request; with `share_prefix_of`, its first `prefix_len` positions (page-aligned)
        reuse that request's cached KV, as a prefix-cache hit does (the tree owns them)."""
        seq = Sequence(list(token_ids))
        if share_prefix_of:
            owner = self.seqs[share_prefix_of]
            assert prefix_len % self.page_size == 0 and prefix_len <= owner.cached
            assert owner.token_ids[:prefix_len] == token_ids[:prefix_len]
            seq.slots = owner.slots[:prefix_len].clone()
            seq.cached = prefix_len
            seq.swa = SWAFreeState(prefix_len, prefix_len)
        self.seqs[rid] = seq

    def step(
        self, extends: dict[str, int], logits_positions: str = "all"
    ) -> dict[str, torch.Tensor]:
        """Run one forward over `extends` (request → new tokens), in that order; returns each
        request's logits ([new tokens, vocab] for "all", [1, vocab] for "last")."""
        rids = list(extends)
        new_slots: dict[str, torch.Tensor] = {}
        for is_decode in (False, True):
            group = [r for r in rids if (extends[r] == 1) == is_decode]
            if not group:
                continue
            seqs = [self.seqs[r] for r in group]
            prefix = torch.tensor([s.cached for s in seqs])  # [b] int64
            seq_lens = prefix + torch.tensor([extends[r] for r in group])  # [b] int64
            last = torch.tensor([int(s.slots[-1]) if s.cached else NO_LAST_LOC for s in seqs])
            if is_decode:
                out = self.allocator.alloc_decode(seq_lens, last)
            else:
                out = self.allocator.alloc_extend(prefix, seq_lens, last)
            assert out is not None, "test pool too small"
            ends = torch.cumsum(seq_lens - prefix, 0).tolist()
            for r, a, b in zip(group, [0, *ends[:-1]], ends, strict=True):
                new_slots[r] = out[a:b]
        seqs = [self.seqs[r] for r in rids]
        for r, s in zip(rids, seqs, strict=True):
            s.slots = torch.cat((s.slots, new_slots[r]))
        prefix_lens = torch.tensor([s.cached for s in seqs])  # [B] int64
        seq_lens = prefix_lens + torch.tensor([extends[r] for r in rids])  # [B] int64
        batch = ForwardBatch.from_slots(
            input_ids=torch.tensor(
                [
                    t
                    for s, r in zip(seqs, rids, strict=True)
                    for t in s.token_ids[s.cached : s.cached + extends[r]]
                ]
            ),  # [T] int64
            positions=torch.cat(
                [
                    torch.arange(s.cached, s.cached + extends[r])
                    for s, r in zip(seqs, rids, strict=True)
                ]
            ),  # [T] int64
            prefix_lens=prefix_lens,
            seq_lens=seq_lens,
            req_token_slots=[s.slots for s in seqs],
            out_full_loc=torch.cat([new_slots[r] for r in rids]),  # [T] int64
            allocator=self.memory.allocator if self.memory.two_pools else None,  # type: ignore[arg-type]
            logits_positions=logits_positions,
        )
        logits = self.model(batch)  # [N, vocab]
        rows = [extends[r] if logits_positions == "all" else 1 for r in rids]
        for s, r in zip(seqs, rids, strict=True):
            s.cached += extends[r]
        return dict(zip(rids, torch.split(logits, rows), strict=True))

    def free_out_of_window(self, *, radix_cache: bool = False) -> int:
        """Give back every request's SWA slots that slid out of its window (no interval)."""
        return sum(
            free_swa_out_of_window_slots(
                self.allocator,
                s.swa,
                s.slots,
                s.cached,
                sliding_window_size=self.window,
                radix_cache=radix_cache,
            )
            for s in self.seqs.values()
        )

    def swa_held_tokens(self, rid: str) -> int:
        """SWA slots the request's own positions still map to."""
        return int((self.allocator.translate(self.seqs[rid].slots) > 0).sum())

    def poison_unused_rows(self) -> int:
        """NaN into every pool row no live position maps to: in the SWA pool the rows of freed
        (out-of-window) and never-used SWA slots, in the full pool unused slots; padding pages
        included. Returns the number of poisoned SWA rows."""
        held = torch.cat([s.slots for s in self.seqs.values()])
        swa_held = self.allocator.translate(held)
        swa_held = swa_held[swa_held > 0]
        poisoned_swa = 0
        for pool, rows in ((self.kv_pool.full_pool, held), (self.kv_pool.swa_pool, swa_held)):
            unused = torch.ones(pool.size + pool.page_size, dtype=torch.bool)  # [rows] bool
            unused[rows] = False
            for buf in (*pool.k_buffer, *pool.v_buffer):
                buf[unused] = float("nan")
            if pool is self.kv_pool.swa_pool:
                poisoned_swa = int(unused.sum())
        return poisoned_swa

    def check(self) -> None:
        self.allocator.check(torch.unique(torch.cat([s.slots for s in self.seqs.values()])))


@pytest.fixture(scope="module", params=NAMES)
def tiny(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]):
    """(name, model dir, W, HF model) for each config."""
    options = dict(CONFIGS[request.param])
    model_dir = tiny_model_factory(options.pop("arch"), seed=11, **options)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return request.param, model_dir, CONFIGS[request.param]["sliding_window_size"], hf


def hf_greedy(hf: Any, prompt: list[int], num_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=num_new_tokens,
            min_new_tokens=num_new_tokens,
            do_sample=False,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(hf: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0]  # [n, vocab]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


# ---- (b) greedy decode through the paged two-pool KV ------------------------------------------


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_greedy_decode_of_3w_tokens_equals_transformers_generate(tiny, page_size: int) -> None:
    """One token per step, the SWA pool holding only the window's pages after each step; the
    tokens are HF's, and so is every step's logits row (random tiny models often fall into
    repeating one token, which alone would hide small errors)."""
    name, model_dir, window, hf = tiny
    prompt = random_tokens(window + 3, seed=1)
    num_new = 3 * window
    want = hf_greedy(hf, prompt, num_new)

    lm = PagedLM(model_dir, page_size=page_size)
    lm.add("r", prompt)
    rows = [lm.step({"r": len(prompt)}, logits_positions="last")["r"]]  # [1, vocab] each
    got: list[int] = []
    freed = 0
    while True:
        got.append(int(rows[-1][0].argmax()))
        freed += lm.free_out_of_window()
        n = lm.seqs["r"].cached
        # SWA KV is kept from position floor_P(n - W) on, in whole pages.
        boundary = swa_free_boundary(
            n, sliding_window_size=window, page_size=page_size, radix_cache=False
        )
        held_pages = -(-n // page_size) - boundary // page_size
        assert lm.swa_held_tokens("r") == n - boundary, name
        assert lm.allocator.swa_size - lm.allocator.swa_available_size() == held_pages * page_size
        lm.check()
        if len(got) == num_new:
            break
        lm.seqs["r"].token_ids.append(got[-1])
        rows.append(lm.step({"r": 1})["r"])
    assert got == want, name
    theirs = hf_logits(hf, prompt + got[:-1])[len(prompt) - 1 :]  # [num_new, vocab]
    assert max_diff(torch.cat(rows), theirs) < HF_TOLERANCE, name
    total = len(prompt) + num_new - 1  # positions with KV: the last token is never fed
    assert freed == swa_free_boundary(
        total, sliding_window_size=window, page_size=page_size, radix_cache=False
    )


# ---- (c) a mixed batch gives each request the logits it gets alone ----------------------------

PROMPTS = {
    name: random_tokens(n, seed)
    for name, n, seed in [
        ("a", 13, 2),
        ("b", 5, 3),
        ("c", 9, 4),
        ("d", 17, 5),
        ("e", 3, 6),
        ("f", 1, 7),
    ]
}
# Steps of the mixed run: request → new tokens. Before the mixed step: a and b prefill together, then
# decode (a to a longer decode length than b); d prefills its first chunk of 7.
HISTORY: list[dict[str, int]] = [
    {"a": 13, "b": 5},
    {"a": 1, "b": 1},
    {"a": 1, "d": 7},
    {"a": 1, "b": 1},
    {"a": 1},
]
# The mixed step: decodes at lengths 17 and 7, a fresh prefill of 9, a chunk of 10 after d's
# 7-token prefix, a fresh 3-token prefill and a fresh 1-token prefill, interleaved.
MIXED = {"b": 1, "c": 9, "a": 1, "d": 10, "e": 3, "f": 1}
# A step after it: everything decodes at a different length.
AFTER = {"f": 1, "e": 1, "d": 1, "c": 1, "b": 1, "a": 1}


def extend_tokens(lm: PagedLM, rid: str, steps: list[dict[str, int]]) -> None:
    """Give a request the tokens its decode steps feed: greedy-free, fixed continuation."""
    need = sum(step.get(rid, 0) for step in steps)
    seq = lm.seqs[rid]
    seq.token_ids += random_tokens(max(0, need - len(seq.token_ids)), seed=100 + ord(rid))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mixed_batch_gives_each_request_its_logits_alone(tiny, page_size: int) -> None:
    name, model_dir, _, hf = tiny
    steps = [*HISTORY, MIXED, AFTER]

    mixed = PagedLM(model_dir, page_size=page_size)
    for rid, prompt in PROMPTS.items():
        mixed.add(rid, prompt)
        extend_tokens(mixed, rid, steps)
    got: dict[str, list[torch.Tensor]] = {rid: [] for rid in PROMPTS}
    for step in steps:
        for rid, logits in mixed.step(step).items():
            got[rid].append(logits)
        mixed.free_out_of_window()
        mixed.check()

    for rid in PROMPTS:
        alone = PagedLM(model_dir, page_size=page_size)
        alone.add(rid, mixed.seqs[rid].token_ids)
        want = []
        for step in steps:
            if rid in step:
                want.append(alone.step({rid: step[rid]})[rid])
                alone.free_out_of_window()
        assert max_diff(torch.cat(got[rid]), torch.cat(want)) < SELF_TOLERANCE, (name, rid)
        alone.check()
    # And each request's logits are transformers' for its tokens.
    for rid, seq in mixed.seqs.items():
        theirs = hf_logits(hf, seq.token_ids[: seq.cached])
        assert max_diff(torch.cat(got[rid]), theirs) < HF_TOLERANCE, (name, rid)


# ---- (d) prefill resumed after a cached prefix equals a full prefill --------------------------


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_prefill_resumed_after_cached_prefix_equals_full_prefill(tiny, page_size: int) -> None:
    name, model_dir, window, hf = tiny
    tokens = random_tokens(3 * window + 11, seed=8)
    n = len(tokens)
    full = PagedLM(model_dir, page_size=page_size)
    full.add("full", tokens)
    want = full.step({"full": n})["full"]  # [n, vocab]
    assert max_diff(want, hf_logits(hf, tokens)) < HF_TOLERANCE, name

    # Chunked: the same request resumes after its own earlier chunks (prefix < W, = W, > W, not
    # page-aligned), its out-of-window SWA freed between chunks as chunked prefill does.
    cuts = sorted({1, window, window + 3, 2 * window + 5, n - 1} - {0})
    chunked = PagedLM(model_dir, page_size=page_size)
    chunked.add("r", tokens)
    parts = []
    for a, b in zip([0, *cuts], [*cuts, n], strict=True):
        parts.append(chunked.step({"r": b - a})["r"])
        chunked.free_out_of_window()
    assert max_diff(torch.cat(parts), want) < SELF_TOLERANCE, (name, cuts)
    chunked.check()

    # Prefix-cache hit: a finished request's prompt (page-aligned, its SWA freed by the radix
    # rule up to floor_P(k - max(W, P))) serves as the cached prefix of a new request.
    hit = (n - 4) // page_size * page_size
    shared = PagedLM(model_dir, page_size=page_size)
    shared.add("owner", tokens[:hit])
    shared.step({"owner": hit}, logits_positions="last")
    shared.free_out_of_window(radix_cache=True)
    assert shared.seqs["owner"].swa.swa_evicted_seqlen > 0, name
    shared.add("hit", tokens, share_prefix_of="owner", prefix_len=hit)
    resumed = shared.step({"hit": n - hit})["hit"]
    assert max_diff(resumed, want[hit:]) < SELF_TOLERANCE, (name, hit)
    shared.check()


# ---- (e) the SWA read path touches only the window ---------------------------------------------


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_nan_in_freed_and_unused_swa_rows_does_not_reach_the_logits(tiny, page_size: int) -> None:
    name, model_dir, window, _ = tiny
    prompts = {"long": random_tokens(2 * window + 9, seed=10), "short": random_tokens(4, seed=11)}
    decode_steps = 2 * window + 3
    runs = []
    for poison in (False, True):
        lm = PagedLM(model_dir, page_size=page_size)
        for rid, prompt in prompts.items():
            lm.add(rid, prompt + random_tokens(decode_steps + 8, seed=12 + len(prompt)))
        lm.step({rid: len(p) for rid, p in prompts.items()})
        for _ in range(decode_steps):
            lm.step({"long": 1, "short": 1})
        lm.free_out_of_window()
        assert lm.seqs["long"].swa.swa_evicted_seqlen > 0, name
        if poison:
            # The free list (freed out-of-window slots included), the padding page and the
            # unwritten rest of each request's last page.
            tails = sum(-s.cached % page_size for s in lm.seqs.values())
            want_rows = lm.allocator.swa_available_size() + page_size + tails
            assert lm.poison_unused_rows() == want_rows, name
        # A decode step, then a step mixing a decode and a 5-token chunk after a freed prefix.
        logits = [lm.step({"long": 1, "short": 1}), lm.step({"short": 1, "long": 5})]
        lm.check()
        runs.append(logits)
    clean, poisoned = runs
    for clean_step, poisoned_step in zip(clean, poisoned, strict=True):
        for rid, logits in poisoned_step.items():
            assert bool(torch.isfinite(logits).all()), (name, rid)
            assert torch.equal(logits, clean_step[rid]), (name, rid)
