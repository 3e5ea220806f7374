"""Scores of text pairs: vLLM's score task (its ``LLM.score``, ``/score`` and
``/rerank``), two ways, by the model:

- an embedding model (a causal LM): a pair's score is the cosine similarity of the two
  texts' embeddings. Each distinct text is embedded once, however many pairs it is in;
  the usage counts each pair's two prompts, as vLLM reports it.
- a cross-encoder (a sequence classification model with one label): the two texts are
  one input, joined as the tokenizer joins a pair (``Tokenizer.encode_pair``), and the
  score is the sigmoid of the model's one logit: a relevance in [0, 1].

The pairs follow vLLM's rule: one ``text_1`` is scored against every ``text_2`` (1:N), or
as many of each, pairwise (N:N).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pagedserve.gpu_worker.model_config import ModelConfig


@dataclass
class ScoringOutput:
    # The cosine similarity of the embeddings, in [-1, 1]; a cross-encoder's relevance, in
    # [0, 1].
    score: float


@dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair (vLLM's): ``outputs.score``; the pair's prompt
    tokens (``text_1``'s, then ``text_2``'s)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def pair_indices(num_1: int, num_2: int, names: tuple[str, str]) -> list[tuple[int, int]]:
    """The (text_1, text_2) index of each pair, in order; ``ValueError`` naming both fields
    (``names``) when the counts neither broadcast nor match."""
    if num_1 < 1 or num_2 < 1:
        empty = names[0] if num_1 < 1 else names[1]
        raise ValueError(f"{empty} is empty: give at least one text")
    if num_1 == 1:
        return [(0, j) for j in range(num_2)]
    if num_1 != num_2:
        raise ValueError(
            f"{names[0]} has {num_1} texts and {names[1]} {num_2}: give one {names[0]} to "
            f"score against every {names[1]}, or as many of each to score pairwise"
        )
    return [(i, i) for i in range(num_1)]


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms > 0.0 else 0.0


def check_cross_encoder(model_config: ModelConfig, field: str = "model") -> None:
    """``ValueError`` naming ``field`` when a classification model cannot score pairs:
    only a one-label classifier is a cross-encoder (vLLM's rule); one with more labels
    classifies."""
    num_labels = len(model_config.labels)
    if num_labels != 1:
        raise ValueError(
            f"{field}: scores need an embedding model or a cross-encoder (a classification "
            f"model with one label); this classification model has {num_labels} labels "
            f"({', '.join(model_config.labels)[:200]}): classify with it instead"
        )
