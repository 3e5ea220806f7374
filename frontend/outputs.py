"""What the offline API returns for each prompt."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """A function call a chat output made (tool calling): its id, the function's name and
    the arguments (JSON text of an object)."""

    id: str
    name: str
    arguments: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" (EOS, a stop token or a stop string), "length", "abort"
    finish_reason: str | None
    # With SamplingParams.logprobs=k: per generated token, {token id: logprob} holding
    # the chosen token and the k most likely ones.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    # What ended a "stop": the stop string, or the stop token's id; None for EOS.
    stop_reason: int | str | None = None
    # A chat over the server (the gRPC client) read as the HTTP API reads it: with tools,
    # the calls the output made, which `text` then leaves out ("tool_calls" is then a
    # finish_reason too); on a server with a reasoning parser, the thinking, which `text`
    # leaves out too. The offline engine leaves them empty: its text is the whole output.
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning_text: str = ""


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # With SamplingParams.prompt_logprobs=k: per prompt token, as in CompletionOutput;
    # None for the first token, which nothing predicts.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Prompt tokens whose K/V came from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    # Seconds the request waited before the scheduler first ran it (vLLM's time in queue);
    # known from the first token on, None before.
    queue_time_s: float | None = None


@dataclass
class EmbeddingOutput:
    """One pooled vector (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's): ``outputs.embedding``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None = None
    finished: bool = False
    # "stop" once the vector is in; "abort" or "error" when the request ended without one.
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    queue_time_s: float | None = None  # as RequestOutput's


@dataclass
class PoolingOutput:
    """What a pooling task made of one prompt (vLLM's ``PoolingOutput``): one vector
    ("embed", "classify") or a row per prompt token ("token_embed", "token_classify")."""

    data: list[float] | list[list[float]]


@dataclass
class PoolingRequestOutput:
    """What ``LLM.encode`` returns per prompt (vLLM's): ``outputs.data``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    task: str
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class ClassificationOutput:
    """One classification (vLLM's ``ClassificationOutput``): a value per label, in the
    model's label order: probabilities (softmax; a sigmoid for a one-label model), or the
    raw logits when asked without the activation."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What ``LLM.classify`` returns per prompt (vLLM's): ``outputs.probs``, and the
    ``label`` of the most probable class (the model's ``id2label``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    label: str
    finished: bool = True
    num_cached_tokens: int = 0


def most_probable_label(labels: tuple[str, ...], probs: list[float]) -> str:
    """The label of the largest value (the first of equal ones), as vLLM names a class."""
    return labels[max(range(len(probs)), key=probs.__getitem__)]
