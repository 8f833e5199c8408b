"""`ModelInput`: everything one forward needs, as plain CPU tensors and ints.

Rank 0 builds it from the scheduled batch (`build_model_input`); the model runner of every TP
rank consumes only this (no `Request`, no allocator, no tree), so it can be pickled or broadcast
as it is. Per request i of the batch, new tokens sit at positions `[prefix_lens[i], seq_lens[i])`:

    # full layers read positions  [0, seq_i)                       device table row req_rows[i]
    # SWA layers read positions   [max(0, prefix_i - W), seq_i)    the same row of the SWA table
    # the step writes             [prefix_i, seq_i)                out_full_loc / out_swa_loc

Before the forward, the device slot tables get `writes` (positions rank 0 re-addressed: a matched
prefix at admission, slots the radix tree deduplicated) and then the new tokens' slots. SWA ids
are translated from full ids here, once per batch, on the host.

A window repair (`window_repair`, architecture §6) changes two things for request i, whose cached
prefix resumes at `start_i` and whose new tokens at positions `[start_i, end_i)` recompute only
their SWA KV:

    # SWA layers read positions   [max(start_i, prefix_i - W), seq_i)   nothing before start_i
    # full table at [start_i, end_i) keeps the cached slots (full layers read the cached KV;
    #   the full KV the step computes there lands in the request's own slots and is dropped)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from swaserve.worker.runner.host_tensors import int_tensor


@dataclass(frozen=True, slots=True)
class SlotWrites:
    """Slot-table entries to set before a step: `table[rows[j], positions[j]] = full[j]`."""

    rows: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    full: torch.Tensor  # [N] int64 full slot ids
    swa: torch.Tensor | None  # [N] int64 SWA slot ids (two pools), else None

    @staticmethod
    def empty(two_pools: bool) -> SlotWrites:
        none = torch.empty(0, dtype=torch.int64)  # [0] int64
        return SlotWrites(none, none, none, none if two_pools else None)

    @property
    def num_writes(self) -> int:
        return self.rows.numel()


@dataclass(frozen=True, slots=True)
class ModelInput:
    """One step of the model (see the module docstring). All tensors are CPU int64."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_rows: torch.Tensor  # [B] int64 slot-table row of each request
    prefix_lens: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    out_full_loc: torch.Tensor  # [T] int64 full slots of the new tokens
    out_swa_loc: torch.Tensor | None  # [T] int64 their SWA slots (two pools), else None
    writes: SlotWrites
    logits_indices: torch.Tensor  # [N] int64 token rows whose logits are wanted (sampling rows)
    sliding_window_size: int | None  # W of the SWA layers; None: the model has none
    window_repair: torch.Tensor | None = None  # [2, B] int64 (start, end) per request; 0, 0: none

    def __post_init__(self) -> None:
        b, t = self.req_rows.numel(), self.input_ids.numel()
        if self.prefix_lens.numel() != b or self.seq_lens.numel() != b:
            raise ValueError("req_rows, prefix_lens and seq_lens need one entry per request")
        if self.positions.numel() != t or self.out_full_loc.numel() != t:
            raise ValueError("input_ids, positions and out_full_loc need one entry per new token")
        if self.out_swa_loc is not None and self.out_swa_loc.numel() != t:
            raise ValueError("out_swa_loc needs one entry per new token")
        if self.window_repair is not None and tuple(self.window_repair.shape) != (2, b):
            raise ValueError("window_repair needs a (start, end) pair per request: shape [2, B]")

    def swa_floor(self) -> torch.Tensor | None:
        """[B] int64: the position before which request i's SWA layers read nothing (its
        repair start, 0 without one); None when no request repairs."""
        return None if self.window_repair is None else self.window_repair[0]

    def full_table_tokens(self) -> torch.Tensor | None:
        """[K] int64 rows of the new tokens whose full slot goes into the device table (all but
        those a window repair recomputes); None when that is every token."""
        if self.window_repair is None:
            return None
        extend = self.seq_lens - self.prefix_lens  # [B] int64
        ends = torch.repeat_interleave(self.window_repair[1], extend, output_size=self.num_tokens)
        return torch.nonzero(self.positions >= ends).flatten()  # [K] int64

    @property
    def batch_size(self) -> int:
        return self.req_rows.numel()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def host_to_device_bytes(self) -> int:
        """Bytes of this input (what TP rank 0 broadcasts): O(new tokens + batch + re-addressed
        slots), never O(sequence lengths). The runner copies its device part through
        `host_tensors.to_device`; the attention metadata adds its O(batch) plan (8 · (4B + 1 +
        2 · decodes) bytes, `build_attention_metadata`)."""
        tensors = [
            self.input_ids,
            self.positions,
            self.req_rows,
            self.prefix_lens,
            self.seq_lens,
            self.out_full_loc,
            self.out_swa_loc,
            self.writes.rows,
            self.writes.positions,
            self.writes.full,
            self.writes.swa,
            self.logits_indices,
            self.window_repair,
        ]
        return sum(x.numel() * x.element_size() for x in tensors if x is not None)


def padding_decode_input(
    batch_size: int, *, two_pools: bool, sliding_window_size: int | None, row: int
) -> ModelInput:
    """A decode step of `batch_size` requests that are all padding: token 0 at position 0 of
    slot-table row `row` (the table's padding row, which no request has), KV into the padding
    slot 0 (which no request reads). What the engine runs to compile or capture the decode
    graphs."""
    zeros = torch.zeros(batch_size, dtype=torch.int64)  # [B] int64
    return ModelInput(
        input_ids=zeros,
        positions=zeros,
        req_rows=zeros + row,
        prefix_lens=zeros,
        seq_lens=zeros + 1,
        out_full_loc=zeros,
        out_swa_loc=zeros if two_pools else None,
        writes=SlotWrites.empty(two_pools),
        logits_indices=torch.arange(batch_size),
        sliding_window_size=sliding_window_size,
    )


def padding_prefill_input(
    token_ids: torch.Tensor,
    slots: torch.Tensor,
    translate: Callable[[torch.Tensor], torch.Tensor] | None,
    *,
    sliding_window_size: int | None,
) -> ModelInput:
    """A prefill of `token_ids` ([T] int64) from position 0 into the full slots `slots` ([T]
    int64, SWA ids by `translate` with two pools) of slot-table row 0, for no request: what
    the engine runs at start to time its prefill (the row's entries are rewritten by the
    request that takes it next, before any read)."""
    t = token_ids.numel()
    zero = torch.zeros(1, dtype=torch.int64)  # [1] int64
    positions = torch.arange(t)  # [T] int64
    swa = None if translate is None else translate(slots)
    return ModelInput(
        input_ids=token_ids,
        positions=positions,
        req_rows=zero,
        prefix_lens=zero,
        seq_lens=zero + t,
        out_full_loc=slots,
        out_swa_loc=swa,
        writes=SlotWrites(torch.zeros(t, dtype=torch.int64), positions, slots, swa),
        logits_indices=zero + t - 1,
        sliding_window_size=sliding_window_size,
    )


def build_model_input(
    *,
    token_ids: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    req_rows: Sequence[int],
    samples: Sequence[bool],
    out_full_loc: torch.Tensor,
    writes: SlotWrites,
    translate: Callable[[torch.Tensor], torch.Tensor] | None,
    sliding_window_size: int | None,
    window_repair: Sequence[tuple[int, int]] | None = None,
) -> ModelInput:
    """Rank 0: one step's `ModelInput` from the scheduled batch, in a handful of batched ops.

    The sequences are lists or int64 arrays (an array becomes its tensor without a copy).
    `token_ids` are the new tokens of all requests in batch order; `translate` maps full → SWA
    ids (two pools) or is None (one pool); `samples[i]`: request i samples a token this step;
    `window_repair`: a (start, end) pair per request when one of them repairs (module docstring).
    """
    # numpy on the host: each op costs a microsecond where a small torch op costs several.
    prefix = np.asarray(prefix_lens, dtype=np.int64)  # [B] int64
    num_tokens = len(token_ids)
    if num_tokens == len(extend_lens):  # one new token each (decodes): no repeat needed
        extend = np.ones(num_tokens, dtype=np.int64)  # [B] int64
        positions = prefix  # [T] int64
        ends = np.arange(1, num_tokens + 1, dtype=np.int64)  # [B] int64
    else:
        extend = np.asarray(extend_lens, dtype=np.int64)  # [B] int64
        ends = np.cumsum(extend)  # [B] int64
        positions = np.repeat(prefix - (ends - extend), extend) + np.arange(num_tokens)  # [T]
    last_rows = ends - 1  # [B] int64 token row of each request's last new token
    return ModelInput(
        input_ids=int_tensor(token_ids),  # [T] int64
        positions=torch.from_numpy(positions),
        req_rows=int_tensor(req_rows),  # [B] int64
        prefix_lens=torch.from_numpy(prefix),
        seq_lens=torch.from_numpy(prefix + extend),
        out_full_loc=out_full_loc,
        out_swa_loc=None if translate is None else translate(out_full_loc),
        writes=writes,
        logits_indices=torch.from_numpy(
            last_rows if all(samples) else last_rows[np.asarray(samples, dtype=np.bool_)]
        ),  # [N] int64
        sliding_window_size=sliding_window_size,
        window_repair=None
        if window_repair is None
        else torch.tensor(window_repair, dtype=torch.int64).reshape(-1, 2).T.contiguous(),
    )


_NO_WINDOW = -1
HEADER_LEN = 8
"""T, B, N writes, N logits, has SWA, W (or -1), command (set by the sender), has a repair."""
COMMAND_FIELD = 6


def pack_model_input(inp: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [7] int64, payload [L] int64): the whole input as two flat tensors, for a
    broadcast over the TP control group (no pickling)."""
    two_pools = inp.out_swa_loc is not None
    fields = [
        inp.input_ids,
        inp.positions,
        inp.req_rows,
        inp.prefix_lens,
        inp.seq_lens,
        inp.out_full_loc,
        inp.writes.rows,
        inp.writes.positions,
        inp.writes.full,
        inp.logits_indices,
    ]
    if two_pools:
        assert inp.out_swa_loc is not None and inp.writes.swa is not None
        fields += [inp.out_swa_loc, inp.writes.swa]
    if inp.window_repair is not None:
        fields.append(inp.window_repair)
    header = torch.tensor(
        [
            inp.num_tokens,
            inp.batch_size,
            inp.writes.num_writes,
            inp.logits_indices.numel(),
            int(two_pools),
            _NO_WINDOW if inp.sliding_window_size is None else inp.sliding_window_size,
            0,
            int(inp.window_repair is not None),
        ],
        dtype=torch.int64,
    )  # [8] int64
    return header, torch.cat([f.reshape(-1).to(torch.int64) for f in fields])  # [L] int64


def payload_len(header: torch.Tensor) -> int:
    t, b, n, k, two_pools = (int(x) for x in header[:5])
    return 3 * t + 3 * b + 3 * n + k + two_pools * (t + n) + int(header[7]) * 2 * b


def unpack_model_input(header: torch.Tensor, payload: torch.Tensor) -> ModelInput:
    """Inverse of `pack_model_input`."""
    t, b, n, k, two_pools, window = (int(x) for x in header[:6])
    repair = int(header[7])
    sizes = [t, t, b, b, b, t, n, n, n, k] + ([t, n] if two_pools else []) + [2 * b] * repair
    parts = list(torch.split(payload, sizes))
    ids, pos, rows, prefix, seq, out_full, w_rows, w_pos, w_full, logits = parts[:10]
    out_swa, w_swa = (parts[10], parts[11]) if two_pools else (None, None)
    return ModelInput(
        input_ids=ids,
        positions=pos,
        req_rows=rows,
        prefix_lens=prefix,
        seq_lens=seq,
        out_full_loc=out_full,
        out_swa_loc=out_swa,
        writes=SlotWrites(w_rows, w_pos, w_full, w_swa),
        logits_indices=logits,
        sliding_window_size=None if window == _NO_WINDOW else window,
        window_repair=parts[-1].reshape(2, b) if repair else None,
    )
