"""Per-request pooling settings (vLLM's ``PoolingParams``: its "embed" and "classify" tasks).

A request that carries a ``PoolingParams`` computes its prompt only: no token is sampled,
and it ends in the step that computes its last prompt token, with one vector pooled from
the model's final-norm hidden state at that token (last-token pooling):

- ``task="embed"`` (a causal LM): the hidden state (``pooling_type`` "LAST"; "MEAN": the
  mean over every prompt token's state; "CLS": the first token's, as the model's
  sentence-transformers config says, ``frontend/pooler_config.py``), cut to ``dimensions``
  and then L2-normalized unless ``normalize=False``.
- ``task="classify"`` (a sequence classification model, ``*ForSequenceClassification``):
  the classifier head's logits over the model's labels, through a softmax (a sigmoid for a
  one-label model, a cross-encoder's relevance) unless ``use_activation=False``.
- ``task="token_embed"`` / ``"token_classify"`` (vLLM's per-token tasks): the same at every
  prompt token, a row per token (each row cut and normalized, or through the head and its
  activation), for token-level rewards and multi-vector retrieval. The rows come from every
  chunk of the prompt (the worker keeps a chunk's rows until the last), and such a request
  takes no prefix-cache hit: a cached token is never computed, so it would have no row.

Which tasks a model serves is its ``model_task`` (``check_task``): a causal LM generates and
embeds; a classification model only classifies (it has no LM head).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from pagedserve.scheduler.sampling_params import SamplingParams

# What the scheduler's generic paths read from a pooling request's ``sampling_params``:
# one sequence, no grammar, no penalties, no logprobs. Never used to sample: the worker
# pools the request's last prompt token instead.
PROMPT_ONLY_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)

POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# A model's task: "generate" (a causal LM: generation and embedding requests) or "classify"
# (a sequence classification model: classification requests only).
MODEL_TASKS = ("generate", "classify")


@dataclass(frozen=True)
class PoolingParams:
    """``normalize``: divide the vector by its L2 norm (after the cut). ``dimensions``:
    keep only the first ``dimensions`` values (Matryoshka embeddings, OpenAI's
    ``dimensions``); None keeps the whole hidden state. Both are the embed task's.
    ``task``: "embed" or "classify", or their per-token forms "token_embed" and
    "token_classify" (a row per prompt token). ``use_activation``: the classify task's
    softmax (or sigmoid); False gives the raw logits. ``pooling_type``: which tokens'
    states the one vector pools (``POOLING_TYPES``; the model's, set by the engine); "MEAN"
    and "CLS" need the whole prompt computed in the request's one step (no chunks, no
    prefix-cache hits)."""

    normalize: bool = True
    dimensions: int | None = None
    task: str = "embed"
    use_activation: bool = True
    pooling_type: str = "LAST"

    def __post_init__(self) -> None:
        for name in ("normalize", "use_activation"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.task not in POOLING_TASKS:
            raise ValueError(
                f"task must be one of {', '.join(map(repr, POOLING_TASKS))}, got {self.task!r}"
            )
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        if self.task == "classify" and self.pooling_type != "LAST":
            raise ValueError(
                f"pooling_type={self.pooling_type!r}: a classifier's head reads the last "
                "token (LAST), as HF's does"
            )
        if self.base_task == "classify" and self.dimensions is not None:
            raise ValueError(
                f"dimensions={self.dimensions!r} is the embed task's; a classification has "
                "one value per label"
            )
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")

    @property
    def per_token(self) -> bool:
        """A row per prompt token ("token_embed", "token_classify"), not one vector."""
        return self.task.startswith("token_")

    @property
    def base_task(self) -> str:
        """ "embed" or "classify": what each row (or the one vector) is."""
        return self.task.removeprefix("token_")

    def check_dimensions(self, embedding_size: int, field: str = "dimensions") -> None:
        """``ValueError`` naming ``field`` when ``dimensions`` exceeds the model's
        ``embedding_size`` (its hidden size)."""
        if self.dimensions is not None and self.dimensions > embedding_size:
            raise ValueError(
                f"{field}={self.dimensions} exceeds the model's embedding size "
                f"({embedding_size}); it must be between 1 and {embedding_size}"
            )


def check_task(model_task: str, pooling_params: PoolingParams | None) -> None:
    """``ValueError`` for a request the model cannot serve: a generation (no
    ``pooling_params``) or an embedding on a classification model, a classification on a
    causal LM."""
    task = "generate" if pooling_params is None else pooling_params.base_task
    if model_task == "classify" and task != "classify":
        raise ValueError(
            f"this model is a sequence classification model (its head scores labels, it has "
            f"no LM head): it serves classification and cross-encoder scores, not the "
            f"{task} task"
        )
    if model_task == "generate" and task == "classify":
        raise ValueError(
            "this model is a causal LM, not a sequence classification model "
            "(*ForSequenceClassification): it has no classifier head; it serves generation "
            "and embeddings"
        )


def decode_embedding(data: bytes) -> list[float]:
    """A pooled vector as the engine sends it (float32, little-endian) -> floats."""
    if len(data) % 4:
        raise ValueError(f"an embedding is float32 values; got {len(data)} bytes")
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def split_rows(values: list[float], num_rows: int) -> list[list[float]]:
    """A per-token task's values (``decode_embedding``'s, rows one after another) as
    ``num_rows`` rows, one per prompt token."""
    if num_rows < 1 or len(values) % num_rows:
        raise ValueError(f"{len(values)} values are not {num_rows} rows of one width")
    width = len(values) // num_rows
    return [values[start : start + width] for start in range(0, len(values), width)]
