"""Token ids → streamed text deltas, one request at a time (`IncrementalDetokenizer`).

Two things keep text back from the stream:

1. An incomplete character. A byte-level BPE token may carry part of a UTF-8 character;
   decoding then ends in U+FFFD. As vLLM and TGI do, each push decodes a small window of
   earlier tokens plus the new ones and emits the part past the window's own decode, up to the
   last new token after which it does not end in U+FFFD (this also gets right the tokenizers
   whose decode of a suffix differs from the suffix of a decode, e.g. a leading space dropped
   at the start of a decode):

       # ids:  [prefix_offset, read_offset)   the window: its text was emitted already
       #       [read_offset, len(ids))        not emitted yet
       # delta = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

2. A possible stop string. Text whose end could still begin a stop string is held until it
   either completes one (the stream ends before it) or no longer can.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what decode gives for an incomplete UTF-8 character
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens that seed the window (vLLM's initial offset)
INCOMPLETE_CHAR_TOKENS = 3  # tokens an incomplete UTF-8 character can span (3 of its 4 bytes)


class IncrementalDetokenizer:
    """Streams the text of generated tokens in final deltas, stopping at stop strings.

    Contract: while no stop string matched, the deltas of all `push` calls plus `flush()`
    join to `tokenizer.decode(all_generated_ids, skip_special_tokens=...)` for tokenizers
    whose decode concatenates at character boundaries (byte-level BPE); once one matched, to
    that decode truncated before the stop string. With several stop strings, the one that
    completes first (earliest end, then earliest start) wins, whatever the push sizes.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not one string")
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.stopped = False
        self.stop_reason: str | None = None
        self._max_stop_chars = max((len(s) for s in self.stop), default=0)
        seed = list(prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        if self._decode(seed).endswith(REPLACEMENT_CHAR):
            seed = []  # the prompt ends mid-character: its tail cannot be a clean window
        self._ids = seed
        self._prefix_offset = 0
        self._read_offset = len(seed)
        self._held = ""  # released by the window, held as a possible stop-string start
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (the join of the returned deltas)."""
        return "".join(self._pieces)

    def push(self, token_ids: list[int]) -> str:
        """Feed newly generated tokens; return the text delta that is now final ("" when
        nothing is, and always once stopped). Mutates the window, the held text and, when a
        stop string completes, `stopped` / `stop_reason`."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        return self._release(self._window_delta(final=False), final=False)

    def flush(self) -> str:
        """At the end of generation, the text still held back: a trailing incomplete
        character as decode gives it (with U+FFFD) and any held stop-string start ("" once
        stopped). A stop string completed by this text still ends the stream before it."""
        if self.stopped:
            return ""
        return self._release(self._window_delta(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _window_delta(self, final: bool) -> str:
        """Text of the tokens past the window up to the last token that ends a complete
        character (all of them when `final`); advances the window past those tokens."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        end = len(self._ids)
        # The last tokens of a push may hold an incomplete character (at most 3 of its bytes,
        # so at most 3 tokens) while the tokens before them are final.
        lowest_end = max(end - INCOMPLETE_CHAR_TOKENS, self._read_offset + 1)
        while not final and new_text.endswith(REPLACEMENT_CHAR):
            end -= 1
            if end < lowest_end:
                return ""
            new_text = self._decode(self._ids[self._prefix_offset : end])
        if len(new_text) <= len(prefix_text):
            return ""
        self._advance_window(end)
        return new_text[len(prefix_text) :]

    def _advance_window(self, end: int) -> None:
        """The window becomes [read_offset, end); tokens before it are dropped."""
        self._prefix_offset, self._read_offset = self._read_offset, end
        del self._ids[: self._prefix_offset]  # never read again
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0

    def _release(self, delta: str, final: bool) -> str:
        """Emit `held + delta` up to the first completed stop string, or all of it but the
        longest end that could begin one (nothing held back when `final`)."""
        buffer = self._held + delta
        match = self._first_stop(buffer)
        if match is not None:
            start, stop = match
            self.stopped, self.stop_reason = True, stop
            out, self._held = buffer[:start], ""
        else:
            keep = 0 if final else self._stop_prefix_chars(buffer)
            out, self._held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
        if out:
            self._pieces.append(out)
        return out

    def _first_stop(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop string that completes first in `buffer`."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self.stop:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _stop_prefix_chars(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is a proper prefix of a stop string."""
        for n in range(min(len(buffer), self._max_stop_chars - 1), 0, -1):
            tail = buffer[-n:]
            if any(stop.startswith(tail) for stop in self.stop):
                return n
        return 0
