"""Which chat format a model speaks, from its tokenizer's tokens, and the output parser for it:

    harmony   GPT-OSS: harmony's special tokens (`<|start|>`, `<|channel|>`, ...)
    mimo      MiMo-V2-Flash: `<|im_end|>`, `<think>`, `</think>`, `<tool_call>`, `</tool_call>`

A model with neither has no parser: its output is plain text."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swaserve.proto.text import harmony, mimo
from swaserve.proto.text.parsed import OutputParser
from swaserve.proto.text.tokenizer import TextTokenizer

HARMONY, MIMO = "harmony", "mimo"


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """A model's chat format: its name and its tokens' ids."""

    name: str
    special_ids: dict[str, int]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end an assistant's output (a final answer or a tool call)."""
        names = harmony.STOP_TOKENS if self.name == HARMONY else mimo.STOP_TOKENS
        return tuple(self.special_ids[t] for t in names if t in self.special_ids)

    def parser(
        self,
        tokenizer: TextTokenizer,
        prompt_ids: Sequence[int] = (),
        tools: dict[str, Any] | None = None,
    ) -> OutputParser:
        """A fresh parser for one output that follows `prompt_ids`; `tools`: function name →
        its parameters' schema (MiMo's XML values are typed by it)."""
        if self.name == HARMONY:
            return harmony.StreamParser(self.special_ids, tokenizer.decode_with_specials)
        return mimo.StreamParser(
            self.special_ids,
            tokenizer.decode_with_specials,
            in_reasoning=mimo.prompt_in_reasoning(prompt_ids, self.special_ids),
            tools=tools,
        )


@functools.lru_cache(maxsize=8)
def chat_format(tokenizer: TextTokenizer | None) -> ChatFormat | None:
    """The format `tokenizer`'s model speaks, or None (plain text); looked up once per
    tokenizer (every request of a server asks)."""
    if tokenizer is None:
        return None
    ids = harmony.special_ids(tokenizer.tokenizer)
    if ids is not None:
        return ChatFormat(HARMONY, ids)
    ids = mimo.special_ids(tokenizer.tokenizer)
    return None if ids is None else ChatFormat(MIMO, ids)
