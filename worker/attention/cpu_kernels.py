"""Our C++ CPU kernels, built on first use with the machine's compiler (the one inductor uses for
the compiled decode step) and kept under `$SWASERVE_CACHE_DIR/kernels` for later starts.

`swaserve::decode_attention` (`cpu_decode_attention.cpp`): the attention of one-token rows over
the pool rows, eager (`torch_backend.decode_attention`: decodes and speculative verify rows)
and in the compiled decode step. Traced, inductor's loops for the same arithmetic
(`sdpa.decode_attention_loops`) recompute each key's slot in every head and lane chunk and run
the softmax passes on one thread; eager, the gathered SDPA copies every row's keys. The kernel
reads each key's slot once, scores every head of the row at once, splits the work over rows,
and computes a row over its own keys only (up to the last its mask shows), so a row's result
does not depend on the batch around it.

`load()` builds (or loads) it once per process: every CPU attention backend calls it when it is
made (and the compiled step before it traces), never while dynamo traces;
`decode_attention_op()` is the loaded op, or None when the build failed (no compiler: eager
decodes then gather, a compiled step keeps inductor's loops, with a warning). The build runs
through `torch.utils.cpp_extension` with the `ninja` package's binary; the ISA flags are
probed once per machine and kept beside the build (`cached_build_flags`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Any

import torch

from swaserve.proto import environment
from swaserve.proto.environment import cache_dir

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("cpu_decode_attention.cpp", "cpu_prepacked_linear.cpp")
)
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "op": the loaded op or None (the build failed); absent: not tried


def cached_build_flags(build_dir: Path) -> list[str]:
    """`build_flags()`, kept in `build_dir` for this CPU: inductor's ISA probe compiles and runs
    test programs (about 2 s), which every process that serves on the CPU would pay at start."""
    record = build_dir / "flags.json"
    cpu = _cpu_fingerprint()
    try:
        saved = json.loads(record.read_text())
        if saved.get("cpu") == cpu and isinstance(saved.get("flags"), list):
            return [str(flag) for flag in saved["flags"]]
    except (OSError, ValueError):
        pass
    flags = build_flags()
    tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"cpu": cpu, "flags": flags}))
        tmp.replace(record)
    except OSError:
        tmp.unlink(missing_ok=True)
    return flags


def _cpu_fingerprint() -> str:
    """This machine's CPU model and feature flags (what the ISA probe depends on)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [
        line.split(":", 1)[1].strip()
        for line in info.splitlines()
        if line.startswith(("model name", "flags", "Features"))
    ]
    return hashlib.sha256("\n".join(sorted(set(lines))).encode()).hexdigest()


def build_flags() -> list[str]:
    """OpenMP, and the vector ISA of this machine as inductor picks it (at::vec's CPU_CAPABILITY
    macros and the compiler's arch flags), so that the kernel's `Vectorized<float>` is AVX-512 or
    AVX2 where the CPU has it; none (portable scalar code) where inductor finds no ISA."""
    from torch._inductor import cpu_vec_isa

    flags = ["-O3", "-fopenmp"]  # at::parallel_for is OpenMP in torch's CPU builds
    isa = cpu_vec_isa.pick_vec_isa()
    if isa:
        for macro in isa.build_macro():
            flags.append(f"-D{macro}")
            if macro.startswith("CPU_CAPABILITY_"):
                flags.append(f"-DCPU_CAPABILITY={macro.removeprefix('CPU_CAPABILITY_')}")
        flags.extend(isa.build_arch_flags().split())
    return flags


def load() -> Any:
    """The `swaserve::decode_attention` op, built the first time (None if that fails)."""
    with _lock:
        if "op" not in _state:
            _state["op"] = _build()
        return _state["op"]


def decode_attention_op() -> Any:
    """The op if `load()` has made it, else None (never builds: safe while tracing)."""
    return _state.get("op")


def decode_attention_for(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> Any:
    """The loaded op when it serves these tensors (CPU, float32 queries and pool), else None."""
    kernel = _state.get("op")
    if (
        kernel is not None
        and q.device.type == "cpu"
        and q.dtype == k_buf.dtype == v_buf.dtype == torch.float32
    ):
        return kernel
    return None


def _build() -> Any:
    from torch.utils import cpp_extension

    build_dir = cache_dir() / "kernels" / f"torch-{torch.__version__}"
    try:
        _put_ninja_on_path()
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name="swaserve_cpu_kernels",
            sources=[str(source) for source in SOURCES],
            extra_cflags=cached_build_flags(build_dir),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
        )
    except (OSError, RuntimeError, ImportError, SystemExit) as exc:
        logger.warning("the CPU decode-attention kernel did not build (%s): using loops", exc)
        return None
    torch.library.register_fake("swaserve::decode_attention")(_decode_attention_fake)
    from swaserve.worker.models import prepacked  # imports nothing of the attention package

    prepacked.use_native()
    return torch.ops.swaserve.decode_attention


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH: add the `ninja` package's binary (a dependency),
    which a virtualenv used without activating it does not have on PATH."""
    try:
        import ninja
    except ImportError:
        return
    environment.prepend_path(ninja.BIN_DIR)


def _decode_attention_fake(
    q: torch.Tensor,  # [B, H, Dk]
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,  # [R, Hkv, Dv]
    slots: torch.Tensor,
    bias: torch.Tensor,
    scaling: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # [B, H, Dv]
    return q.new_empty(q.shape[0], q.shape[1], v_buf.shape[2])
