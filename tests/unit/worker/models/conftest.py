"""Model tests run tiny tensors: one intra-op thread is faster than two and, on a busy machine,
avoids OpenMP barrier stalls (an index_add_ of 24 rows took 30 ms with two contended threads)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
