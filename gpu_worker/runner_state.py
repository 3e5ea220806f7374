"""What the model runner keeps: each request's state between steps (``CachedRequestState``),
a step's entries and inputs, and a launched step awaiting its tokens (``LaunchedStep``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.gpu_worker.decode_batch import DecodeBatch
from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.sampler import SamplerOutput
from pagedserve.gpu_worker.step_events import StepEvent
from pagedserve.scheduler.beam_search import num_candidates
from pagedserve.scheduler.messages import PromptLogprobsChunk, StepPlan
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the worker keeps per request between steps, so plans carry only deltas."""

    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    lora_id: int = 0  # 0: the base model
    pooling_params: PoolingParams | None = None  # an embedding request: never samples
    # A per-token pooling request's rows from the prompt's chunks before its last.
    pooled_rows: list[torch.Tensor] = field(default_factory=list)
    # No penalty, bias, allowed list, ban (bad words, min_tokens) or beam: nothing of the
    # sampler's per-row extras applies, so a batch of such rows skips looking for them.
    plain_sampling: bool = field(init=False, default=False)

    # Besides plain sampling: one sequence, no prompt log-probs, no pooling. Its decode can
    # be queued before the token it decodes reaches the host (ModelRunner.follows).
    plain_decode: bool = field(init=False, default=False)
    # (temperature, top_k, top_p, min_p, num_logprobs): the sampler's settings of each of
    # its rows, gathered once rather than attribute by attribute every step.
    sampler_row: tuple[float, int, float, float, int] = field(init=False)

    def __post_init__(self) -> None:
        params = self.sampling_params
        self.sampler_row = (
            params.temperature,
            params.top_k,
            params.top_p,
            params.min_p,
            self.num_logprobs,
        )
        self.plain_sampling = not (
            params.has_penalties
            or params.logit_bias
            or params.allowed_token_ids
            or params.bad_words_token_ids
            or params.min_tokens
            or params.use_beam_search
        )
        self.plain_decode = (
            self.plain_sampling
            and self.pooling_params is None
            and params.num_sequences == 1
            and params.prompt_logprobs is None
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_samples(self) -> int:
        """Tokens to draw at this sample: a request of several parallel samples draws
        them all at its first token (the scheduler forks it into that many sequences);
        beams fork from the candidates instead."""
        params = self.sampling_params
        if self.num_output_tokens == 0 and not params.use_beam_search:
            return params.num_sequences
        return 1

    @property
    def num_logprobs(self) -> int:
        """Top tokens to report with each sample (-1: none): what the user asked for, the
        candidates of a beam, or just the chosen token's for ranking ``best_of``."""
        params = self.sampling_params
        if params.use_beam_search:
            return num_candidates(params.beam_width, len(self.eos_token_ids))
        if params.logprobs is not None:
            return params.logprobs
        return 0 if params.num_sequences > params.n else -1


@dataclass
class ScheduledEntry:
    request_id: str
    state: CachedRequestState
    num_computed_tokens: int
    num_scheduled_tokens: int
    # Draft tokens scheduled after the last known token (StepPlan.spec_token_ids).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step computes the last known token, so a new one is sampled."""
        end = self.num_computed_tokens + self.num_scheduled_tokens
        return end == len(self.state.token_ids) + len(self.spec_token_ids)

    def draft_states(self) -> list[CachedRequestState]:
        """The state each position of a speculating entry samples from: the sequence as
        it would be had the drafts before that position been accepted (penalties,
        min_tokens and the seeded draw depend on the tokens so far)."""
        state = self.state
        return [state] + [
            CachedRequestState(
                state.token_ids + self.spec_token_ids[:count],
                state.num_prompt_tokens,
                state.block_ids,
                state.sampling_params,
                state.eos_token_ids,
            )
            for count in range(1, len(self.spec_token_ids) + 1)
        ]

    @property
    def prompt_logprob_positions(self) -> range:
        """Prompt positions this step scores: position t predicts prompt token t + 1."""
        if self.state.sampling_params.prompt_logprobs is None:
            return range(0)
        end = min(
            self.num_computed_tokens + self.num_scheduled_tokens, self.state.num_prompt_tokens - 1
        )
        return range(self.num_computed_tokens, max(end, self.num_computed_tokens))


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampling], rows of the hidden states to sample
    # One per sampled row; an entry drawing several samples, or speculating, appears once
    # per row (consecutively).
    sampling_entries: list[ScheduledEntry]
    # The state each row samples from (a speculating entry's rows: its draft_states).
    sampling_states: list[CachedRequestState]
    # The seed of each sampled row (None: the request's own).
    sample_seeds: list[int | None]
    # (entry, first row of its tokens in the batch) for entries scoring prompt positions
    prompt_logprob_entries: list[tuple[ScheduledEntry, int]]
    # (pooling entry, its rows in this step, its last prompt token's last) for those that
    # end in this step
    pooling_entries: list[tuple[ScheduledEntry, slice]]


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are queued on the device; ``finish`` reads
    its tokens once ``event`` says they are there."""

    plan: StepPlan
    failed: dict[str, str]
    entries: list[ScheduledEntry]
    event: StepEvent
    # Which entries sample, from before their sampled tokens join their states.
    samples: list[bool] = field(default_factory=list)
    inputs: ModelInputs | None = None  # None: no entry ran
    hidden: torch.Tensor | None = None
    sampled: SamplerOutput | None = None  # None: nothing sampled
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    embeddings: dict[str, bytes] = field(default_factory=dict)
    # Launched behind a step whose tokens were not read yet (StepResult.launched_ahead).
    launched_ahead: bool = False
    # A step of plain decodes only, run from these arrays (no ``entries``, no ``inputs``).
    decode_batch: DecodeBatch | None = None

    def single_rows(self) -> dict[str, int]:
        """Each request that samples exactly one token (the next of its sequence), and its
        row of ``sampled``: a following step may decode that token before it is read."""
        if self.decode_batch is not None:
            return self.decode_batch.row_of
        if self.sampled is None or self.inputs is None:
            return {}
        rows: dict[str, int] = {}
        repeated = set()
        for row, entry in enumerate(self.inputs.sampling_entries):
            if entry.request_id in rows:
                repeated.add(entry.request_id)
            rows[entry.request_id] = row
        for request_id in repeated:
            del rows[request_id]
        return rows
