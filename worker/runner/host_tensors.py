"""Host tensors of the hot path, and their one way onto the device.

- `int_tensor` / `float_tensor`: CPU tensors from Python lists through numpy, about 3× faster
  than `torch.tensor(list)` for a batch of a few hundred values (9 µs vs 28 µs for 256 ints).
- `to_device`: every per-step host → device copy of the worker goes through it (the model
  runner's input, the attention metadata, the sampler's per-row parameters). On the CPU it is
  no copy at all; on an accelerator the host tensor is staged in page-locked memory and copied
  with `non_blocking=True`, so the host never waits for the device (a pageable or blocking copy
  is a synchronisation: `torch.cuda.set_sync_debug_mode("error")` rejects it). The staging
  block goes back to torch's caching host allocator, which records the copy on the stream and
  does not hand the block out again before the copy has run.
- `pack_to_device`: several small int vectors in one copy (one staging block, one transfer).

`pin` and `transfer` are the two halves of the copy, named so that a test can stand in for a
device that this machine lacks and check that every copy of a step took this path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def int_tensor(values: Sequence[int] | np.ndarray) -> torch.Tensor:  # [n] int64 CPU
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


def float_tensor(values: Sequence[float] | np.ndarray) -> torch.Tensor:  # [n] float32 CPU
    return torch.from_numpy(np.asarray(values, dtype=np.float32))


def pin(t: torch.Tensor) -> torch.Tensor:
    """A page-locked copy of host tensor `t` (from torch's caching host allocator)."""
    return t.pin_memory()


def transfer(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy page-locked `t` to `device` without waiting for it."""
    return t.to(device, non_blocking=True)


def to_device(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """`t` on `device`: itself when it is there already (every CPU tensor on a CPU worker), a
    pinned, non-blocking copy when it is a host tensor bound for an accelerator."""
    device = torch.device(device)
    if t.device.type != "cpu":
        return t.to(device)  # already on a device: no host work (a no-op on the same one)
    if device.type == "cpu":
        return t
    return transfer(pin(t), device)


def pack_to_device(
    parts: Sequence[Sequence[int] | np.ndarray], device: str | torch.device
) -> list[torch.Tensor]:
    """`[to_device(int_tensor(p), device) for p in parts]` in one copy: the parts are
    concatenated on the host and split again on the device (views of one int64 buffer)."""
    host = [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]
    flat = np.concatenate(host) if host else np.zeros(0, dtype=np.int64)  # [sum n] int64
    packed = to_device(torch.from_numpy(flat), device)
    return list(torch.split(packed, [h.size for h in host]))
