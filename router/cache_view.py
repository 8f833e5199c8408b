"""Pages as the router's cache views file them (`page_tokens`, `page_keys`) and the views'
shared error. The views: `ExactCacheView` (`exact_view.py`), rebuilt from the KV events of the
workers that send them, page for page; `ApproxCacheView` (`approx_view.py`), the prompts routed
to workers that send none. Both answer a prompt's match by the window rule of `window_walk.py`.
Worker ids in the views are small ints (bit positions); the router maps its worker ids onto them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

PageKey = int | bytes
"""A page's tokens: the token itself when P = 1, else its P tokens as little-endian uint32
(4P bytes: a third of a tuple's size, without an int object per token)."""

_KEY_TOKEN_BYTES = 4
_TOKEN_LIMIT = 1 << 32


def page_tokens(token_ids: Sequence[int], page_size: int) -> np.ndarray:
    """The whole pages of `token_ids` as uint32, up to the page of the first token that is not
    an int in [0, 2^32) (no page can hold one)."""
    n = len(token_ids) // page_size * page_size
    try:
        return np.frombuffer(struct.pack(f"<{n}I", *token_ids[:n]), np.uint32)
    except struct.error:
        bad = next(
            i for i, t in enumerate(token_ids) if type(t) is not int or not 0 <= t < _TOKEN_LIMIT
        )
        return page_tokens(token_ids[: bad // page_size * page_size], page_size)


def page_keys(token_ids: Sequence[int], page_size: int) -> Sequence[PageKey]:
    """The keys of the whole pages of `token_ids`, as the trie files them. With P > 1, pages
    from the first token outside [0, 2^32) on have none (no page can hold such a token)."""
    if page_size == 1:
        return token_ids
    data = page_tokens(token_ids, page_size).tobytes()
    step = _KEY_TOKEN_BYTES * page_size
    return [data[i : i + step] for i in range(0, len(data), step)]


class CacheViewCorrupted(AssertionError):
    """`check()` found a broken invariant of a cache view."""
