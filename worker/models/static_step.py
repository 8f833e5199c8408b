"""Whether a fixed-shape step is running: a compiled or captured decode step
(`decode_step.py`). Layers then take paths that read nothing back to the host and that
compile into one graph (the MoE's `forward_static`, the prepacked linears).

The flag is the running thread's: a decode step compiling in the background
(`DecodeStep.compile_in_background`) runs beside eager steps of the engine's own thread, which
must keep their own paths. (Not `torch.compiler.is_compiling()`: dynamo holds that flag for
the whole process while it compiles.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_LOCAL = threading.local()


class NestedStaticStep(RuntimeError):
    """A fixed-shape step was started inside another one of the same thread (two engines'
    steps interleaved, or a step calling a step): the layers could not tell whose step they
    run."""


@contextlib.contextmanager
def static_shapes() -> Iterator[None]:
    """Marks the fixed-shape step that runs inside it in this thread (see `in_static_step`);
    the only writer of the flag. Refuses to nest (`NestedStaticStep`)."""
    if getattr(_LOCAL, "on", False):
        raise NestedStaticStep("a fixed-shape step is already running in this thread")
    _LOCAL.on = True
    try:
        yield
    finally:
        _LOCAL.on = False


def in_static_step() -> bool:
    return getattr(_LOCAL, "on", False)
