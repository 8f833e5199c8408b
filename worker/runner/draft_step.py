"""The compiled MTP draft step: an MTP depth's forward run as one fixed-shape graph per
(depth, batch bucket), as the decode step runs the target's (`decode_step`).

After every step the engine runs up to three forwards of the MTP depths (`engine.mtp`: each
depth's refresh over the positions the step committed, then the chain steps that make the
drafts). Eagerly each is an extend forward of a few rows a request, with its own attention
metadata and hundreds of small ops: at batch 1 of the speculative bench the three cost 2.9×
the compiled target's step. Here every row is one token, as a decode row is:

    input id       the token (a refresh row's committed token; a chain row's draft, on the
                   device already: copied into the input buffer there, never read back)
    position       its slot-table position (the refresh: its own; a chain step: m + 1)
    RoPE position  its rotary position (the refresh: the same; chain step s: m + s)
    row, slots     its request's slot-table row and its KV slots (the chain step's: the page
                   tail or the request's scratch page, `engine.mtp`)

and the rows of one request attend as the eager extend does: the graph writes every row's KV
(and the MTP pool's slot-table entries) before any row reads, and a row reads the window that
ends at its own position. The target's normed hidden state of each row is copied into a
persistent buffer (`hidden_in`) the graph reads. The graph returns each row's normed output
[Bp, D]; the LM head runs on the rows whose drafts are wanted only (`ModelRunner.draft_logits`).

Graphs are keyed by (depth, Bp): the depths are separate code objects (`own_code`), the full
layers' key width is fixed (the depths are SWA layers and read W + 1 keys). With
`compile="auto"` on CPU the step compiles in the background after the decode step's thread is
done (`compile_in_background`), and a step runs compiled only when every graph it needs is
ready and the thread does not hold the step (`hold`); otherwise the drafts run eagerly.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from swaserve.worker.attention.static_decode import DecodeBatch
from swaserve.worker.kv.slot_table import DeviceSlotTable
from swaserve.worker.runner.decode_step import DecodeStep, batch_buckets, bucket_of, key_width

DRAFT_FIELDS = 6  # input ids, positions, slot-table rows, full slots, SWA slots, RoPE positions


@dataclass(frozen=True, slots=True)
class DraftRows:
    """One MTP depth forward as rows of one token each (host int64 tensors unless said)."""

    input_ids: torch.Tensor  # [R] the first R rows' tokens
    chain_ids: torch.Tensor | None  # [N - R] on the device: the last rows' tokens (drafts)
    positions: torch.Tensor  # [N] slot-table positions
    rope_positions: torch.Tensor  # [N]
    req_rows: torch.Tensor  # [N] slot-table rows
    full_slots: torch.Tensor  # [N]
    swa_slots: torch.Tensor | None  # [N] (two pools)
    hidden_rows: torch.Tensor  # [N] rows of the target forward's hidden states

    @property
    def num_rows(self) -> int:
        return int(self.positions.numel())

    def __post_init__(self) -> None:
        n, r = self.num_rows, int(self.input_ids.numel())
        chained = 0 if self.chain_ids is None else int(self.chain_ids.numel())
        if r + chained != n:
            raise ValueError(f"{r} host and {chained} device tokens for {n} rows")


def padding_rows(rows: int, padding_row: int, two_pools: bool) -> DraftRows:
    """`rows` rows of the padding row at position 0, slot 0: a warm-up step's input."""
    zeros = torch.zeros(rows, dtype=torch.int64)
    return DraftRows(
        input_ids=zeros,
        chain_ids=None,
        positions=zeros,
        rope_positions=zeros,
        req_rows=torch.full((rows,), padding_row, dtype=torch.int64),
        full_slots=zeros,
        swa_slots=zeros if two_pools else None,
        hidden_rows=zeros,
    )


class DraftStep(DecodeStep):
    """The fixed-shape MTP depth forward of one model runner (see the module docstring);
    `model` has MTP layers (`HybridCausalLM.draft_hidden`)."""

    input_fields = DRAFT_FIELDS
    hands_on_hidden = False  # the target's step hands the drafts theirs

    def __init__(
        self,
        model: Any,
        slot_table: DeviceSlotTable,
        *,
        num_depths: int,
        **options: Any,
    ) -> None:
        super().__init__(model, slot_table, **options)
        self.num_depths = num_depths
        self.hidden_in = torch.zeros(
            self.buckets[-1] + 1, model.config.hidden_size, dtype=model.dtype, device=self.device
        )  # [Bmax + 1, D] the target's hidden state of each row
        self.width = key_width(1, self.max_len, graphs=self.mode == "graphs")

    @staticmethod
    def make_buckets(max_batch: int) -> tuple[int, ...]:
        """No bucket of one row: a graph of batch 1 is one more compile per depth (dynamo
        specializes a dimension of 1), for a forward of one row only at depth 0 of batch 1."""
        return tuple(b for b in batch_buckets(max_batch) if b > 1) or (2,)

    def ready_key(self, variant: int, bp: int) -> Hashable:
        return (variant, bp)

    def needs(self, forwards: list[tuple[int, int]]) -> set[tuple[int, int]]:
        """The graphs (depth, Bp) that forwards of (depth, rows) run in; raises ValueError
        when one has more rows than the largest bucket."""
        return {(depth, bucket_of(n, self.buckets)) for depth, n in forwards}

    @contextmanager
    def hold(self, forwards: list[tuple[int, int]]) -> Iterator[bool]:
        """Whether the forwards of (depth, rows) can run here now, holding the step for them
        while they do: every one within the buckets and, compiling in the background, every
        graph ready and the thread not holding the step (no wait: the caller runs them
        eagerly otherwise)."""
        if any(n < 1 or n > self.buckets[-1] for _, n in forwards):
            yield False
            return
        if not self.background:
            yield True
            return
        if not self.needs(forwards) <= self.ready or not self._lock.acquire(blocking=False):
            self.stats.eager += 1
            yield False
            return
        try:
            yield True
        finally:
            self._lock.release()

    def run_rows(
        self, rows: DraftRows, depth: int, hidden: torch.Tensor | None
    ) -> torch.Tensor:  # [N, D] normed (a view of the graph's output on CUDA)
        """Depth `depth` over `rows`, whose target hidden states are `hidden` [N, D] (None:
        a warm-up, the buffer's rows as they are). Call inside `hold`."""
        n = rows.num_rows
        bp = bucket_of(n, self.buckets)
        r = int(rows.input_ids.numel())
        self._load_inputs(
            [
                rows.input_ids,  # the host tokens; the chain's follow on the device
                rows.positions,
                rows.req_rows,
                rows.full_slots,
                rows.swa_slots,
                rows.rope_positions,
            ],
            n,
            bp,
        )
        if rows.chain_ids is not None:
            self.inputs[0, r:n].copy_(rows.chain_ids)
        if hidden is not None:
            self.hidden_in[:n].copy_(hidden)
        return self._call(depth, bp, self.width)[:n]

    def _step(self, inputs: torch.Tensor, cols: torch.Tensor, variant: int = 0) -> torch.Tensor:
        """Depth `variant` over the persistent inputs [6, Bp]: [Bp, D] normed outputs."""
        table = self.slot_table
        rows, positions = inputs[2], inputs[1]
        pool_table = table.swa if self.two_pools else table.full  # the MTP depths' pool
        assert pool_table is not None
        pool_table[rows, positions] = (inputs[4] if self.two_pools else inputs[3]).to(
            pool_table.dtype
        )
        batch = DecodeBatch(inputs[0], inputs[5], self._metadata(inputs, cols))
        hidden = self.hidden_in[: inputs.shape[1]]
        out: torch.Tensor = self.model.draft_hidden(batch, hidden, variant)
        return out

    def compile_in_background(
        self, inputs: list[tuple[int, DraftRows]], after: threading.Event | None = None
    ) -> None:
        """`DecodeStep.compile_in_background` over (depth, padding rows) warm-ups, started
        once `after` is set (the decode step's thread is done: one compile at a time)."""

        def runs() -> Iterator[Callable[[], object]]:  # iterated in the thread, as it goes
            for depth, rows in inputs:
                yield functools.partial(self.run_rows, rows, depth, None)

        self._start_thread(runs(), after)

    def warm_up_inputs(self) -> list[tuple[int, DraftRows]]:
        """Every (depth, bucket)'s padding rows: what a start compiles or captures."""
        return [
            (depth, padding_rows(bp, self.padding_row, self.two_pools))
            for bp in self.buckets
            for depth in range(self.num_depths)
        ]
