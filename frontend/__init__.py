"""The frontend: offline API, tokenizer, model resolution and the command line.

``LLM`` is imported on first use: it pulls in the worker (torch, the compiled ops),
which a frontend-only process such as the gRPC server must not pay for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.frontend.lora_request import LoRARequest
from pagedserve.frontend.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from pagedserve.frontend.scores import ScoringOutput, ScoringRequestOutput
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM

__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "PoolingParams",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
    "ScoringRequestOutput",
    "ScoringOutput",
    "ClassificationRequestOutput",
    "ClassificationOutput",
    "PoolingRequestOutput",
    "PoolingOutput",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagedserve.frontend.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedserve.frontend' has no attribute {name!r}")
