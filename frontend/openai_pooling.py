"""vLLM's ``/pooling``: the pooler's output of each prompt, whatever the model's task, in one
shape. A causal LM (``task`` "embed") answers with each prompt's embedding, as
``/v1/embeddings`` would (its ``dimensions``, ``normalize``); a sequence classification
model ("classify") with the probabilities over its labels, as ``/classify`` would (its
``use_activation``: false for the raw logits, which a reward model's score is). ``input``
(a string, token ids, or a batch of either) or ``messages`` (one conversation through the
chat template), ``truncate_prompt_tokens``, ``priority`` and ``encoding_format`` (``float``,
or ``base64`` of little-endian float32) as those endpoints take them; ``task``, when given,
must be the model's. A field of the other task is refused by name.

``task`` "token_embed" (a causal LM) or "token_classify" (a classification model), vLLM's
per-token tasks, answers each input with a row per prompt token (each normalized, or
through the classifier head): ``data`` a list of rows, or with ``base64`` the rows' float32
values one row after another.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.frontend import openai_classify as classify
from pagedserve.frontend import openai_embeddings as embeddings
from pagedserve.frontend.openai_embeddings import PoolingApiRequest
from pagedserve.frontend.openai_fields import checked_body, invalid_field, typed_field
from pagedserve.frontend.openai_prompts import POOLING_CHAT_FIELDS
from pagedserve.scheduler.pooling_params import split_rows

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.outputs import EmbeddingRequestOutput

POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")
# Each task's own fields (the other task's are refused by name).
_TASK_FIELDS = {
    "embed": ("dimensions", "normalize"),
    "classify": ("use_activation", "activation"),
}
_SHARED_FIELDS = {
    "model",
    "input",
    "encoding_format",
    "truncate_prompt_tokens",
    "priority",
    "request_id",
    "user",
    "task",
}
_POOLING_FIELDS = _SHARED_FIELDS | {name for names in _TASK_FIELDS.values() for name in names}


@dataclass
class PoolingCall:
    """A checked ``/pooling`` body: the embeddings or classify request it runs as, and how
    the answer encodes its values."""

    request: PoolingApiRequest
    encoding_format: str  # "float" or "base64"
    task: str = "embed"


def parse_pooling_request(
    body: Any,
    llm: LLM,
    served_model_name: str | tuple[str, ...],
    client_request_id: str | None,
    max_prompts: int = 1024,
    trust_request_chat_template: bool = False,
) -> PoolingCall:
    """The body of ``/pooling``, checked and tokenized as the model's task's endpoint
    checks it."""
    checked_body(body, _POOLING_FIELDS | POOLING_CHAT_FIELDS, "pooling")
    model_task = "classify" if llm.model_config.task == "classify" else "embed"
    task = typed_field(body, "task", (str,), "a string", model_task)
    if task not in POOLING_TASKS:
        raise invalid_field(
            f"task must be one of {', '.join(POOLING_TASKS)}, got {task!r:.50}", "task"
        )
    base_task = task.removeprefix("token_")
    if base_task != model_task:
        raise invalid_field(
            f"task={task!r}: model {llm.model_config.declared_architecture} pools for "
            f"{model_task!r} and 'token_{model_task}' only",
            "task",
        )
    other_task = "classify" if base_task == "embed" else "embed"
    for name in _TASK_FIELDS[other_task]:
        if body.get(name) is not None:
            raise invalid_field(
                f"{name} is a setting of task {other_task!r}; this model pools for {task!r}",
                name,
            )
    encoding_format = embeddings.checked_encoding_format(body)
    # What the task's own parser reads: the rest was checked here.
    own = {k: v for k, v in body.items() if k not in ("task", "encoding_format")}
    parse = (
        embeddings.parse_embedding_request
        if base_task == "embed"
        else classify.parse_classify_request
    )
    request = parse(
        own,
        llm,
        served_model_name,
        client_request_id,
        max_prompts,
        trust_request_chat_template=trust_request_chat_template,
    )
    if task != base_task:  # a row per prompt token, each as the task's one vector
        request.params = dataclasses.replace(request.params, task=task, pooling_type="LAST")
    return PoolingCall(request, encoding_format, task)


def pooling_response(call: PoolingCall, outputs: list[EmbeddingRequestOutput]) -> dict:
    """vLLM's answer: one ``pooling`` object per input, in order (its values as floats or
    base64), and the usage."""
    data = [
        {"index": index, "object": "pooling", "data": _encoded(call, output)}
        for index, output in enumerate(outputs)
    ]
    request = call.request
    return {
        "id": "pool-" + (request.client_request_id or uuid.uuid4().hex),
        "object": "list",
        "created": request.created_s,
        "model": request.model,
        "data": data,
        "usage": classify.pooling_usage(outputs),
    }


def _encoded(call: PoolingCall, output: EmbeddingRequestOutput) -> Any:
    """One input's values as the call sends them: a vector, or a per-token task's rows (as
    base64: all rows' values in one run, row after row)."""
    values = output.outputs.embedding
    if not call.task.startswith("token_") or call.encoding_format == "base64":
        return embeddings.encoded_vector(values, call.encoding_format)
    return split_rows(values, len(output.prompt_token_ids))
