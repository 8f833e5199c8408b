from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    """The tensors here are tiny: thread-pool hand-offs would cost more than the math (and stall
    badly when the cores are shared), so these tests run torch ops on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
