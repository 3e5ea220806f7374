"""Text <-> token ids and the chat template, from the model directory's tokenizer files."""

from __future__ import annotations

import copy
import functools
import inspect
from pathlib import Path
from typing import Any


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
        self.vocab_size = len(self._tokenizer)
        # The Rust tokenizer, when there is one: decoding through it directly skips
        # transformers' per-call overhead (about 3x), paid once per generated token.
        self._backend = self._tokenizer.backend_tokenizer if self._tokenizer.is_fast else None
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

    @staticmethod
    def exists_in(path: Path) -> bool:
        return any(
            (path / name).is_file()
            for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

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
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        documents: list[dict[str, str]] | None = None,
    ) -> str:
        """The conversation as the template writes it, ending with the assistant's turn
        (``add_generation_prompt``) or open inside the last message, for the model to go on
        with it (``continue_final_message``); ``tools`` (OpenAI's function tools) and
        ``documents`` (a RAG template's sources) go to the template, which may show them.
        ``template_kwargs``: more variables for the template (vLLM's
        ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``), checked first with
        ``check_template_kwargs``. ``chat_template``: this call's template instead of the
        tokenizer's (vLLM's per-request one)."""
        template = (
            chat_template or self._chat_template or getattr(self._tokenizer, "chat_template", None)
        )
        if not template:
            raise ValueError(
                "messages: this model's tokenizer has no chat template (give one: chat_template)"
            )
        return self._tokenizer.apply_chat_template(
            messages,
            tools=tools,
            documents=documents,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )


def check_documents(value: object, field: str) -> list[dict[str, str]]:
    """``value`` as a RAG template's documents (vLLM's ``documents``: a list of objects of
    strings, such as ``{"title": ..., "text": ...}``), or a ``ValueError`` naming the
    entry."""
    if not isinstance(value, list):
        raise ValueError(f"{field} must be a list of objects of strings, got {value!r:.100}")
    for index, document in enumerate(value):
        if not isinstance(document, dict) or not all(
            isinstance(key, str) and isinstance(text, str) for key, text in document.items()
        ):
            raise ValueError(
                f"{field}[{index}] must be an object of strings, got {document!r:.100}"
            )
    return value


def check_template_kwargs(value: object, field: str) -> dict[str, Any]:
    """``value`` as extra chat-template variables, or a ``ValueError`` starting with
    ``field``: a mapping from names to values, none of them a name the rendering sets
    itself (the conversation, the tools, where the prompt ends: each has its own field,
    and a second value for it would be ambiguous)."""
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be an object of template variables, got {value!r:.100}")
    reserved = _reserved_template_names()
    for name in value:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{field}: {name!r:.100} is not a template variable name")
        if name in reserved:
            raise ValueError(
                f"{field}.{name}: set by the rendering itself, not a variable a request may "
                f"set (reserved: {', '.join(sorted(reserved))})"
            )
    return value


@functools.cache
def _reserved_template_names() -> frozenset[str]:
    """The keywords of transformers' ``apply_chat_template`` (its own settings, and what it
    passes to the template: ``tools``, ``documents``, ``add_generation_prompt``) and the
    ``messages`` it renders."""
    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    names = {
        name
        for name, parameter in parameters.items()
        if name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD
    }
    return frozenset(names | {"messages"})
