"""Plain messages between the engine's parts: the step plan and the step result.

Only ints, floats, strings, lists and nested dataclasses of those cross a boundary, so
the same messages serve an in-process call today and an explicit encoding between
processes later. A new request travels in full once; afterwards only deltas do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams

# A block-table entry whose block was given back: it lay wholly before the sliding window of
# every later query token of its sequence (``SchedulerConfig.sliding_window``), so no op
# reads it again. The entry keeps its place so that token ``t`` stays in entry
# ``t // block_size``.
NULL_BLOCK = -1


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the scored token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs computed in one step, for prompt positions ``first_position``
    onward (position 0 has none: nothing precedes it)."""

    first_position: int
    entries: list[TokenLogprobs]


@dataclass
class NewRequestData:
    """A request the worker has no state for: first scheduling, or resumed after a
    recompute preemption (then ``token_ids`` includes the tokens generated so far)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    lora_id: int = 0  # the LoRA adapter the worker applies; 0: the base model
    # Set for an embedding request: the worker pools its last prompt token, never samples.
    pooling_params: PoolingParams | None = None


@dataclass
class CachedRequestData:
    """A request the worker already holds: only what changed since the last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass
class StepPlan:
    """What one forward pass computes.

    ``finished_request_ids`` lists requests whose worker-side state must be dropped
    (finished, aborted or preempted since the previous plan); workers apply it first.
    Then they copy ``swap_out`` pairs (device block -> host block), ``swap_in`` pairs
    (host block -> device block) and ``copy_blocks`` pairs (device -> device: the
    copy-on-write of a block that sequences share and one of them is about to write),
    in that order, before the forward pass: a device block freed by a swap-out may be
    refilled by a swap-in or written in this step, and a swapped-in block may be the
    source of a copy.

    ``token_bitmasks`` maps each sequence that samples under a grammar in this step to
    the tokens it may pick: bit ``t`` of the little-endian int32 words set when token
    ``t`` is allowed (``scheduler/structured_output.py``); a speculating sequence's holds
    one such mask per position it samples, concatenated.

    ``spec_token_ids`` maps each decoding sequence that speculates in this step to its
    draft tokens (``scheduler/ngram_proposer.py``, or the draft model's from an earlier
    ``StepResult.draft_token_ids``): its scheduled tokens are its last
    token followed by them, and the worker samples at every one of those positions.

    ``window_freed_blocks`` maps a sequence whose sliding window moved past some of its
    blocks to how many leading entries of its block table are now ``NULL_BLOCK``: those
    blocks belong to the pool again, and the worker marks them so in its copy of the table.

    ``load_loras`` ((adapter id, name, directory)) and ``unload_lora_ids`` change the LoRA
    adapters the workers hold, before anything else in the step: a request of a new adapter
    may run in this very step; an unloaded one is used by no request any more.
    """

    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    token_bitmasks: dict[str, bytes] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    load_loras: list[tuple[int, str, str]] = field(default_factory=list)
    unload_lora_ids: list[int] = field(default_factory=list)
    window_freed_blocks: dict[str, int] = field(default_factory=dict)
    # Whether the workers' draft model guesses after this step (speculative decoding with a
    # draft model; off while the batch is at ``disable_by_batch_size``): it still follows
    # the step's tokens either way.
    draft_guesses: bool = True

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.cached_requests
        )

    @property
    def is_empty(self) -> bool:
        """True when the plan computes nothing (it may still drop state or swap out)."""
        return not self.new_requests and not self.cached_requests

    @property
    def has_work_for_workers(self) -> bool:
        return not self.is_empty or bool(
            self.finished_request_ids
            or self.swap_out
            or self.swap_in
            or self.copy_blocks
            or self.load_loras
            or self.unload_lora_ids
        )


@dataclass
class StepResult:
    """What the worker sampled: one token per request whose known tokens are now all in
    the cache (a partial prefill chunk samples nothing). A request that starts several
    sequences (``SamplingParams.num_sequences``) gets that many entries, in sequence
    order, at its first sample. A speculating sequence gets one entry per token it emits,
    in order: the draft tokens its sampling agreed with, then the token sampled where it
    first did not (or after the last draft).

    ``embeddings`` holds, for each pooling request whose last prompt token was computed in
    this step (and only those), its pooled vector as little-endian float32 bytes.

    ``draft_token_ids`` (speculative decoding with a draft model): for each sequence that
    sampled in this step and may speculate, the draft model's guesses at its next tokens,
    to schedule after its last token in a later step (``gpu_worker/draft_model.py``).

    ``failed_requests``: the new requests a worker could not take into its batch (request
    id -> why); the step ran without them, and the scheduler ends each with its error.

    ``launched_ahead``: the worker queued this step on the device before it read the
    tokens of the step before it (``gpu_worker/worker_process.py``'s overlap)."""

    step_id: int
    request_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    # Aligned with request_ids when any request asked for logprobs, else empty.
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    embeddings: dict[str, bytes] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    failed_requests: dict[str, str] = field(default_factory=dict)
    launched_ahead: bool = False


@dataclass
class RequestOutputDelta:
    """New tokens of one output sequence of a request from one step.

    ``index`` says which of the request's outputs (``n > 1``, beams) the tokens extend;
    ``finish_reason`` is set when that output ends, and ``finished`` when the whole
    request has (its last delta).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprobs] | None = None  # new prompt positions, when asked for
    # Prompt tokens served by the prefix cache; with the first token and on finish.
    num_cached_tokens: int | None = None
    index: int = 0
    cumulative_logprob: float | None = None  # for outputs ranked by it (best_of, beams)
    # A pooling request's vector (little-endian float32), in its one and final delta.
    embedding: bytes | None = None
    # Seconds from the request's arrival to its first admission (its time queued); sent
    # with num_cached_tokens.
    queue_time_s: float | None = None
