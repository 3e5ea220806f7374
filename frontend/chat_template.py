"""How one conversation is rendered with the chat template, beside its messages and tools:
where the prompt ends, the template's extra variables, a RAG template's documents, and a
template of the call's own. Checked when made, each error starting with the setting's name
(vLLM's request field), so both APIs can name it."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# The settings' names, the longest first: an error about one starts with its name (and
# chat_template_kwargs starts with chat_template).
SETTING_NAMES = ("continue_final_message", "chat_template_kwargs", "chat_template", "documents")


@dataclass(frozen=True, kw_only=True)
class ChatTemplateOptions:
    """``add_generation_prompt``: the prompt ends with the assistant's turn to speak;
    ``continue_final_message`` (with it false): the prompt ends inside the last message, for
    the model to go on with it. ``chat_template_kwargs``: more variables for the template
    (e.g. Qwen3's ``{"enable_thinking": False}``); ``documents``: a RAG template's sources
    (objects of strings such as ``{"title": ..., "text": ...}``); ``chat_template``: the
    call's own template instead of the model's. All vLLM's."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: the "
                "prompt either goes on with the last message or opens a new turn"
            )
        if self.chat_template_kwargs is not None:
            _check_template_kwargs(self.chat_template_kwargs, "chat_template_kwargs")
        if self.documents is not None:
            _check_documents(self.documents, "documents")
        template = self.chat_template
        if template is not None and (not isinstance(template, str) or not template.strip()):
            raise ValueError(
                f"chat_template must be a Jinja template's text, got {template!r:.100}"
            )


# OpenAI's reasoning_effort values.
REASONING_EFFORTS = ("low", "medium", "high")


def with_reasoning_effort(
    template_kwargs: Any, effort: Any, field: str = "reasoning_effort"
) -> Any:
    """``template_kwargs`` with OpenAI's ``reasoning_effort`` added as the template variable of
    the name (gpt-oss's template writes it into its system message), the request's own
    variables winning; ``ValueError`` starting with ``field`` for a value not OpenAI's. Kwargs
    that are not an object are returned as they are, for ``ChatTemplateOptions`` to refuse."""
    if effort is None:
        return template_kwargs
    if effort not in REASONING_EFFORTS:
        raise ValueError(
            f"{field} must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r:.100}"
        )
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        return template_kwargs
    return {"reasoning_effort": effort, **(template_kwargs or {})}


def message_reasoning(role: Any, reasoning: Any, field: str) -> dict[str, str]:
    """An assistant message's thinking as an earlier answer reported it, for the template:
    under ``reasoning_content`` (Qwen3's and DeepSeek's templates read it back in a
    tool-calling turn) and ``thinking`` (gpt-oss's); ``ValueError`` starting with ``field``
    on another role or a value not a string."""
    if reasoning is None:
        return {}
    if role != "assistant":
        raise ValueError(f"{field}: only an assistant's message has thinking")
    if not isinstance(reasoning, str):
        raise ValueError(f"{field} must be a string, got {reasoning!r:.100}")
    return {"reasoning_content": reasoning, "thinking": reasoning}


def _check_documents(value: object, field: str) -> None:
    if not isinstance(value, list):
        raise ValueError(f"{field} must be a list of objects of strings, got {value!r:.100}")
    for index, document in enumerate(value):
        if not isinstance(document, dict) or not all(
            isinstance(key, str) and isinstance(text, str) for key, text in document.items()
        ):
            raise ValueError(
                f"{field}[{index}] must be an object of strings, got {document!r:.100}"
            )


def _check_template_kwargs(value: object, field: str) -> None:
    """A mapping from names to values, none of them a name the rendering sets itself (the
    conversation, the tools, where the prompt ends: each has its own setting, and a second
    value for it would be ambiguous)."""
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


def check_template_allowed(chat_template: object, trusted: bool) -> None:
    """A request's own template only on a server that trusts its clients with one
    (``--trust-request-chat-template``): a template is code the server runs."""
    if chat_template is not None and not trusted:
        raise ValueError(
            "chat_template: this server does not render a request's own template (start it "
            "with --trust-request-chat-template to allow that)"
        )


# How long a request's own template may take to render, and how long its text may be: a
# template is code, and a loop in one would otherwise hold a thread of the frontend.
REQUEST_TEMPLATE_BUDGET_S = 1.0
REQUEST_TEMPLATE_MAX_CHARS = 16 << 20


@contextlib.contextmanager
def request_template_budget() -> Iterator[None]:
    """Render a request's own template within ``REQUEST_TEMPLATE_BUDGET_S``: past it, the
    render ends with ``ValueError`` naming ``chat_template``. NOTE: a trace function on this
    thread checks the clock at every line the template runs (several times slower than
    plain rendering; the model's own template is never traced)."""
    deadline_s = time.monotonic() + REQUEST_TEMPLATE_BUDGET_S

    def trace(frame, event: str, arg: object):
        if time.monotonic() > deadline_s:
            raise ValueError(
                f"chat_template: rendering took longer than {REQUEST_TEMPLATE_BUDGET_S:g} s, "
                "the limit for a request's own template"
            )
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


def check_rendered_length(text: str) -> str:
    """A request's own template's output, at most ``REQUEST_TEMPLATE_MAX_CHARS`` long."""
    if len(text) > REQUEST_TEMPLATE_MAX_CHARS:
        raise ValueError(
            f"chat_template: the template wrote {len(text)} characters; a request's own "
            f"template may write at most {REQUEST_TEMPLATE_MAX_CHARS}"
        )
    return text


# A new assistant turn after the conversation, the model's template: the usual rendering.
DEFAULT_CHAT_OPTIONS = ChatTemplateOptions()
