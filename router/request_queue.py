"""RequestQueue: requests that fit no worker yet wait here, first in first out, each until its
deadline; bounded, so that a full queue turns into `Overloaded` at the door."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from swaserve.router.policies import RouteRequest


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    request: RouteRequest
    enqueued_at_s: float
    deadline_s: float


class RequestQueue:
    """FIFO of `QueuedRequest`s by request id, at most `max_len` of them."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self._items: OrderedDict[str, QueuedRequest] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items

    @property
    def full(self) -> bool:
        return len(self._items) >= self.max_len

    def head(self) -> QueuedRequest | None:
        return next(iter(self._items.values()), None)

    def push(self, item: QueuedRequest) -> None:
        """Append at the tail. The caller checks `full` first (raises ValueError when full or
        when the id is already queued)."""
        if self.full or item.request.request_id in self._items:
            raise ValueError(f"cannot queue {item.request.request_id!r} (full or already queued)")
        self._items[item.request.request_id] = item

    def pop_head(self) -> QueuedRequest:
        return self._items.popitem(last=False)[1]

    def remove(self, request_id: str) -> QueuedRequest | None:
        return self._items.pop(request_id, None)

    def pop_expired(self, now_s: float) -> list[QueuedRequest]:
        """Remove and return, in queue order, the requests whose deadline is at or before now."""
        expired = [q for q in self._items.values() if q.deadline_s <= now_s]
        for q in expired:
            del self._items[q.request.request_id]
        return expired
