"""One step of beam search over the candidates the workers scored, as HF transformers
decides it (``GenerationMixin._beam_search``), so the same model gives the same beams.

The workers return, for each running beam, its top ``num_candidates(...)`` next tokens
with their log-probabilities; this module picks the next beams and the finished
hypotheses. Scores are float32 sums, as in HF (its running scores are a float32 tensor):
a near-tie between two beams must break the same way.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# HF pushes candidates that may not continue (or may not finish) down by this much.
_LARGE_PENALTY = -1.0e9


def float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (what HF's tensors hold)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def num_candidates(beam_width: int, num_eos_token_ids: int) -> int:
    """Candidates kept per step (and so scored per beam): enough that ``beam_width`` of
    them still continue when the best ones all end in an EOS token."""
    return max(2, 1 + num_eos_token_ids) * beam_width


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens and its length-penalized score."""

    score: float
    output_token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str  # "stop" (an EOS or stop token) or "length"


@dataclass
class NextBeam:
    """A running beam for the next step: ``parent`` (index into this step's beams)
    extended by ``token_id``, with the new cumulative log-probability."""

    parent: int
    token_id: int
    score: float


@dataclass
class BeamStepResult:
    next_beams: list[NextBeam]
    done: bool


@dataclass
class BeamSearch:
    """The state of one request's beam search beyond its running beams."""

    beam_width: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int
    # Tokens that end a beam (EOS unless ignored, and stop_token_ids).
    stop_token_ids: frozenset[int]
    # Candidates kept per step: num_candidates(beam_width, number of EOS ids).
    num_keep: int
    # Finished hypotheses, best first, at most beam_width.
    finished: list[Hypothesis] = field(default_factory=list)
    # Whether a running beam may still beat the worst finished hypothesis (sticky).
    improvement_possible: bool = True

    def step(
        self,
        beam_scores: list[float],
        beam_output_token_ids: list[list[int]],
        candidates: list[list[tuple[int, float]]],
        max_generated_tokens: int,
    ) -> BeamStepResult:
        """Advance the search by one token.

        ``beam_scores[b]`` is running beam ``b``'s cumulative log-probability (beams in
        score order, best first), ``beam_output_token_ids[b]`` its generated tokens so
        far (all beams have as many), ``candidates[b]`` its top next tokens as
        ``(token_id, logprob)``; ``max_generated_tokens`` caps the length (max_tokens,
        or less where max_model_len binds).
        """
        width = self.beam_width
        num_generated = len(beam_output_token_ids[0])
        new_length = num_generated + 1
        scored = [
            (float32(beam_scores[beam] + logprob), beam, rank, token_id)
            for beam, beam_candidates in enumerate(candidates)
            for rank, (token_id, logprob) in enumerate(beam_candidates)
        ]
        # Best first; equal scores in (beam, rank) order, as a flattened top-k would.
        scored.sort(key=lambda entry: (-entry[0], entry[1], entry[2]))
        top = scored[: self.num_keep]
        at_max_length = new_length >= max_generated_tokens

        def ends(token_id: int) -> bool:
            return at_max_length or token_id in self.stop_token_ids

        # Finished hypotheses: only the top beam_width candidates may join them.
        full = len(self.finished) >= width
        may_finish = self.improvement_possible and not (full and self.early_stopping is True)
        if may_finish:
            divisor = float32(new_length**self.length_penalty)
            for score, beam, _, token_id in top[:width]:
                if ends(token_id):
                    self.finished.append(
                        Hypothesis(
                            score=float32(score / divisor),
                            output_token_ids=[*beam_output_token_ids[beam], token_id],
                            cumulative_logprob=score,
                            finish_reason="length"
                            if token_id not in self.stop_token_ids
                            else "stop",
                        )
                    )
            # Stable: an earlier hypothesis wins a tie, as HF's merge keeps it first.
            self.finished.sort(key=lambda hypothesis: -hypothesis.score)
            del self.finished[width:]

        continuing = [entry for entry in top if not ends(entry[3])]
        next_beams = [NextBeam(beam, token_id, score) for score, beam, _, token_id in continuing]
        next_beams = next_beams[:width]

        if len(self.finished) >= width and next_beams:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_length = self.max_new_tokens
            else:
                best_length = new_length
            best_possible = float32(next_beams[0].score / float32(best_length**self.length_penalty))
            worst_finished = self.finished[-1].score
            self.improvement_possible = self.improvement_possible and best_possible > worst_finished
        done = (
            not next_beams
            or not self.improvement_possible
            or (len(self.finished) >= width and self.early_stopping is True)
        )
        return BeamStepResult(next_beams, done)

    def best(self, count: int) -> list[Hypothesis]:
        """The ``count`` best finished hypotheses, best first."""
        return self.finished[:count]
