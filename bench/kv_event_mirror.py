"""`KVEventMirror`: one worker's cached pages rebuilt from its KV events, the plain reference
that the router's `ExactCacheView` is checked against (tests) and the view of an SWA-unaware
router (`router_sim.py`'s anchor). Strict: an event that contradicts the state raises."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from swaserve.proto.kv_events import (
    KVCleared,
    KVEvent,
    KVRemoved,
    KVStored,
    KVTombstoned,
    page_hashes,
)
from swaserve.proto.kv_rules import prefix_reuse


class KVEventMismatch(ValueError):
    """An event does not fit the mirrored state (lost or reordered events)."""


class KVEventMirror:
    """The set of cached pages of one worker, rebuilt from its events.

    `pages[h]` is True when page `h` is a tombstone (full KV only). `apply` raises
    `KVEventMismatch` on an event that contradicts the state; the state is then unchanged.
    """

    def __init__(self) -> None:
        self.pages: dict[int, bool] = {}

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply_one(event)

    def apply_one(self, event: KVEvent) -> None:
        if isinstance(event, KVCleared):
            self.pages.clear()
        elif isinstance(event, KVStored):
            self._expect(event.page_hashes, present=False, what="stored")
            if event.parent_hash is not None and event.parent_hash not in self.pages:
                raise KVEventMismatch(f"stored pages under unknown parent {event.parent_hash:#x}")
            for h in event.page_hashes:
                self.pages[h] = event.swa_tombstone
        elif isinstance(event, KVRemoved):
            self._expect(event.page_hashes, present=True, what="removed")
            for h in event.page_hashes:
                del self.pages[h]
        else:
            tombstone = isinstance(event, KVTombstoned)
            self._expect(event.page_hashes, present=True, what=type(event).__name__)
            if any(self.pages[h] == tombstone for h in event.page_hashes):
                raise KVEventMismatch(f"{type(event).__name__}: a page is already in that state")
            for h in event.page_hashes:
                self.pages[h] = tombstone

    def match_length(
        self,
        token_ids: Sequence[int],
        page_size: int,
        sliding_window_size: int,
        repair_tokens: int = 0,
        attention_chunk_size: int | None = None,
    ) -> int:
        """Tokens of `token_ids` a worker would skip (`prefix_reuse(...).saved_tokens`): the
        longest cached run of whole pages, cut back to the last end that has
        `sliding_window_size` live tokens before it (or no tombstone at all before it; under
        chunks, live tokens back to its chunk's start); with `repair_tokens` R > 0, the whole
        run less R where that saves more."""
        runs = []
        for h in page_hashes(token_ids, page_size):
            tombstone = self.pages.get(h)
            if tombstone is None:
                break
            runs.append((page_size, tombstone))
        return prefix_reuse(
            runs, sliding_window_size, repair_tokens, attention_chunk_size
        ).saved_tokens

    def _expect(self, hashes: Sequence[int], *, present: bool, what: str) -> None:
        for h in hashes:
            if (h in self.pages) != present:
                state = "unknown" if present else "already cached"
                raise KVEventMismatch(f"{what}: page {h:#x} is {state}")
