"""Shared fixtures: tiny random models written to a temp dir once per session."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from swaserve.proto.environment import CPU_AUTO_COMPILE_ENV
from swaserve.worker.models.tiny import make_tiny_model

# `compile="auto"` stays eager on CPU in the suite's hundreds of engines (and in the Ray
# workers and subprocesses they start, which inherit it): each would otherwise compile its
# decode step in a thread beside the others. The tests of the background compile set it.
os.environ[CPU_AUTO_COMPILE_ENV] = "0"


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_model_factory(arch=..., **options)` → an HF model dir, cached per option set."""
    made: dict[tuple, Path] = {}

    def make(arch: str = "gpt-oss", **options: object) -> Path:
        key = (arch, repr(sorted(options.items())))  # repr: options may hold lists
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = make_tiny_model(path, arch=arch, **options)  # type: ignore[arg-type]
        return made[key]

    return make


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one intra-op thread; two contend on a 2-core CI machine.
    Per test, so that a bench run in-process with its own thread count cannot leak it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
