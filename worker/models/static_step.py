"""Whether a fixed-shape step is running: a compiled or captured decode step
(`decode_step.py`). Layers then take paths that read nothing back to the host and that
compile into one graph (the MoE's `forward_static`, the prepacked linears)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_STATIC_SHAPES = [False]


class NestedStaticStep(RuntimeError):
    """A fixed-shape step was started inside another one (two engines' steps interleaved in
    one process, or a step calling a step): the layers could not tell whose step they run."""


@contextlib.contextmanager
def static_shapes() -> Iterator[None]:
    """Marks the fixed-shape step that runs inside it (see `in_static_step`); the only writer
    of the flag. Refuses to nest (`NestedStaticStep`)."""
    if _STATIC_SHAPES[0]:
        raise NestedStaticStep("a fixed-shape step is already running in this process")
    _STATIC_SHAPES[0] = True
    try:
        yield
    finally:
        _STATIC_SHAPES[0] = False


def in_static_step() -> bool:
    return _STATIC_SHAPES[0]
