"""Request → slot tables (SGLang's `req_to_token`): row r, column p holds a slot id of position
p of the request that owns row r.

- `RequestSlotTable` is rank 0's, on the host: full slot ids, the source of truth for every
  running request's slots (the scheduler, the KV manager and the radix tree read it).
- `DeviceSlotTable` is every TP rank's, on the model's device: the full ids and, with two pools,
  the SWA ids the attention backends read. It is written incrementally from each step's
  `ModelInput` (the new tokens' slots, plus the few ranges rank 0 re-addressed), so a step copies
  O(new tokens + batch) ids to the device, never a whole sequence.

Positions a row holds past its request's `seq_len`, or SWA ids of positions already out of the
window, may be stale: nothing reads them.
"""

from __future__ import annotations

import torch


class RequestSlotTable:
    """Host table [num_rows, max_len] int64 of full slot ids, with a free list of rows."""

    def __init__(self, num_rows: int, max_len: int) -> None:
        if num_rows <= 0 or max_len <= 0:
            raise ValueError(f"bad slot table shape: {num_rows} rows × {max_len} positions")
        self.num_rows = num_rows
        self.max_len = max_len
        self.slots = torch.zeros(num_rows, max_len, dtype=torch.int64)  # [R, L] int64
        self.slots_host = self.slots.numpy()  # the same memory, for numpy's cheaper small ops
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def acquire(self) -> int | None:
        """A free row, or None when every row is taken."""
        return self._free_rows.pop() if self._free_rows else None

    def release(self, row: int) -> None:
        if not 0 <= row < self.num_rows or row in self._free_rows:
            raise ValueError(f"slot table row {row} is not in use")
        self._free_rows.append(row)

    def check(self, used_rows: list[int]) -> None:
        """Raise if a row is both free and used, used twice, or lost."""
        free = set(self._free_rows)
        used = set(used_rows)
        if len(free) != len(self._free_rows) or len(used) != len(used_rows) or free & used:
            raise AssertionError("slot table: a row is free twice, used twice or both")
        if len(free) + len(used) != self.num_rows:
            raise AssertionError(
                f"slot table: {self.num_rows - len(free) - len(used)} rows are neither free nor used"
            )


class DeviceSlotTable:
    """Device tables [num_rows, max_len] of full ids and (two pools) SWA ids.

    int32 on CUDA (as SGLang's req_to_token), int64 on CPU (no conversion before indexing).
    """

    def __init__(
        self,
        num_rows: int,
        max_len: int,
        *,
        with_swa: bool,
        device: str | torch.device = "cpu",
        padding_row: bool = False,
    ) -> None:
        """`num_rows` rows for requests; `padding_row`: one more, row `num_rows`, which no
        request has: the padded rows of a fixed-shape decode step read and write it."""
        self.device = torch.device(device)
        self.dtype = torch.int32 if self.device.type == "cuda" else torch.int64
        self.num_rows = num_rows
        self.padding_row = num_rows if padding_row else None
        rows = num_rows + padding_row
        self.full = torch.zeros(
            rows, max_len, dtype=self.dtype, device=self.device
        )  # [R (+1), L] full slot ids
        self.swa = (
            torch.zeros(rows, max_len, dtype=self.dtype, device=self.device) if with_swa else None
        )  # [R (+1), L] SWA slot ids, or None (one pool)

    @property
    def max_len(self) -> int:
        return self.full.shape[1]

    def write(
        self,
        rows: torch.Tensor,  # [N] int64 device
        positions: torch.Tensor,  # [N] int64 device
        full_slots: torch.Tensor,  # [N] int64 device
        swa_slots: torch.Tensor | None,  # [N] int64 device, or None (one pool)
    ) -> None:
        """Set `full[rows, positions] = full_slots` (and the SWA table likewise). Each (row,
        position) appears at most once per call."""
        if rows.numel() == 0:
            return
        self.write_full(rows, positions, full_slots)
        if self.swa is not None:
            if swa_slots is None:
                raise ValueError("a two-pool slot table needs the SWA slots of every write")
            self.write_swa(rows, positions, swa_slots)

    def write_full(
        self,
        rows: torch.Tensor,  # [N] int64 device
        positions: torch.Tensor,  # [N] int64 device
        full_slots: torch.Tensor,  # [N] int64 device
    ) -> None:
        """Set only `full[rows, positions] = full_slots` (a window repair's SWA-only tokens
        leave the full table as it is)."""
        if rows.numel():
            self.full.index_put_((rows, positions), full_slots.to(self.dtype))

    def write_swa(
        self,
        rows: torch.Tensor,  # [N] int64 device
        positions: torch.Tensor,  # [N] int64 device
        swa_slots: torch.Tensor,  # [N] int64 device
    ) -> None:
        """Set only `swa[rows, positions] = swa_slots` (two pools)."""
        if self.swa is None:
            raise ValueError("a one-pool slot table has no SWA table")
        if rows.numel():
            self.swa.index_put_((rows, positions), swa_slots.to(self.dtype))
