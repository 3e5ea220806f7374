"""vLLM's ``/score`` and ``/rerank`` (Jina's and Cohere's rerank shape), JSON <-> the
engine's (``scores.py``), on either kind of model:

- an embedding model (a causal LM): the bodies checked and tokenized into the distinct
  texts to embed and the pairs to score; each pair's score the cosine similarity of its
  texts' embeddings.
- a cross-encoder (a one-label classification model): one prompt per pair, the texts
  joined as the tokenizer joins a pair; each pair's score its classification (the sigmoid
  of the logit).

- ``/score``: ``text_1`` (a string, or a list) against ``text_2`` (a string, or a list):
  one ``text_1`` against every ``text_2``, or pairwise; ``data[i].score`` per pair.
- ``/rerank``: a ``query`` against ``documents`` (a list of strings); ``results`` sorted by
  ``relevance_score``, best first, the first ``top_n`` (0: all), each with its ``index``
  in ``documents`` and the ``document`` itself.

Both take ``truncate_prompt_tokens`` (each text's last k tokens; -1: the context window)
and ``priority``, as vLLM does.
"""

from __future__ import annotations

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
)
from pagedserve.frontend.openai_prompts import (
    Prompt,
    check_prompt_length,
    pooling_prompts,
    truncate_prompt_tokens,
)
from pagedserve.frontend.scores import check_cross_encoder, cosine_similarity, pair_indices
from pagedserve.scheduler.pooling_params import PoolingParams

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.outputs import EmbeddingRequestOutput

_COMMON_FIELDS = {"model", "truncate_prompt_tokens", "priority", "request_id", "user"}
_SCORE_FIELDS = _COMMON_FIELDS | {"text_1", "text_2"}
_RERANK_FIELDS = _COMMON_FIELDS | {"query", "documents", "top_n"}
# A cross-encoder's pair through its one label's sigmoid.
CROSS_ENCODER_POOLING_PARAMS = PoolingParams(task="classify")


@dataclass
class ScoreApiRequest:
    """A checked ``/score`` or ``/rerank`` request: the distinct texts to embed (the first
    side's, then the second's) and the pairs to score, as indices into them; for a
    cross-encoder, one prompt per pair (pair k is ``(k, k)``)."""

    kind: str  # "score" or "rerank"
    model: str
    prompts: list[Prompt]
    prompt_names: list[str]  # each prompt's field, as errors name it ("text_2[3]")
    pairs: list[tuple[int, int]]
    client_request_id: str
    # The embeddings' (the model's pooling, normalized), or a cross-encoder's classify.
    params: PoolingParams
    documents: list[str] = field(default_factory=list)  # rerank: answered with each result
    top_n: int = 0  # rerank: how many results (0: all)
    lora_id: int = 0
    priority: int = 0
    created_s: int = field(default_factory=lambda: int(time.time()))

    @property
    def cross_encoder(self) -> bool:
        return self.params.task == "classify"


def _texts(body: dict, name: str, single_allowed: bool = True) -> list[str]:
    value = body.get(name)
    if isinstance(value, str) and single_allowed:
        return [value]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return value
    what = (
        "a string or a non-empty list of strings"
        if single_allowed
        else ("a non-empty list of strings")
    )
    if value is None:
        raise invalid_field(f"{name} is required: {what}", name)
    raise invalid_field(f"{name} must be {what}, got {value!r:.200}", name)


def _prompts(body: dict, name: str, texts: list[str], llm: LLM, max_prompts: int) -> list[Prompt]:
    return pooling_prompts({**body, name: texts}, llm, max_prompts, name)


def _names(name: str, count: int) -> list[str]:
    return [name] if count == 1 else [f"{name}[{i}]" for i in range(count)]


def parse_score_request(
    body: Any,
    llm: LLM,
    served_model_name: str | tuple[str, ...],
    client_request_id: str | None,
    max_prompts: int = 1024,
) -> ScoreApiRequest:
    body = checked_body(body, _SCORE_FIELDS, "score")
    model, lora_id = served_model(body, llm, served_model_name)
    texts_1 = _texts(body, "text_1")
    texts_2 = _texts(body, "text_2")
    try:
        pairs = pair_indices(len(texts_1), len(texts_2), ("text_1", "text_2"))
    except ValueError as error:
        raise invalid_field(str(error), "text_2") from None
    return _request(
        "score", body, llm, model, lora_id, client_request_id, max_prompts,
        ("text_1", texts_1), ("text_2", texts_2), pairs,
    )  # fmt: skip


def parse_rerank_request(
    body: Any,
    llm: LLM,
    served_model_name: str | tuple[str, ...],
    client_request_id: str | None,
    max_prompts: int = 1024,
) -> ScoreApiRequest:
    body = checked_body(body, _RERANK_FIELDS, "rerank")
    model, lora_id = served_model(body, llm, served_model_name)
    query = body.get("query")
    if not isinstance(query, str):
        raise invalid_field(f"query must be a string, got {query!r:.200}", "query")
    documents = _texts(body, "documents", single_allowed=False)
    top_n = int_field(body, "top_n", 0) or 0
    request = _request(
        "rerank", body, llm, model, lora_id, client_request_id, max_prompts,
        ("query", [query]), ("documents", documents), [(0, j) for j in range(len(documents))],
    )  # fmt: skip
    request.documents = documents
    request.top_n = top_n
    return request


def _request(
    kind: str,
    body: dict,
    llm: LLM,
    model: str,
    lora_id: int,
    client_request_id: str | None,
    max_prompts: int,
    first: tuple[str, list[str]],
    second: tuple[str, list[str]],
    pairs: list[tuple[int, int]],
) -> ScoreApiRequest:
    """The checked request: both sides' texts tokenized (each named by its field), and
    ``pairs`` (indices into each side) as indices into all the prompts; on a
    cross-encoder, each pair tokenized as one prompt."""
    (first_name, first_texts), (second_name, second_texts) = first, second
    common = dict(
        kind=kind,
        model=model,
        client_request_id=id_field(body, "request_id") or client_request_id or "",
        lora_id=lora_id,
        priority=checked_priority(body, llm),
    )
    if llm.model_config.task == "classify":
        prompts, names = _pair_prompts(body, llm, first, second, pairs, max_prompts)
        return ScoreApiRequest(
            prompts=prompts,
            prompt_names=names,
            pairs=[(k, k) for k in range(len(pairs))],
            params=CROSS_ENCODER_POOLING_PARAMS,
            **common,
        )
    prompts = _prompts(body, first_name, first_texts, llm, max_prompts)
    prompts += _prompts(body, second_name, second_texts, llm, max_prompts)
    offset = len(first_texts)
    return ScoreApiRequest(
        prompts=prompts,
        prompt_names=_names(first_name, len(first_texts)) + _names(second_name, len(second_texts)),
        pairs=[(i, offset + j) for i, j in pairs],
        # Normalized whatever the model's default: the dot product of two is their cosine.
        params=llm.embedding_params(normalize=True),
        **common,
    )


def _pair_prompts(
    body: dict,
    llm: LLM,
    first: tuple[str, list[str]],
    second: tuple[str, list[str]],
    pairs: list[tuple[int, int]],
    max_prompts: int,
) -> tuple[list[Prompt], list[str]]:
    """A cross-encoder's prompts: each pair's texts joined by the tokenizer (cut to
    ``truncate_prompt_tokens``, from the longer text first, as vLLM's cross-encoders cut),
    named by the second text's field."""
    try:
        check_cross_encoder(llm.model_config, "model")
    except ValueError as error:
        raise invalid_field(str(error), "model") from None
    (first_name, first_texts), (second_name, second_texts) = first, second
    if len(pairs) > max_prompts:
        raise invalid_field(
            f"{second_name}: {len(pairs)} pairs exceed the {max_prompts} prompts one request "
            "may hold",
            second_name,
        )
    if llm.tokenizer is None:
        raise invalid_field(
            f"{first_name}: a cross-encoder joins each pair's texts with the tokenizer, and "
            f"{str(llm.model_path)!r} has none",
            first_name,
        )
    truncate = truncate_prompt_tokens(body, llm)
    names = _names(second_name, len(second_texts))
    prompts = []
    for i, j in pairs:
        token_ids = llm.tokenizer.encode_pair(first_texts[i], second_texts[j], truncate)
        if not token_ids:
            raise invalid_field(
                f"{names[j]}: the pair ({first_name} and {names[j]}) is empty; it needs at "
                "least 1 token",
                names[j],
            )
        prompt = Prompt(None, token_ids)
        check_prompt_length(prompt, llm, names[j])
        prompts.append(prompt)
    return prompts, [names[j] for _i, j in pairs]


def _scored(
    request: ScoreApiRequest, outputs: list[EmbeddingRequestOutput]
) -> list[tuple[float, int]]:
    """Each pair's score and prompt tokens, in the pairs' order."""
    if request.cross_encoder:
        return [(output.outputs.embedding[0], len(output.prompt_token_ids)) for output in outputs]
    scored = []
    for i, j in request.pairs:
        first, second = outputs[i], outputs[j]
        score = cosine_similarity(first.outputs.embedding, second.outputs.embedding)
        scored.append((score, len(first.prompt_token_ids) + len(second.prompt_token_ids)))
    return scored


def _response_id(prefix: str, request: ScoreApiRequest) -> str:
    return prefix + (request.client_request_id or uuid.uuid4().hex)


def score_response(request: ScoreApiRequest, outputs: list[EmbeddingRequestOutput]) -> dict:
    scored = _scored(request, outputs)
    prompt_tokens = sum(tokens for _score, tokens in scored)
    return {
        "id": _response_id("score-", request),
        "object": "list",
        "created": request.created_s,
        "model": request.model,
        "data": [
            {"index": index, "object": "score", "score": score}
            for index, (score, _tokens) in enumerate(scored)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
        },
    }


def rerank_response(request: ScoreApiRequest, outputs: list[EmbeddingRequestOutput]) -> dict:
    scored = _scored(request, outputs)
    results = [
        {"index": index, "document": {"text": request.documents[index]}, "relevance_score": score}
        for index, (score, _tokens) in enumerate(scored)
    ]
    # Best first; sorting is stable, so equal scores keep the documents' order.
    results.sort(key=lambda result: result["relevance_score"], reverse=True)
    if request.top_n:
        results = results[: request.top_n]
    return {
        "id": _response_id("rerank-", request),
        "model": request.model,
        "usage": {"total_tokens": sum(tokens for _score, tokens in scored)},
        "results": results,
    }
