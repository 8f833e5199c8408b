"""Text ↔ token ids through the model dir's `tokenizer.json` (the `tokenizers` library)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False).ids`, through `encode_batch`, which
    releases the GIL while it runs (`encode` holds it: even on another thread, a huge prompt
    would stall the event loop for as long as it takes)."""
    return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids


class TextTokenizer:
    """Encodes prompts (with the BOS token when the model has one) and decodes outputs."""

    def __init__(self, path: str | Path) -> None:
        root = Path(path)
        file = root / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}; pass token ids instead of text")
        self.tokenizer = Tokenizer.from_file(str(file))
        config_file = root / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        bos = config.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        self.bos_token_id = self.tokenizer.token_to_id(bos) if bos else None
        self.chat_template: str | None = config.get("chat_template")

    def encode(self, text: str) -> list[int]:
        ids = encode_text(self.tokenizer, text)
        return ids if self.bos_token_id is None else [self.bos_token_id, *ids]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def decode_with_specials(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, special tokens included (a logprob's token, harmony's
        header text)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


def tokenizer_dir(model: str, tokenizer: str | None) -> Path:
    """Where an engine's tokenizer lives: its `tokenizer` dir, else the model dir."""
    return Path(tokenizer or model)


def load_tokenizer(model: str, tokenizer: str | None = None) -> TextTokenizer | None:
    """The tokenizer of `tokenizer_dir(model, tokenizer)`, or None when it has no
    tokenizer.json."""
    root = tokenizer_dir(model, tokenizer)
    return TextTokenizer(root) if (root / "tokenizer.json").is_file() else None
