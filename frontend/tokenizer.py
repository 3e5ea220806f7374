"""Text <-> token ids and the chat template, from the model directory's tokenizer files."""

from __future__ import annotations

import copy
import functools
import threading
from pathlib import Path
from typing import Any

from pagedserve.frontend.chat_template import (
    DEFAULT_CHAT_OPTIONS,
    ChatTemplateOptions,
    check_rendered_length,
    request_template_budget,
)


def preload() -> None:
    """Import what loading a tokenizer needs (transformers, and torch with it: seconds).
    The server does this before it opens its port, so its event loop is not starved of
    the GIL by these imports on the engine thread while it answers health checks."""
    from transformers import AutoTokenizer  # noqa: F401


class Tokenizer:
    """A thin owner of the HF tokenizer: the one place that turns text into ids."""

    def __init__(self, path: Path, chat_template: str | None = None) -> None:
        """``chat_template``: a Jinja template used instead of the model's own."""
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(path))
        self._chat_template = chat_template
        #: Lowercase every text before encoding it (a sentence-transformers model's
        #: ``do_lower_case``: its model saw only lowercased text).
        self.lower_case = False
        self.vocab_size = len(self._tokenizer)
        # The Rust tokenizer, when there is one: decoding through it directly skips
        # transformers' per-call overhead (about 3x), paid once per generated token.
        self._backend = self._tokenizer.backend_tokenizer if self._tokenizer.is_fast else None
        self._pair_tokenizer: Any = None  # encode_pair's own copy, made when first needed
        self._pair_lock = threading.Lock()
        if self._backend is not None:
            added_tokens = self._backend.get_added_tokens_decoder().items()
            special_ids = [token_id for token_id, token in added_tokens if token.special]
        else:
            special_ids = self._tokenizer.all_special_ids
        #: The ids ``decode(..., skip_special_tokens=True)`` leaves out.
        self.special_token_ids: frozenset[int] = frozenset(special_ids)
        #: Their texts as written (``<|im_end|>``).
        self.special_token_texts: frozenset[str] = frozenset(
            self.token_text(token_id) for token_id in special_ids
        )

    @property
    def hf_tokenizer(self) -> Any:
        """The Hugging Face tokenizer this wraps (for callers that want its whole API)."""
        return self._tokenizer

    @staticmethod
    def exists_in(path: Path) -> bool:
        return any(
            (path / name).is_file()
            for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.lower_case:
            text = text.lower()
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_pair(self, text: str, text_pair: str, max_length: int | None = None) -> list[int]:
        """The two texts as one input, joined as the tokenizer joins a pair (its special
        tokens around and between them): a cross-encoder's input. ``max_length``: cut to
        that many tokens, from the longer text first (HF's ``longest_first``)."""
        if self.lower_case:
            text, text_pair = text.lower(), text_pair.lower()
        # NOTE: truncation is a setting of the Rust tokenizer, changed per call; changed
        # while another thread encodes with it, it fails ("Already borrowed"). Pairs get a
        # copy of their own, one call at a time.
        with self._pair_lock:
            if self._pair_tokenizer is None:
                self._pair_tokenizer = copy.deepcopy(self._tokenizer)
            return list(
                self._pair_tokenizer(
                    text,
                    text_pair=text_pair,
                    truncation=max_length is not None,
                    max_length=max_length,
                )["input_ids"]
            )

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``, without transformers' clean-up of spaces before
        punctuation, which no incremental decoding could reproduce."""
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._tokenizer.decode(
            token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def backend_json(self) -> str | None:
        """The Rust tokenizer serialized (``tokenizer.json``'s format, added tokens
        included), without padding or truncation; None for a slow tokenizer."""
        if self._backend is None:
            return None
        backend = copy.copy(self._backend)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    def single_token_id(self, text: str) -> int | None:
        """The id of the one token that ``text`` encodes to (a marker such as ``<think>``
        that the vocabulary holds whole), or None when it takes several."""
        token_ids = self.encode(text, add_special_tokens=False)
        return token_ids[0] if len(token_ids) == 1 else None

    def token_text(self, token_id: int) -> str:
        """A special token's text as written (``<|im_end|>``), without the decoder."""
        return self._tokenizer.convert_ids_to_tokens(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: ChatTemplateOptions = DEFAULT_CHAT_OPTIONS,
    ) -> str:
        """The conversation as the template writes it (the call's own template, or the
        model's), ending as ``options`` say; ``tools`` (OpenAI's function tools) and the
        options' documents and variables go to the template, which may show them."""
        template = (
            options.chat_template
            or self._chat_template
            or getattr(self._tokenizer, "chat_template", None)
        )
        if not template:
            raise ValueError(
                "messages: this model's tokenizer has no chat template (give one: chat_template)"
            )
        render = functools.partial(
            self._tokenizer.apply_chat_template,
            messages,
            tools=tools,
            documents=options.documents,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **(options.chat_template_kwargs or {}),
        )
        if options.chat_template is None:
            return render()
        with request_template_budget():  # the request's own: code from a client
            return check_rendered_length(render())
