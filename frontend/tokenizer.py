"""Text <-> token ids and the chat template, from the model directory's tokenizer files."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Tokenizer:
    """A thin owner of the HF tokenizer: the one place that turns text into ids."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.vocab_size = len(self._tokenizer)

    @staticmethod
    def exists_in(path: Path) -> bool:
        return any(
            (path / name).is_file()
            for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        if not getattr(self._tokenizer, "chat_template", None):
            raise ValueError("messages: this model's tokenizer has no chat template")
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
