"""vLLM's ``/classify`` (``/v1/classify``) on a sequence classification model, JSON <->
the engine's: ``input`` (a string, token ids, or a batch of either) classified one
prompt-only request per input; each answer holds the probabilities over the model's
labels (its ``id2label`` order), the most probable label and the class count. Instead of
``input``, ``messages`` (vLLM's chat form) classifies one conversation rendered with the
chat template, as ``/v1/embeddings`` takes one.

``use_activation`` (vLLM's; ``activation`` its older name): false answers with the raw
logits instead of the softmax (the sigmoid for a one-label model). ``truncate_prompt_tokens``
keeps each prompt's last k tokens (-1: the context window) and ``priority`` orders it, as
for embeddings.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.frontend.openai_embeddings import PoolingApiRequest
from pagedserve.frontend.openai_fields import (
    checked_body,
    checked_priority,
    id_field,
    invalid_field,
    served_model,
    typed_field,
)
from pagedserve.frontend.openai_prompts import POOLING_CHAT_FIELDS, pooling_input_prompts
from pagedserve.frontend.outputs import most_probable_label
from pagedserve.scheduler.pooling_params import PoolingParams

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.outputs import EmbeddingRequestOutput

_CLASSIFY_FIELDS = {
    "model",
    "input",
    "truncate_prompt_tokens",
    "priority",
    "request_id",
    "user",
    "use_activation",
    "activation",
}


@dataclass(kw_only=True)
class ClassifyApiRequest(PoolingApiRequest):
    """A checked ``/classify`` request."""

    labels: tuple[str, ...]  # the model's, in its head's order


def parse_classify_request(
    body: Any,
    llm: LLM,
    served_model_name: str | tuple[str, ...],
    client_request_id: str | None,
    max_prompts: int = 1024,
    trust_request_chat_template: bool = False,
) -> ClassifyApiRequest:
    """The body of ``/classify``, checked and tokenized: ``input``, or (vLLM's chat form)
    ``messages``, one conversation rendered with the chat template; a model that does not
    classify is refused first, naming ``model`` (``OpenAiCalls`` checks every pooling call
    again)."""
    checked_body(body, _CLASSIFY_FIELDS | POOLING_CHAT_FIELDS, "classify")
    model, lora_id = served_model(body, llm, served_model_name)
    try:
        llm.check_task(PoolingParams(task="classify"))
    except ValueError as error:
        raise invalid_field(str(error), "model") from None
    prompts, from_messages = pooling_input_prompts(
        body, llm, max_prompts, trust_request_chat_template
    )
    use_activation = typed_field(body, "use_activation", (bool,), "a boolean")
    activation = typed_field(body, "activation", (bool,), "a boolean")
    if use_activation is not None and activation is not None and use_activation != activation:
        raise invalid_field(
            f"use_activation={use_activation} and activation={activation} disagree; "
            "activation is use_activation's older name: give one",
            "activation",
        )
    value = next((v for v in (use_activation, activation) if v is not None), True)
    return ClassifyApiRequest(
        model=model,
        prompts=prompts,
        params=PoolingParams(task="classify", use_activation=value),
        labels=llm.model_config.labels,
        client_request_id=id_field(body, "request_id") or client_request_id or "",
        lora_id=lora_id,
        priority=checked_priority(body, llm),
        from_messages=from_messages,
    )


def classify_response(request: ClassifyApiRequest, outputs: list[EmbeddingRequestOutput]) -> dict:
    """vLLM's answer: one classification per input, in order, and the usage."""
    data = []
    for index, output in enumerate(outputs):
        probs = output.outputs.embedding
        data.append(
            {
                "index": index,
                "label": most_probable_label(request.labels, probs),
                "probs": probs,
                "num_classes": len(probs),
            }
        )
    return {
        "id": "classify-" + (request.client_request_id or uuid.uuid4().hex),
        "object": "list",
        "created": request.created_s,
        "model": request.model,
        "data": data,
        "usage": pooling_usage(outputs),
    }


def pooling_usage(outputs: list[EmbeddingRequestOutput]) -> dict:
    """vLLM's usage of a pooling answer: the prompts' tokens, none generated."""
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
