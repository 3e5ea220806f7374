"""Requests of several sequences (``n``, ``best_of``, beams) as the scheduler steps them (a
part of ``Scheduler``): forks at the first sample, a beam step's next beams, a sample
stopped early, outputs ranked at the end, and how a group sits in the queues."""

from __future__ import annotations

from collections import deque

from pagedserve.scheduler.messages import RequestOutputDelta, StepResult
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.sequence_group import SequenceGroup


class GroupSteps:
    """``Scheduler``'s steps of sequence groups (a mixin)."""

    def stop_sample(self, request_id: str, index: int) -> RequestOutputDelta | None:
        """End output ``index`` of a parallel-sampling request whose samples stream (a stop
        string found by the frontend): its sequence leaves the batch and frees its blocks,
        the other samples run on. Returns the request's final delta when that was its last
        running sample, else ``None`` (also for an unknown request, a sample that has already
        ended, and beams or ``best_of > n`` samples, which are ranked only at the end)."""
        group = self.groups.get(request_id)
        if group is None or not group.streams_outputs:
            return None
        sequence = next((seq for seq in group.sequences if seq.sample_index == index), None)
        if sequence is None:
            return None
        self._release(sequence, RequestStatus.FINISHED_STOPPED)
        if not group.is_finished:
            return None
        return RequestOutputDelta(
            request_id,
            [],
            finished=True,
            finish_reason="stop",
            index=sequence.sample_index,
        )

    def _advance_samples(
        self,
        request: Request,
        rows: list[int],
        result: StepResult,
        prompt_logprobs: list | None,
        deltas: list[RequestOutputDelta],
    ) -> None:
        """Record the sampled tokens of a parallel-sampling sequence; its first sample
        comes as ``best_of`` rows, and the sequence forks into that many."""
        group = request.group
        sequences = [request]
        if len(rows) > 1:
            # Forks copy the tokens before the parent appends its own sample.
            position = self.running.index(request) + 1
            for sample_index in range(1, len(rows)):
                child = request.fork(group.new_child_id(), sample_index)
                self.block_manager.fork(request.request_id, child.request_id)
                self.requests[child.request_id] = child
                group.sequences.append(child)
                sequences.append(child)
            self.running[position:position] = sequences[1:]
        wants_logprobs = request.sampling_params.logprobs is not None
        for sequence, row in zip(sequences, rows):
            token_id = result.sampled_token_ids[row]
            logprobs = result.logprobs[row] if result.logprobs else None
            if logprobs is not None:
                sequence.cumulative_logprob += logprobs.logprobs[0]
                if wants_logprobs and not group.streams_outputs:
                    sequence.output_logprobs.append(logprobs)
            status = sequence.append_output_token(token_id)
            finished = status.is_finished
            if finished:
                self._release(sequence, status)
            if group.streams_outputs:
                first_or_last = finished or sequence.num_output_tokens == 1
                deltas.append(
                    RequestOutputDelta(
                        group.request_id,
                        [token_id],
                        finished=group.is_finished,
                        finish_reason=status.value if finished else None,
                        logprobs=[logprobs] if wants_logprobs else None,
                        prompt_logprobs=prompt_logprobs if sequence is request else None,
                        num_cached_tokens=sequence.num_cached_tokens if first_or_last else None,
                        queue_time_s=sequence.queue_time_s if first_or_last else None,
                        index=sequence.sample_index,
                        cumulative_logprob=sequence.cumulative_logprob
                        if logprobs is not None
                        else None,
                    )
                )
            elif prompt_logprobs and sequence is request:
                deltas.append(
                    RequestOutputDelta(group.request_id, [], False, prompt_logprobs=prompt_logprobs)
                )
        if group.is_finished and not group.streams_outputs:
            ranked = [
                (
                    sequence.output_token_ids,
                    sequence.status.value,
                    sequence.cumulative_logprob,
                    sequence.output_logprobs if wants_logprobs else None,
                )
                for sequence in group.best_samples()
            ]
            deltas.extend(_ranked_deltas(group.request_id, ranked, request))

    def _beam_step(self, group: SequenceGroup, deltas: list[RequestOutputDelta]) -> None:
        """All beams of ``group`` have reported their candidates: pick the next beams,
        forking the beams chosen more than once and dropping those not chosen."""
        beams = list(group.sequences)
        first = beams[0]
        step = group.beam_search.step(
            beam_scores=[beam.cumulative_logprob for beam in beams],
            beam_output_token_ids=[beam.output_token_ids for beam in beams],
            candidates=[group.pending_candidates[beam.request_id] for beam in beams],
            max_generated_tokens=first.max_total_tokens - first.num_prompt_tokens,
        )
        group.pending_candidates.clear()
        position = min(self.running.index(beam) for beam in beams)
        self.running = [sequence for sequence in self.running if sequence.group is not group]
        if step.done:
            for beam in beams:
                self._release(beam, RequestStatus.FINISHED_STOPPED)
            ranked = [
                (h.output_token_ids, h.finish_reason, h.cumulative_logprob, None)
                for h in group.beam_search.best(group.params.n)
            ]
            deltas.extend(_ranked_deltas(group.request_id, ranked, first))
            return
        continuing: list[Request] = []
        reused: set[int] = set()
        for next_beam in step.next_beams:
            parent = beams[next_beam.parent]
            if next_beam.parent in reused:
                child = parent.fork(group.new_child_id(), parent.sample_index)
                self.block_manager.fork(parent.request_id, child.request_id)
                self.requests[child.request_id] = child
                continuing.append(child)
            else:
                reused.add(next_beam.parent)
                continuing.append(parent)
        # Tokens are appended only now: forks copied their parent's tokens before.
        for sequence, next_beam in zip(continuing, step.next_beams):
            sequence.token_ids.append(next_beam.token_id)
            sequence.cumulative_logprob = next_beam.score
            # The workers sampled their own token for it: they get it anew.
            self._forget_on_workers(sequence.request_id)
        group.sequences = continuing
        for index, beam in enumerate(beams):
            if index not in reused:
                self._release(beam, RequestStatus.FINISHED_ABORTED)
        self.running[position:position] = continuing


def batch_slots(sequences: list[Request]) -> int:
    """Batch slots a queued request's ``sequences`` take when they resume: a group that has
    not sampled yet (new, or preempted mid-prefill, by swap too) forks into its full size at
    its first sample, so room is kept for that (``Scheduler._num_batch_slots`` counts it so)."""
    head = sequences[0]
    if head.group is not None and head.num_output_tokens == 0:
        return head.sampling_params.num_sequences
    return len(sequences)


def leading_sequences(queue: deque[Request]) -> list[Request]:
    """The queue's first request: its one sequence, or its group's sequences (adjacent
    at the front)."""
    head = queue[0]
    if head.group is None:
        return [head]
    sequences = []
    for request in queue:
        if request.group is not head.group:
            break
        sequences.append(request)
    return sequences


def _ranked_deltas(
    request_id: str,
    ranked: list[tuple[list[int], str, float, list | None]],
    first: Request,
) -> list[RequestOutputDelta]:
    """The final deltas of outputs reported only at the end (best_of > n, beams): one per
    output, best first, each ``(token ids, finish reason, cumulative logprob, logprobs)``;
    the last one ends the request. ``first``: the group's first sequence (its cached
    tokens and time queued are the request's)."""
    return [
        RequestOutputDelta(
            request_id,
            token_ids,
            finished=rank == len(ranked) - 1,
            finish_reason=finish_reason,
            logprobs=logprobs,
            num_cached_tokens=first.num_cached_tokens,
            queue_time_s=first.queue_time_s,
            index=rank,
            cumulative_logprob=cumulative_logprob,
        )
        for rank, (token_ids, finish_reason, cumulative_logprob, logprobs) in enumerate(ranked)
    ]
