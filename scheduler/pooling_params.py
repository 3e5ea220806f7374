"""Per-request embedding settings (vLLM's ``PoolingParams``, its "embed" task).

A request that carries a ``PoolingParams`` computes its prompt only: no token is sampled,
and it ends in the step that computes its last prompt token, with one vector: the model's
final-norm hidden state at that token (last-token pooling), cut to ``dimensions`` and then
L2-normalized unless ``normalize=False``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from pagedserve.scheduler.sampling_params import SamplingParams

# What the scheduler's generic paths read from a pooling request's ``sampling_params``:
# one sequence, no grammar, no penalties, no logprobs. Never used to sample: the worker
# pools the request's last prompt token instead.
PROMPT_ONLY_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class PoolingParams:
    """``normalize``: divide the vector by its L2 norm (after the cut). ``dimensions``:
    keep only the first ``dimensions`` values (Matryoshka embeddings, OpenAI's
    ``dimensions``); None keeps the whole hidden state."""

    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise TypeError(f"normalize must be a bool, got {self.normalize!r}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")

    def check_dimensions(self, embedding_size: int, field: str = "dimensions") -> None:
        """``ValueError`` naming ``field`` when ``dimensions`` exceeds the model's
        ``embedding_size`` (its hidden size)."""
        if self.dimensions is not None and self.dimensions > embedding_size:
            raise ValueError(
                f"{field}={self.dimensions} exceeds the model's embedding size "
                f"({embedding_size}); it must be between 1 and {embedding_size}"
            )


def decode_embedding(data: bytes) -> list[float]:
    """A pooled vector as the engine sends it (float32, little-endian) -> floats."""
    if len(data) % 4:
        raise ValueError(f"an embedding is float32 values; got {len(data)} bytes")
    return list(struct.unpack(f"<{len(data) // 4}f", data))
