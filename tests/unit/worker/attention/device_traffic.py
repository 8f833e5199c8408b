"""What a step moves between host and device, measured on CPU with the meta device standing in for
the accelerator.

`DeviceTraffic` is a torch dispatch + function mode. Run code whose device tensors live on "meta"
under it, and it records:

- every host → device copy (`Tensor.to`, `copy_`, `torch.tensor(..., device=)`, and a host
  tensor handed to an op on device tensors, e.g. a device tensor indexed by a host index): its
  bytes, and whether it came from a pinned buffer with `non_blocking=True`. A pinned buffer is
  one that `host_tensors.pin` made (the test replaces it: this machine has no page-locked
  memory to give);
- every op on host tensors only (host work): how many, and how many elements they produce;
- the bytes of floating-point rows gathered on the device (`index`, `index_select`): K/V
  copied out of the pool, which a paged kernel does not need.

A read of a device value (`.item()`, `.tolist()`, `int(t)`, a data-dependent shape) raises by
itself: meta tensors hold no values. So code that runs here reads nothing back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from swaserve.worker.runner import host_tensors

DEVICE = torch.device("meta")
_COPY_OPS = {"_to_copy", "copy_", "to"}  # op packets that copy between devices
_FACTORIES = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}
_GATHERS = {"index", "index_select"}


@dataclass(frozen=True)
class Copy:
    bytes: int
    pinned: bool
    non_blocking: bool
    how: str  # the op: "_to_copy", "copy_", "tensor", or "implicit:<op>"


@dataclass
class Traffic:
    copies: list[Copy] = field(default_factory=list)
    host_ops: list[str] = field(default_factory=list)
    host_elements: int = 0  # elements produced by host ops
    device_gather_bytes: int = 0  # floating-point rows gathered on the device (K/V copies)

    @property
    def host_to_device_bytes(self) -> int:
        return sum(c.bytes for c in self.copies)

    def unsafe_copies(self) -> list[Copy]:
        """Copies that would make the host wait (not non-blocking from a pinned buffer)."""
        return [c for c in self.copies if not (c.pinned and c.non_blocking)]


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Dispatch(TorchDispatchMode):
    def __init__(self, traffic: Traffic, pinned: set[int]) -> None:
        super().__init__()
        self.traffic, self.pinned = traffic, pinned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        on_device = [t for t in inputs + outputs if t.device == DEVICE]
        host_in = [t for t in inputs if t.device.type == "cpu"]
        name = func.__name__.split(".")[0]
        if name in _COPY_OPS and on_device and host_in:
            src = host_in[0]
            self.traffic.copies.append(
                Copy(
                    _nbytes(src),
                    src.untyped_storage().data_ptr() in self.pinned,
                    bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False)),
                    name,
                )
            )
        elif on_device:
            if name in _GATHERS:
                self.traffic.device_gather_bytes += sum(
                    _nbytes(t) for t in outputs if t.is_floating_point()
                )
            for t in host_in:  # a host tensor used by a device op: copied behind the scenes
                if t.dim() > 0:  # 0-dim host tensors are passed as scalars, not copied
                    self.traffic.copies.append(Copy(_nbytes(t), False, False, f"implicit:{name}"))
        else:
            self.traffic.host_ops.append(func.__name__)
            self.traffic.host_elements += sum(t.numel() for t in outputs)
        return out


class _Functions(TorchFunctionMode):
    def __init__(self, traffic: Traffic) -> None:
        super().__init__()
        self.traffic = traffic

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FACTORIES and isinstance(out, torch.Tensor) and out.device == DEVICE:
            self.traffic.copies.append(Copy(_nbytes(out), False, False, "tensor"))
        return out


@contextmanager
def device_traffic() -> Iterator[Traffic]:
    """Record the traffic of the code run inside (see the module docstring)."""
    traffic, pinned = Traffic(), set()

    def fake_pin(t: torch.Tensor) -> torch.Tensor:
        staged = t.clone()  # stands in for the page-locked staging copy
        pinned.add(staged.untyped_storage().data_ptr())
        return staged

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(host_tensors, "pin", fake_pin, raising=False)
        with _Functions(traffic), _Dispatch(traffic, pinned):
            yield traffic
