"""Similarity scores from embeddings: vLLM's score task for embedding models (its
``LLM.score``, ``/score`` and ``/rerank``), where a pair's score is the cosine similarity
of the two texts' embeddings.

The pairs follow vLLM's rule: one ``text_1`` is scored against every ``text_2`` (1:N), or
as many of each, pairwise (N:N). Each distinct text is embedded once, however many pairs
it is in; the usage counts each pair's two prompts, as vLLM reports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass
class ScoringOutput:
    score: float  # cosine similarity, in [-1, 1]


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
