"""Random request lifecycles over the SWA allocator: `check()` after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from swaserve.worker.kv import SWAFreeState, SWATokenAllocator, free_swa_out_of_window_slots


@dataclass
class Req:
    slots: list[int] = field(default_factory=list)  # full slot id of each position
    swa: SWAFreeState = field(default_factory=SWAFreeState)

    @property
    def last_loc(self) -> int:
        return self.slots[-1] if self.slots else -1


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.reqs: list[Req] = []
        self.raw: list[torch.Tensor] = []

    @initialize(
        page_size=st.sampled_from([1, 4, 16]),
        full_pages=st.integers(4, 24),
        swa_pages=st.integers(2, 24),
    )
    def setup(self, page_size: int, full_pages: int, swa_pages: int) -> None:
        self.p = page_size
        self.alloc = SWATokenAllocator(
            full_pages * page_size, swa_pages * page_size, page_size=page_size
        )

    def owned(self) -> torch.Tensor:
        parts = [torch.tensor(r.slots, dtype=torch.int64) for r in self.reqs] + self.raw
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "alloc"):
            self.alloc.check(owned=self.owned())

    @rule(n=st.integers(1, 40))
    def new_request(self, n: int) -> None:
        out = self.alloc.alloc_extend(torch.tensor([0]), torch.tensor([n]), torch.tensor([-1]))
        if out is not None:
            assert out.numel() == n
            self.reqs.append(Req(out.tolist()))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 20))
    def extend(self, data: st.DataObject, n: int) -> None:
        req = data.draw(st.sampled_from(self.reqs))
        before = self.alloc.full_available_size()
        pre = len(req.slots)
        out = self.alloc.alloc_extend(
            torch.tensor([pre]), torch.tensor([pre + n]), torch.tensor([req.last_loc])
        )
        if out is None:
            assert self.alloc.full_available_size() == before
            return
        assert out.numel() == n
        if pre % self.p:
            assert int(out[0]) == req.last_loc + 1  # continues its page
        req.slots.extend(out.tolist())

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        batch = data.draw(
            st.lists(st.sampled_from(self.reqs), min_size=1, max_size=4, unique_by=id)
        )
        seq = torch.tensor([len(r.slots) + 1 for r in batch])
        last = torch.tensor([r.last_loc for r in batch])
        out = self.alloc.alloc_decode(seq, last)
        if out is None:
            return
        for r, slot in zip(batch, out.tolist(), strict=True):
            r.slots.append(slot)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), window=st.integers(0, 12), radix=st.booleans())
    def free_out_of_window(self, data: st.DataObject, window: int, radix: bool) -> None:
        req = data.draw(st.sampled_from(self.reqs))
        before = req.swa.swa_evicted_seqlen
        free_swa_out_of_window_slots(
            self.alloc,
            req.swa,
            torch.tensor(req.slots, dtype=torch.int64),
            len(req.slots),
            sliding_window_size=window,
            radix_cache=radix,
        )
        assert before <= req.swa.swa_evicted_seqlen <= max(0, len(req.slots) - 1)
        evicted = torch.tensor(req.slots[: req.swa.swa_evicted_seqlen], dtype=torch.int64)
        assert (self.alloc.translate(evicted) == 0).all()
        tail = torch.tensor(req.slots[req.swa.swa_evicted_seqlen :], dtype=torch.int64)
        assert (self.alloc.translate(tail) > 0).all()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.reqs))
        self.reqs.remove(req)
        self.alloc.free(torch.tensor(req.slots, dtype=torch.int64))

    @rule(pages=st.integers(0, 3))
    def raw_alloc(self, pages: int) -> None:
        out = self.alloc.alloc(pages * self.p)
        if out is not None and out.numel():
            self.raw.append(out)

    @precondition(lambda self: self.raw)
    @rule(data=st.data(), swa_only=st.booleans())
    def raw_free(self, data: st.DataObject, swa_only: bool) -> None:
        block = data.draw(st.sampled_from(self.raw))
        if swa_only:
            self.alloc.free_swa(block)
            self.alloc.free_swa(block)  # repeating is harmless
        else:
            self.raw = [b for b in self.raw if b is not block]
            self.alloc.free(block)

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        for req in self.reqs:
            self.alloc.free(torch.tensor(req.slots, dtype=torch.int64))
        for block in self.raw:
            self.alloc.free(block)
        self.alloc.check(owned=torch.empty(0, dtype=torch.int64))
        assert self.alloc.full_available_size() == self.alloc.full_size
        assert self.alloc.swa_available_size() == self.alloc.swa_size


AllocatorMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None
)
TestAllocatorLifecycles = AllocatorMachine.TestCase
