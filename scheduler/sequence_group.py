"""A request that runs several sequences over one prompt: parallel samples or beams."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.beam_search import BeamSearch, num_candidates
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass
class SequenceGroup:
    """The sequences of one request, scheduled, preempted and finished as a unit.

    It starts as one sequence (the request id itself) that prefills the prompt once.
    Parallel sampling forks it into ``best_of`` sequences at the first sampled token;
    beam search forks and drops sequences at every step. Forks share all blocks by
    reference count; the block manager copies a shared block when one of them first
    writes into it. Child sequences are named ``<request id>#<k>``.
    """

    request_id: str
    params: SamplingParams
    seed: int | None
    # Live sequences; for beam search in score order, best first.
    sequences: list[Request] = field(default_factory=list)
    # Parallel sampling: sequences that have ended, kept for the final ranking.
    finished: list[Request] = field(default_factory=list)
    beam_search: BeamSearch | None = None
    # Beam search: the candidates each live beam reported for the current position.
    pending_candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    num_cached_tokens: int = 0
    _next_child_number: int = 1

    @classmethod
    def create(cls, parent: Request) -> SequenceGroup:
        params = parent.sampling_params
        group = cls(parent.request_id, params, params.seed, [parent])
        if params.use_beam_search:
            stop_token_ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                stop_token_ids.update(parent.eos_token_ids)
            group.beam_search = BeamSearch(
                beam_width=params.beam_width,
                length_penalty=params.length_penalty,
                early_stopping=params.early_stopping,
                max_new_tokens=params.max_tokens,
                stop_token_ids=frozenset(stop_token_ids),
                num_keep=num_candidates(params.beam_width, len(parent.eos_token_ids)),
            )
        parent.group = group
        return group

    @property
    def streams_outputs(self) -> bool:
        """Whether outputs can be reported token by token: each sample is one output.
        Beams and ``best_of > n`` samples are ranked only at the end."""
        return self.beam_search is None and self.params.num_sequences == self.params.n

    @property
    def is_finished(self) -> bool:
        return not self.sequences

    def new_child_id(self) -> str:
        child_id = f"{self.request_id}#{self._next_child_number}"
        self._next_child_number += 1
        return child_id

    def best_samples(self) -> list[Request]:
        """The ``n`` finished samples with the highest cumulative log-probability."""
        ranked = sorted(self.finished, key=lambda seq: -seq.cumulative_logprob)
        return ranked[: self.params.n]
