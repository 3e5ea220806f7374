"""One request's counters: its tokens, how many of them are in the KV cache, its state."""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams, derive_seed

if TYPE_CHECKING:
    from pagedserve.scheduler.sequence_group import SequenceGroup
    from pagedserve.scheduler.structured_output import GrammarMatcher

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self not in (
            RequestStatus.WAITING,
            RequestStatus.RUNNING,
            RequestStatus.SWAPPED,
        )


@dataclass
class Request:
    """A request as the scheduler tracks it.

    One accounting model covers prefill, chunked prefill and decode: ``token_ids`` holds
    the prompt followed by the generated tokens, ``num_computed_tokens`` says how many of
    them already have K/V in the cache, and each step moves the second toward the first::

        token_ids:  [ p0 p1 p2 p3 p4 | o0 o1 ]
                      <-- computed -->  ^ next step computes from here
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time_s: float
    max_model_len: int
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Requests in different namespaces never share cached prefixes.
    cache_namespace: str | None = None
    # Prompt tokens found in the prefix cache at first admission.
    num_cached_tokens: int = 0
    # Prompt positions whose logprobs were already reported; a recompute after
    # preemption scores them again, and those repeats are dropped.
    num_prompt_logprobs_reported: int = 1
    # Requests with several sequences (n > 1, best_of, beams): each sequence is one of
    # these, with its own id and block table; the group ties them together.
    group: SequenceGroup | None = None
    # Which sample of its group this sequence is (its seed derives from it).
    sample_index: int = 0
    cumulative_logprob: float = 0.0
    # Per-token logprobs kept for outputs reported only at the end (best_of > n).
    output_logprobs: list = field(default_factory=list)
    # Where the output stands in its grammar (SamplingParams.structured_outputs).
    grammar: GrammarMatcher | None = None
    # The LoRA adapter its tokens run through (0: the base model).
    lora_id: int = 0
    # Which rotation its K/V are computed with (SchedulerConfig.rotation_epoch; 1: a
    # LongRoPE sequence rotated with the long factors): set when its computation starts
    # from its first token.
    rotation_epoch: int = 0
    # Under the priority policy requests run in (priority, arrival_index) order, lower
    # first; arrival_index is the scheduler's count of requests added before this one.
    priority: int = 0
    arrival_index: int = 0
    # An embedding request: it computes its prompt, then ends with the pooled vector.
    pooling_params: PoolingParams | None = None
    # Seconds from arrival to the first admission (None until then); later admissions,
    # after a preemption, do not count.
    queue_time_s: float | None = None
    # The workers' draft model's guesses at the tokens after ``token_ids`` (speculative
    # decoding with a draft model; StepResult.draft_token_ids), for its next step.
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def group_request_id(self) -> str:
        """The id its outputs carry: its group's (several sequences), or its own."""
        return self.request_id if self.group is None else self.group.request_id

    def fork(self, child_id: str, sample_index: int) -> Request:
        """A new sequence of the same group with this one's tokens so far (its K/V are
        shared through the block manager's ``fork``)."""
        params = self.sampling_params
        if sample_index != self.sample_index and params.seed is not None:
            params = replace(params, seed=derive_seed(self.group.seed, sample_index))
        child = Request(
            request_id=child_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time_s=self.arrival_time_s,
            max_model_len=self.max_model_len,
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            num_preemptions=self.num_preemptions,
            cache_namespace=self.cache_namespace,
            num_cached_tokens=self.num_cached_tokens,
            num_prompt_logprobs_reported=self.num_prompt_logprobs_reported,
            group=self.group,
            sample_index=sample_index,
            cumulative_logprob=self.cumulative_logprob,
            grammar=None if self.grammar is None else self.grammar.fork(),
            lora_id=self.lora_id,
            rotation_epoch=self.rotation_epoch,
            priority=self.priority,
            arrival_index=self.arrival_index,
            queue_time_s=self.queue_time_s,
        )
        child.token_ids = list(self.token_ids)
        return child

    @property
    def rank(self) -> tuple[int, int]:
        """Its place under the priority policy: lower runs first."""
        return (self.priority, self.arrival_index)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @functools.cached_property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold: prompt plus max_tokens, capped
        (a pooling request: its prompt). Fixed from the start (read at every step: kept)."""
        if self.pooling_params is not None:
            return self.num_prompt_tokens
        return min(self.num_prompt_tokens + self.sampling_params.max_tokens, self.max_model_len)

    def append_output_token(self, token_id: int) -> RequestStatus:
        """Record a sampled token and return the status it leaves the request in."""
        self.token_ids.append(token_id)
        params = self.sampling_params
        if self.grammar is not None:
            if not self.grammar.accept(token_id):
                # The sampler allows only the grammar's tokens, so this is an engine fault;
                # the output so far is still inside the grammar.
                logger.error(
                    "request %s: token %d is outside its grammar (%s); stopping it",
                    self.request_id,
                    token_id,
                    self.grammar.error,
                )
                return RequestStatus.FINISHED_STOPPED
            if self.grammar.is_finished:
                # Nothing may follow: the output is complete (even with ignore_eos).
                return RequestStatus.FINISHED_STOPPED
        # The sampler masks EOS and stop tokens until min_tokens are out; this keeps
        # the rule true for tokens that arrive any other way.
        num_tokens = len(self.token_ids)
        if num_tokens - len(self.prompt_token_ids) > params.min_tokens and (
            (not params.ignore_eos and token_id in self.eos_token_ids)
            or token_id in params.stop_token_ids
        ):
            return RequestStatus.FINISHED_STOPPED
        if num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return RequestStatus.RUNNING
