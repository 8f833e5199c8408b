"""Test harness for the attention backends: a tiny stack of attention layers over a real KV memory,
requests with fixed random q/k/v per position, and a naive dense reference.

`Scenario.step({rid: num_new_tokens})` allocates slots the way the scheduler does (alloc_extend
for prefill chunks, alloc_decode for one-token requests), runs every layer through the backend and
returns each request's output per layer; `Scenario.expected(...)` gives the reference for the same
tokens, computed on contiguous per-request K/V in float64.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swaserve.worker.attention.base import AttentionBackend, AttentionLayer, ForwardBatch
from swaserve.worker.kv import (
    NO_LAST_LOC,
    KVLayout,
    KVMemory,
    KVMemoryConfig,
    KVModelSpec,
    SWAFreeState,
    SWATokenAllocator,
    build_kv_memory,
    free_swa_out_of_window_slots,
)


@dataclass(frozen=True)
class Shape:
    num_heads: int = 4
    full_kv_heads: int = 2
    swa_kv_heads: int = 2
    head_dim: int = 8
    v_head_dim: int = 8


def make_layers(shape: Shape, window: int | None, kinds: str = "FS") -> list[AttentionLayer]:
    """One layer per letter: F = full, S = SWA with window W."""
    layers = []
    for i, kind in enumerate(kinds):
        swa = kind == "S"
        layers.append(
            AttentionLayer(
                layer_id=i,
                num_heads=shape.num_heads,
                num_kv_heads=shape.swa_kv_heads if swa else shape.full_kv_heads,
                head_dim=shape.head_dim,
                v_head_dim=shape.v_head_dim,
                scaling=shape.head_dim**-0.5,
                sliding_window_size=window if swa else None,
            )
        )
    return layers


def make_memory(
    layers: list[AttentionLayer],
    window: int | None,
    *,
    page_size: int,
    single_pool: bool,
    full_tokens: int = 256,
    dtype: torch.dtype = torch.float32,
) -> KVMemory:
    full = [x for x in layers if not x.is_swa]
    swa = [x for x in layers if x.is_swa]

    def layout(group: list[AttentionLayer], fallback: AttentionLayer) -> KVLayout:
        x = group[0] if group else fallback
        return KVLayout(x.num_kv_heads, x.head_dim, x.v_head_dim)

    spec = KVModelSpec(
        full_layer_ids=[x.layer_id for x in full],
        swa_layer_ids=[x.layer_id for x in swa],
        full_layout=layout(full, layers[0]),
        swa_layout=layout(swa, layers[0]),
        sliding_window_size=window or 0,
    )
    config = KVMemoryConfig(
        page_size=page_size,
        max_total_tokens=full_tokens,
        swa_full_tokens_ratio=0.5,
        disable_hybrid_swa_memory=single_pool,
    )
    return build_kv_memory(spec, config, dtype=dtype)


@dataclass
class Request:
    q: dict[int, torch.Tensor]  # layer → [N, H, Dk] float64
    k: dict[int, torch.Tensor]  # layer → [N, Hkv, Dk] float64
    v: dict[int, torch.Tensor]  # layer → [N, Hkv, Dv] float64
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    cached: int = 0  # positions with KV in the pool
    swa_state: SWAFreeState = field(default_factory=SWAFreeState)


class Scenario:
    def __init__(
        self,
        backend: AttentionBackend,
        memory: KVMemory,
        layers: list[AttentionLayer],
        *,
        sinks: bool,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        self.backend = backend
        self.memory = memory
        self.layers = layers
        self.dtype = dtype
        self.gen = torch.Generator().manual_seed(seed)
        self.sinks = {
            x.layer_id: torch.randn(x.num_heads, generator=self.gen) for x in layers if sinks
        }  # layer → [H] float32, as the models pass them
        self.requests: dict[int, Request] = {}

    def add_request(self, rid: int, max_len: int) -> None:
        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=self.gen, dtype=torch.float64)

        self.requests[rid] = Request(
            q={x.layer_id: rand(max_len, x.num_heads, x.head_dim) for x in self.layers},
            k={x.layer_id: rand(max_len, x.num_kv_heads, x.head_dim) for x in self.layers},
            v={x.layer_id: rand(max_len, x.num_kv_heads, x.v_head_dim) for x in self.layers},
        )

    def batch(self, extends: dict[int, int]) -> ForwardBatch:
        """Allocate the new tokens' slots (prefill chunks first via alloc_extend, then decodes
        via alloc_decode) and build the batch, requests in `extends` order."""
        alloc = self.memory.allocator
        rids = list(extends)
        new_slots: dict[int, torch.Tensor] = {}
        groups = (
            [r for r in rids if extends[r] > 1],
            [r for r in rids if extends[r] == 1],
        )
        for is_decode, group in enumerate(groups):
            if not group:
                continue
            reqs = [self.requests[r] for r in group]
            prefix = torch.tensor([r.cached for r in reqs])
            seq = torch.tensor([r.cached + extends[g] for r, g in zip(reqs, group, strict=True)])
            last = torch.tensor([int(r.slots[-1]) if r.cached else NO_LAST_LOC for r in reqs])
            out = (
                alloc.alloc_decode(seq, last)
                if is_decode
                else alloc.alloc_extend(prefix, seq, last)
            )
            assert out is not None, "test pool too small"
            offsets = torch.cumsum(seq - prefix, 0).tolist()
            for g, a, b in zip(group, [0, *offsets[:-1]], offsets, strict=True):
                new_slots[g] = out[a:b]
        for r in rids:
            req = self.requests[r]
            req.slots = torch.cat((req.slots, new_slots[r]))
        prefix_lens = torch.tensor([self.requests[r].cached for r in rids])
        seq_lens = prefix_lens + torch.tensor([extends[r] for r in rids])
        positions = torch.cat(
            [torch.arange(int(p), int(s)) for p, s in zip(prefix_lens, seq_lens, strict=True)]
        )
        return ForwardBatch.from_slots(
            input_ids=torch.zeros_like(positions),
            positions=positions,
            prefix_lens=prefix_lens,
            seq_lens=seq_lens,
            req_token_slots=[self.requests[r].slots for r in rids],
            out_full_loc=torch.cat([new_slots[r] for r in rids]),
            allocator=self.memory.allocator if self.memory.two_pools else None,  # type: ignore[arg-type]
        )

    def run(self, batch: ForwardBatch, rids: list[int]) -> dict[int, dict[int, torch.Tensor]]:
        """Run every layer; returns rid → layer → [E, H, Dv] and marks the tokens cached."""
        self.backend.init_forward_metadata(batch)
        bounds = torch.cumsum(batch.extend_lens, 0).tolist()
        starts = [0, *bounds[:-1]]
        outs: dict[int, dict[int, torch.Tensor]] = {r: {} for r in rids}
        for layer in self.layers:
            lid = layer.layer_id
            parts = [
                (self.requests[r], int(p), int(s))
                for r, p, s in zip(rids, batch.prefix_lens, batch.seq_lens, strict=True)
            ]
            q = torch.cat([req.q[lid][p:s] for req, p, s in parts]).to(self.dtype)
            k = torch.cat([req.k[lid][p:s] for req, p, s in parts]).to(self.dtype)
            v = torch.cat([req.v[lid][p:s] for req, p, s in parts]).to(self.dtype)
            sinks = self.sinks.get(lid)
            out = self.backend.forward(q, k, v, layer, batch, sinks=sinks)
            for r, a, b in zip(rids, starts, bounds, strict=True):
                outs[r][lid] = out[a:b]
        for r, s in zip(rids, batch.seq_lens.tolist(), strict=True):
            self.requests[r].cached = s
        return outs

    def step(self, extends: dict[int, int]) -> dict[int, dict[int, torch.Tensor]]:
        return self.run(self.batch(extends), list(extends))

    def expected(self, rid: int, layer: AttentionLayer, prefix: int, seq: int) -> torch.Tensor:
        req = self.requests[rid]
        lid = layer.layer_id
        return dense_reference(
            req.q[lid][prefix:seq],
            req.k[lid][:seq],
            req.v[lid][:seq],
            prefix,
            layer.sliding_window_size,
            layer.scaling,
            self.sinks.get(lid),
        )

    def free_out_of_window(self, window: int) -> int:
        """Free every request's out-of-window SWA slots (chunk-cache rule); returns the count."""
        alloc = self.memory.allocator
        assert isinstance(alloc, SWATokenAllocator)
        return sum(
            free_swa_out_of_window_slots(
                alloc, r.swa_state, r.slots, r.cached, sliding_window_size=window, radix_cache=False
            )
            for r in self.requests.values()
        )

    def poison_unused_rows(self) -> None:
        """Fill with NaN every pool row no request holds (for the SWA pool: rows no live full slot
        maps to, so freed SWA slots too), padding rows included."""
        alloc = self.memory.allocator
        pool = self.memory.kv_pool
        held = torch.cat([r.slots for r in self.requests.values()])
        if isinstance(alloc, SWATokenAllocator):
            swa_held = alloc.translate(held)
            swa_held = swa_held[swa_held > 0]
            buffers = [(pool.full_pool, held), (pool.swa_pool, swa_held)]
        else:
            buffers = [(pool, held)]
        for sub, rows in buffers:
            unused = torch.ones(sub.size + sub.page_size, dtype=torch.bool)
            unused[rows] = False
            for buf in (*sub.k_buffer, *sub.v_buffer):
                buf[unused] = float("nan")


def dense_reference(
    q: torch.Tensor,  # [E, H, Dk]
    k: torch.Tensor,  # [S, Hkv, Dk]
    v: torch.Tensor,  # [S, Hkv, Dv]
    prefix: int,
    window: int | None,
    scaling: float,
    sinks: torch.Tensor | None,  # [H]
) -> torch.Tensor:  # [E, H, Dv] float64
    """transformers' eager attention (with GPT-OSS sinks) for queries at [prefix, S)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    logits = torch.einsum("ehd,shd->hes", q, k) * scaling  # [H, E, S]
    q_pos = torch.arange(prefix, prefix + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos >= q_pos - window
    logits = logits.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_col = sinks.double().view(-1, 1, 1).expand(-1, q.shape[0], 1)
        logits = torch.cat((logits, sink_col), dim=-1)
    probs = torch.softmax(logits, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("hes,shd->ehd", probs, v)
