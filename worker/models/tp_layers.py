"""Tensor-parallel layers: column- and row-parallel linears, the vocab-parallel embedding and LM
head. Each keeps `param_shards` (parameter name → `ParamShard`), so the loader hands every rank
its part of each checkpoint tensor, read as a slice. At TP = 1 each is exactly the plain layer
(`nn.Linear`, `nn.Embedding`): same parameter names, shapes and arithmetic. The linears and the
LM head run over a prepacked copy of their weight in the compiled CPU decode step
(`prepacked.Prepackable`).

    column-parallel  W [O, I]: rank r holds output rows `segments` (W_r [O_r, I], b_r [O_r]);
                     y_r = x W_r^T + b_r, no communication. Several segments fuse projections.
    row-parallel     W [O, I]: rank r holds input columns `segments` (W_r [O, I_r]);
                     y = all_reduce(x_r W_r^T) + b — the bias is added once, after the sum.

The embedding and the LM head both split the vocabulary rather than replicate it: they are the
two largest matrices of a large-vocabulary model (GPT-OSS: 201k × 2880 each, 1.1 GiB in bf16), so
a replica costs each rank as much memory as several layers, while the split costs one
all-reduce of [T, D] (as much as one layer's) and one gather of the logits to rank 0, the only
rank that samples: the other ranks send their [N, V_r] and receive nothing (an all-gather would
bring each of them (tp - 1) · N · V_r logits it never reads). A vocabulary that does not split
evenly is padded: each rank holds ceil(V / tp) rows, rows past V are zero and their logits are
cut off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.proto.kv_rules import cdiv
from swaserve.worker.models.param_shard import ParamShard
from swaserve.worker.models.prepacked import Prepackable
from swaserve.worker.runner.parallel import TPGroup, shard_range

Segments = tuple[tuple[int, int], ...]


def even_segments(size: int, tp: TPGroup, what: str, part_size: int = 1) -> Segments:
    """Rank's even share of a dimension of `size` units of `part_size` (a head: its head dim)."""
    start, end = shard_range(size, tp.rank, tp.world_size, what)
    return ((start * part_size, end * part_size),)


def fused_segments(part_sizes: list[int], tp: TPGroup, what: str) -> Segments:
    """Rank's share of each of several projections stacked along one dimension (gate|up): its
    even slice of part 0, then of part 1, ... in full-tensor coordinates."""
    segments: list[tuple[int, int]] = []
    base = 0
    for size in part_sizes:
        start, end = shard_range(size, tp.rank, tp.world_size, what)
        segments.append((base + start, base + end))
        base += size
    return tuple(segments)


def _held(segments: Segments) -> int:
    return sum(end - start for start, end in segments)


class ColumnParallelLinear(Prepackable):
    """Rank's output rows `segments` of a linear [out_features, in_features]; no communication."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        segments: Segments,
        *,
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        local = _held(segments)
        self.in_features, self.out_features = in_features, local
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype))  # [O_r, I]
        self.param_shards = {"weight": ParamShard((out_features, in_features), 0, segments, local)}
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.empty(local, dtype=dtype))  # [O_r]
            self.param_shards["bias"] = ParamShard((out_features,), 0, segments, local)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, O_r]
        return self.linear(x, self.bias)


class RowParallelLinear(Prepackable):
    """Rank's input columns `segments` of a linear [out_features, in_features]; the partial
    outputs are all-reduced over `tp` and the (replicated) bias is added once, after the sum."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        segments: Segments,
        *,
        bias: bool,
        dtype: torch.dtype,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        local = _held(segments)
        self.in_features, self.out_features = local, out_features
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype))  # [O, I_r]
        self.param_shards = {"weight": ParamShard((out_features, in_features), 1, segments, local)}
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype))  # [O], replicated
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, O]
        if self.tp.world_size == 1:
            return self.linear(x, self.bias)
        y = self.tp.all_reduce(self.linear(x, None))  # [T, O], summed over ranks
        return y if self.bias is None else y + self.bias


class VocabShard:
    """The vocabulary rows [start, start + rows) a rank holds; rows past `vocab_size` pad."""

    def __init__(self, vocab_size: int, tp: TPGroup) -> None:
        self.vocab_size = vocab_size
        self.rows = vocab_size if tp.world_size == 1 else cdiv(vocab_size, tp.world_size)
        self.start = tp.rank * self.rows
        held = (min(self.start, vocab_size), min(self.start + self.rows, vocab_size))
        self.segments: Segments = (held,)

    def param_shard(self, hidden_size: int) -> ParamShard:
        return ParamShard((self.vocab_size, hidden_size), 0, self.segments, self.rows)


class VocabParallelRows(nn.Module):
    """Rank's vocabulary rows [V_r, D] of a vocabulary-sized matrix (the embedding, the LM head)
    with its `ParamShard`; the two differ only in their forward."""

    def __init__(
        self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, tp: TPGroup
    ) -> None:
        super().__init__()
        self.tp = tp
        self.shard = VocabShard(vocab_size, tp)
        self.weight = nn.Parameter(
            torch.empty(self.shard.rows, hidden_size, dtype=dtype)
        )  # [V_r, D]
        self.param_shards = {"weight": self.shard.param_shard(hidden_size)}


class VocabParallelEmbedding(VocabParallelRows):
    """Rank's vocabulary rows of the embedding; ids outside them look up zeros, and the ranks'
    rows are summed (exactly one rank holds each id, so the sum is that rank's row)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T, D]
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start  # [T] int64
        outside = (local < 0) | (local >= self.shard.rows)  # [T] bool
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, D]
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(Prepackable, VocabParallelRows):
    """Rank's vocabulary rows of the LM head (the same rows as the embedding's, so a tied head
    shares its shard). The logits are gathered to the full vocabulary on rank 0, which samples;
    every other rank returns `no_logits` — [0, V]: no row, nothing to sample or read back."""

    def __init__(
        self, hidden_size: int, vocab_size: int, *, dtype: torch.dtype, tp: TPGroup
    ) -> None:
        super().__init__(vocab_size, hidden_size, dtype=dtype, tp=tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, V] on rank 0; [0, V] elsewhere
        logits = self.linear(hidden, None)  # [N, V_r]
        if self.tp.world_size == 1:
            return logits
        full = self.tp.gather_to_first(logits, dim=-1)  # [N, tp · V_r], rank order; None off 0
        if full is None:
            return no_logits(logits, self.shard.vocab_size)
        return full[:, : self.shard.vocab_size]


def no_logits(like: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [0, V]
    """The logits of a rank that does not sample: no row (the full vocabulary is on rank 0)."""
    return like.new_empty((0, vocab_size))
