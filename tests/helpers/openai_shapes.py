"""Checks of the HTTP API's bodies against the official ``openai`` SDK's own types, strictly:
the SDK's pydantic models accept what they do not know (``extra="allow"``) and coerce
types, so a field OpenAI lacks, or a string where OpenAI sends a number, would pass them
unnoticed. ``assert_openai_shape`` validates with the model in strict mode and then walks
the result: every unknown field anywhere fails, named by its path."""

from __future__ import annotations

import re
from typing import Any, Literal

import pydantic
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion import Completion
from openai.types.completion_choice import CompletionChoice
from openai.types.create_embedding_response import CreateEmbeddingResponse
from openai.types.model import Model
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent


class _CompletionChunkChoice(CompletionChoice):
    finish_reason: Literal["stop", "length", "content_filter"] | None = None


class CompletionChunk(Completion):
    """A legacy completion's stream chunk. The SDK reads chunks as ``Completion``, whose
    ``finish_reason`` is never null, while OpenAI's own stream sends null until the last
    chunk: this is ``Completion`` with that one field optional."""

    choices: list[_CompletionChunkChoice]


SHAPES: dict[str, Any] = {
    "chat.completion": ChatCompletion,
    "chat.completion.chunk": ChatCompletionChunk,
    "text_completion": Completion,
    "text_completion.chunk": CompletionChunk,
    "embeddings": CreateEmbeddingResponse,
    "model": Model,
    "response": Response,
    "response event": ResponseStreamEvent,
    "response item list": ResponseItemList,
}


# The only fields allowed beyond OpenAI's, by path (list indices as []): vLLM's additions,
# which its users read, and pagedserve's vocab_size, which load generators draw token ids
# below (docs/openai_api.md).
EXTENSION_FIELDS = {
    "chat.completion.choices[].stop_reason",
    "chat.completion.chunk.choices[].stop_reason",
    "text_completion.choices[].stop_reason",
    "text_completion.chunk.choices[].stop_reason",
    "embeddings.id",
    "embeddings.created",
    "model.root",
    "model.parent",
    "model.max_model_len",
    "model.vocab_size",
}


def assert_openai_shape(kind: str, body: Any) -> None:
    """``body`` (decoded JSON) is exactly a ``SHAPES[kind]`` of the SDK: it validates
    strictly and has no field the SDK's types do not declare, but ``EXTENSION_FIELDS``."""
    adapter = pydantic.TypeAdapter(SHAPES[kind])
    try:
        value = adapter.validate_python(body, strict=True)
    except pydantic.ValidationError as error:
        raise AssertionError(f"not an openai {kind}: {error}\n{body}") from None
    extras = [path for path in _extras(value, kind) if re.sub(r"\[\d+\]", "[]", path)
              not in EXTENSION_FIELDS]  # fmt: skip
    assert not extras, f"fields the openai SDK's {kind} does not have: {extras}\n{body}"


def _extras(value: Any, path: str):
    """The paths of every undeclared field in a validated value."""
    if isinstance(value, pydantic.BaseModel):
        for name in value.model_extra or {}:
            yield f"{path}.{name}"
        for name in type(value).model_fields:
            yield from _extras(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _extras(item, f"{path}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _extras(item, f"{path}[{key!r}]")
