"""N-gram drafts for speculative decoding (issue #44, the drafter without a model): propose the
tokens that followed the latest earlier occurrence of the sequence's own suffix.

For a request whose tokens so far are t[0..n), the longest suffix t[n-m..n) with
`min_n <= m <= max_n` that also ends at an earlier position e < n proposes
t[e..e+k) (at most k tokens, fewer near the end). Agent and code-edit workloads repeat their
context, so these drafts are often right; a wrong one costs only its verification.

The index is incremental: per n-gram length m, the end position of the latest occurrence of each
m-gram seen, updated as tokens arrive (O(max_n) per token, no scan of the history).

    # tokens  a b c d x a b c   (n = 8), max_n = 3, k = 2
    # suffix "a b c" last ended at 3 (before the current one at 8): propose t[3..5) = "d x"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from swaserve.worker.engine.request import Request


class NgramIndex:
    """One request's n-gram index over its tokens (prompt, then output) as they arrive."""

    def __init__(self, *, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # m -> m-gram -> end position (exclusive) of its latest occurrence before the newest
        self._latest: dict[int, dict[tuple[int, ...], int]] = {
            m: {} for m in range(min_n, max_n + 1)
        }
        # m -> the m-gram ending at the newest position and that position (recorded once the
        # next token arrives, so that a lookup never finds the suffix itself)
        self._pending: dict[int, tuple[tuple[int, ...], int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens (the prompt at first, then each accepted output token)."""
        for token in tokens:
            for m, (gram, end) in self._pending.items():
                self._latest[m][gram] = end
            self._pending.clear()
            self.tokens.append(int(token))
            n = len(self.tokens)
            for m in range(self.min_n, min(self.max_n, n) + 1):
                self._pending[m] = (tuple(self.tokens[n - m :]), n)

    def propose(self, k: int) -> list[int]:
        """Up to `k` draft tokens: what followed the latest earlier occurrence of the longest
        matching suffix; [] when no suffix of length >= min_n occurred before."""
        if k <= 0:
            return []
        for m in range(min(self.max_n, len(self.tokens)), self.min_n - 1, -1):
            gram = self._pending[m][0]
            end = self._latest[m].get(gram)
            if end is not None:
                return self.tokens[end : end + k]
        return []


class Drafter(Protocol):
    """What the scheduler asks of a drafter: n-gram (`NgramDrafter`) or MTP
    (`engine.mtp.MTPDrafter`)."""

    def new_step(self) -> None: ...

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to `k` drafts to follow `req`'s tokens so far."""
        ...


INDEX_TOKENS_PER_STEP = 8192
"""Tokens of context the drafter indexes per step beyond each request's newest few: a long
prompt's index is built over several steps (about 2 µs a token), not in one that stalls every
running request."""
CAUGHT_UP = 64
"""A request this close to its index's end is brought up to date whatever the budget."""


class NgramDrafter:
    """The engine's n-gram drafter: each request keeps its own `NgramIndex`
    (`Request.draft_index`), made at its first proposal and brought up to date from the
    request's tokens at each one (so retraction, migration and resumption need nothing). A
    request whose index lags its tokens by more than `CAUGHT_UP` catches up within the step's
    budget (`INDEX_TOKENS_PER_STEP`, shared by the step's requests) and proposes nothing until
    it is up to date. The index holds about 0.4 KB per token of the request's context (its
    n-grams of `min_n`..`max_n` tokens)."""

    def __init__(
        self, *, min_n: int, max_n: int, index_budget: int = INDEX_TOKENS_PER_STEP
    ) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.index_budget = index_budget
        self._budget = index_budget

    def new_step(self) -> None:
        """A new step: its indexing budget is whole again."""
        self._budget = self.index_budget

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to `k` drafts to follow `req`'s tokens so far ([] while its index catches up)."""
        index = req.draft_index
        if index is None:
            index = req.draft_index = NgramIndex(min_n=self.min_n, max_n=self.max_n)
        known, n = len(index.tokens), req.seq_len
        if n - known > CAUGHT_UP:
            take = min(n - known, self._budget)
            self._budget -= take
            index.extend(req.token_slice(known, known + take))
            if known + take < n:
                return []
        elif known < n:
            index.extend(req.token_slice(known, n))
        return index.propose(k)
