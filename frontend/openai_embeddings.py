"""OpenAI's ``/v1/embeddings``: the body checked and tokenized into prompts and one
``PoolingParams``, the answer as floats or base64; and the pooling request every pooling API
(embeddings, classify, ``/pooling``) checks its body into.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.frontend.openai_fields import (
    checked_body,
    checked_priority,
    id_field,
    int_field,
    invalid_field,
    served_model,
    typed_field,
)
from pagedserve.frontend.openai_prompts import (
    POOLING_CHAT_FIELDS,
    Prompt,
    input_names,
    pooling_input_prompts,
)
from pagedserve.scheduler.pooling_params import PoolingParams

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.outputs import EmbeddingRequestOutput

# OpenAI's fields, and vLLM's additions (truncate_prompt_tokens, normalize, priority,
# request_id).
_EMBEDDING_FIELDS = {
    "model",
    "input",
    "encoding_format",
    "dimensions",
    "user",
    "truncate_prompt_tokens",
    "normalize",
    "priority",
    "request_id",
}
EMBEDDING_ENCODING_FORMATS = ("float", "base64")


@dataclass(kw_only=True)
class PoolingApiRequest:
    """A checked pooling request of ``input`` prompts (embeddings, classifications): its
    prompts and their one ``PoolingParams``."""

    model: str
    prompts: list[Prompt]
    params: PoolingParams
    client_request_id: str
    lora_id: int = 0
    priority: int = 0
    created_s: int = field(default_factory=lambda: int(time.time()))
    from_messages: bool = False  # the one prompt is a conversation (vLLM's chat form)

    @property
    def prompt_names(self) -> list[str]:
        return ["messages"] if self.from_messages else input_names(len(self.prompts))


@dataclass(kw_only=True)
class EmbeddingApiRequest(PoolingApiRequest):
    """A checked ``/v1/embeddings`` request."""

    encoding_format: str  # "float" or "base64" (little-endian float32, as OpenAI sends)


def parse_embedding_request(
    body: Any,
    llm: LLM,
    served_model_name: str | tuple[str, ...],
    client_request_id: str | None,
    max_prompts: int = 1024,
    trust_request_chat_template: bool = False,
) -> EmbeddingApiRequest:
    """The body of ``/v1/embeddings``, checked and tokenized: ``input`` as a string, token
    ids, or a batch of either, or (vLLM's chat form) ``messages``, one conversation
    rendered with the chat template (``pooling_input_prompts``; a request's own
    ``chat_template`` when ``trust_request_chat_template``); ``dimensions`` in [1, the
    model's hidden size];
    ``truncate_prompt_tokens`` keeps a prompt's last k tokens (-1: the context window), as
    vLLM does; a prompt longer than the context window is refused."""
    checked_body(body, _EMBEDDING_FIELDS | POOLING_CHAT_FIELDS, "embeddings")
    model, lora_id = served_model(body, llm, served_model_name)
    prompts, from_messages = pooling_input_prompts(
        body, llm, max_prompts, trust_request_chat_template
    )
    encoding_format = checked_encoding_format(body)
    dimensions = int_field(body, "dimensions", 1, llm.model_config.embedding_size)
    normalize = typed_field(body, "normalize", (bool,), "a boolean")
    priority = checked_priority(body, llm)
    return EmbeddingApiRequest(
        model=model,
        prompts=prompts,
        params=llm.embedding_params(normalize, dimensions),
        encoding_format=encoding_format,
        client_request_id=id_field(body, "request_id") or client_request_id or "",
        lora_id=lora_id,
        priority=priority,
        from_messages=from_messages,
    )


def checked_encoding_format(body: dict) -> str:
    """A pooling body's ``encoding_format``: "float" (the default) or "base64"."""
    encoding_format = typed_field(body, "encoding_format", (str,), "a string", "float")
    if encoding_format not in EMBEDDING_ENCODING_FORMATS:
        raise invalid_field(
            f"encoding_format must be 'float' or 'base64', got {encoding_format!r:.100}",
            "encoding_format",
        )
    return encoding_format


def encoded_vector(values: list[float], encoding_format: str) -> list[float] | str:
    """A pooled vector as ``encoding_format`` sends it: the floats, or "base64" of their
    little-endian float32 bytes (as OpenAI sends embeddings)."""
    if encoding_format != "base64":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def embedding_response(request: EmbeddingApiRequest, outputs: list[EmbeddingRequestOutput]) -> dict:
    """OpenAI's answer: one ``embedding`` object per input, in order, and the usage."""
    data = []
    for index, output in enumerate(outputs):
        values = encoded_vector(output.outputs.embedding, request.encoding_format)
        data.append({"object": "embedding", "embedding": values, "index": index})
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {
        "id": "embd-" + (request.client_request_id or uuid.uuid4().hex),
        "object": "list",
        "created": request.created_s,
        "model": request.model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
