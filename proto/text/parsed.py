"""What a model family's output parser gives back, and what they share: generated tokens in,
`Delta`s (reasoning, content, tool-call pieces) out, as the tokens stream. The families:
`harmony` (GPT-OSS) and `mimo` (MiMo-V2-Flash)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Delta:
    """A piece of parsed output: `kind` is "reasoning", "content", or "tool_call" (a call's
    arguments, `name` the function; a new call starts with `index` one higher, its first
    piece may have empty text)."""

    kind: str
    text: str
    name: str | None = None
    index: int = 0


class OutputParser:
    """The parsers' common part: token ids held until they decode to whole characters, the
    counters, and a stream chunk's finish reason."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        """`decode`: token ids → text."""
        self._decode = decode
        self._pending: list[int] = []  # content tokens not decoded yet (an incomplete char)
        self.calls = 0  # tool calls started
        self.reasoning_tokens = 0  # generated tokens of reasoning so far
        self.stop_token: str | None = None  # the stop token that ended the output, if seen

    def push(self, token_ids: Iterable[int]) -> list[Delta]:
        raise NotImplementedError

    def finish(self) -> list[Delta]:
        """The generation ended: flush what is held (a trailing incomplete character)."""
        raise NotImplementedError

    def chunk(self, token_ids: list[int], finished: bool, reason: str) -> tuple[list[Delta], str]:
        """A stream chunk's deltas (flushed when it is the last) and its finish reason, which
        becomes "tool_calls" when the generation stopped after a call."""
        parts = self.push(token_ids)
        if finished:
            parts += self.finish()
        if reason == "stop" and self.calls:
            reason = "tool_calls"
        return parts, reason

    def _take(self, final: bool) -> str:
        """The held tokens' text, or "" while they end in an incomplete UTF-8 character (at
        most 3 bytes are held) and `final` is false."""
        if not self._pending:
            return ""
        text = self._decode(self._pending)
        if not final and text.endswith("\ufffd") and len(self._pending) < 4:
            return ""
        self._pending = []
        return text
