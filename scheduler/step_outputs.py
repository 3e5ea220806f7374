"""A step's results recorded in the scheduler's sequences (a part of ``Scheduler``): tokens
computed and sampled, stop checks, pooled vectors, prompt logprobs, accepted drafts, and the
deltas each request reports; a request whose recording fails ends alone."""

from __future__ import annotations

import logging

from pagedserve.scheduler import fault_injection
from pagedserve.scheduler.messages import (
    CachedRequestData,
    NewRequestData,
    RequestOutputDelta,
    StepPlan,
    StepResult,
)
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.sequence_group import SequenceGroup

logger = logging.getLogger("pagedserve.scheduler.scheduler")


class StepOutputs:
    """``Scheduler``'s recording of step results (a mixin: the queues, sequences and block
    manager are the scheduler's)."""

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestOutputDelta]:
        """Advance the counters of every scheduled sequence and record sampled tokens."""
        self.num_sampled_tokens += len(result.sampled_token_ids)
        if _decodes_only(plan, result):
            deltas = self._record_decodes(plan, result)
        else:
            deltas = self._record_step(plan, result)
        self._account_step()
        return deltas

    def _record_decodes(self, plan: StepPlan, result: StepResult) -> list[RequestOutputDelta]:
        """``_record_step`` for the common step (``_decodes_only``): row i is scheduled
        sequence i's one token, and nothing else came back."""
        deltas: list[RequestOutputDelta] = []
        beam_groups: dict[str, SequenceGroup] = {}
        requests = self.requests
        block_manager = self.block_manager
        caching = block_manager.prefix_cache is not None
        running = RequestStatus.RUNNING
        for row, scheduled in enumerate(plan.cached_requests):
            request_id = scheduled.request_id
            request = requests.get(request_id)
            if request is None or request.status is not running:
                continue  # aborted while the step ran
            try:
                if request.group is not None or request.pooling_params is not None:
                    rows_of = {request_id: [row]}
                    self._record(plan, scheduled, request, result, rows_of, deltas, beam_groups)
                    continue
                fault_injection.check("scheduling", request.sampling_params.seed)
                request.num_computed_tokens += scheduled.num_scheduled_tokens
                request.draft_token_ids = []
                if caching:
                    block_manager.cache_full_blocks(
                        request_id,
                        request.token_ids,
                        request.num_computed_tokens,
                        self._prefix_key(request),
                    )
                token_id = result.sampled_token_ids[row]
                status = request.append_output_token(token_id)
                deltas.append(self._delta(request, [token_id], status, None, None))
            except Exception as error:
                self._fail(request.group_request_id, _failure("recording its step", error), deltas)
        self._beam_steps(beam_groups, deltas)
        return deltas

    def _record_step(self, plan: StepPlan, result: StepResult) -> list[RequestOutputDelta]:
        rows_of: dict[str, list[int]] = {}
        for row, request_id in enumerate(result.request_ids):
            rows_of.setdefault(request_id, []).append(row)
        deltas: list[RequestOutputDelta] = []
        for sequence_id, why in result.failed_requests.items():
            sequence = self.requests.get(sequence_id)
            if sequence is not None:
                self._fail(sequence.group_request_id, f"a worker refused it: {why}", deltas)
        beam_groups: dict[str, SequenceGroup] = {}
        for scheduled in (*plan.new_requests, *plan.cached_requests):
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            try:
                self._record(plan, scheduled, request, result, rows_of, deltas, beam_groups)
            except Exception as error:
                self._fail(
                    request.group_request_id,
                    _failure("recording its step", error),
                    deltas,
                )
        self._beam_steps(beam_groups, deltas)
        return deltas

    def _beam_steps(
        self, beam_groups: dict[str, SequenceGroup], deltas: list[RequestOutputDelta]
    ) -> None:
        """The beam step of each group whose every beam has its candidates."""
        for group in beam_groups.values():
            if group.request_id in self.groups and all(
                seq.request_id in group.pending_candidates for seq in group.sequences
            ):
                try:
                    self._beam_step(group, deltas)
                except Exception as error:
                    self._fail(group.request_id, _failure("its beam step", error), deltas)

    def _record(
        self,
        plan: StepPlan,
        scheduled: NewRequestData | CachedRequestData,
        request: Request,
        result: StepResult,
        rows_of: dict[str, list[int]],
        deltas: list[RequestOutputDelta],
        beam_groups: dict[str, SequenceGroup],
    ) -> None:
        """One scheduled sequence's share of a step's result: its computed tokens, and its
        sampled tokens (deltas), or its beam candidates for the group's step."""
        fault_injection.check("scheduling", request.sampling_params.seed)
        rows = rows_of.get(scheduled.request_id)
        num_computed = scheduled.num_scheduled_tokens
        drafts = plan.spec_token_ids.get(scheduled.request_id)
        if drafts and rows:
            # Rows: the accepted drafts, then one sampled token. The rejected drafts'
            # K/V were written but count for nothing; later tokens overwrite them.
            num_accepted = len(rows) - 1
            num_computed -= len(drafts) - num_accepted
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += num_accepted
            for position in range(num_accepted):
                self.num_accepted_tokens_per_pos[position] += 1
        request.num_computed_tokens += num_computed
        if rows:
            # Guesses at what follows the tokens sampled now (none: guess nothing).
            request.draft_token_ids = result.draft_token_ids.get(scheduled.request_id, [])
        self.block_manager.cache_full_blocks(
            request.request_id,
            request.token_ids,
            request.num_computed_tokens,
            self._prefix_key(request),
        )
        if request.pooling_params is not None:
            if request.num_computed_tokens == request.num_tokens:
                deltas.append(self._finish_pooling(request, result))
            return
        prompt_logprobs = self._new_prompt_logprobs(request, result)
        group = request.group
        if rows is None or (group is not None and group.beam_search is not None):
            # A prefill chunk that did not reach the last prompt token, or a beam
            # whose next token the group decides below.
            if prompt_logprobs:
                deltas.append(
                    RequestOutputDelta(
                        request.group_request_id,
                        [],
                        False,
                        prompt_logprobs=prompt_logprobs,
                    )
                )
            if rows is not None:
                entry = result.logprobs[rows[0]]
                group.pending_candidates[request.request_id] = list(
                    zip(entry.token_ids[1:], entry.logprobs[1:])
                )
                beam_groups[group.request_id] = group
            return
        if group is None:
            deltas.append(self._advance(request, rows, result, prompt_logprobs))
        else:
            self._advance_samples(request, rows, result, prompt_logprobs, deltas)

    def _account_step(self) -> None:
        """Tally where the device's KV slots are after this step (see MemoryAccounting)."""
        block_manager = self.block_manager
        block_size = block_manager.block_size
        accounting = self.accounting
        table_slots = 0
        tables = block_manager.block_tables
        windowed = bool(block_manager.sliding_window)
        record_sequence = accounting.record_sequence
        for sequence in self.running:
            request_id = sequence.request_id
            # Blocks a sliding window freed hold no slot, nor the tokens that were in them.
            freed_slots = block_manager.num_window_freed(request_id) * block_size if windowed else 0
            slots = len(tables.get(request_id, ())) * block_size - freed_slots
            table_slots += slots
            record_sequence(request_id, slots, sequence.num_computed_tokens - freed_slots)
        pool = block_manager.pool
        used_slots = (pool.num_blocks - pool.num_free_blocks) * block_size
        external_slots = 0
        if block_manager.contiguous and self.waiting:
            external_slots = (pool.num_free_blocks - pool.largest_free_run()) * block_size
        accounting.record_step(table_slots, used_slots, external_slots)

    def _finish_pooling(self, request: Request, result: StepResult) -> RequestOutputDelta:
        """End a pooling request whose last prompt token was just computed: its one
        delta carries the vector the worker pooled there."""
        embedding = result.embeddings[request.request_id]
        self._release(request, RequestStatus.FINISHED_STOPPED)
        return RequestOutputDelta(
            request.request_id,
            [],
            finished=True,
            finish_reason=RequestStatus.FINISHED_STOPPED.value,
            num_cached_tokens=request.num_cached_tokens,
            embedding=embedding,
            queue_time_s=request.queue_time_s,
        )

    def _advance(
        self,
        request: Request,
        rows: list[int],
        result: StepResult,
        prompt_logprobs: list | None,
    ) -> RequestOutputDelta:
        """Record the sampled tokens of a single-sequence request (several when it
        speculated), up to the one that ends it."""
        token_ids = []
        logprobs = []
        status = RequestStatus.RUNNING
        for row in rows:
            token_ids.append(result.sampled_token_ids[row])
            entry = result.logprobs[row] if result.logprobs else None
            if entry is not None:
                logprobs.append(entry)
            status = request.append_output_token(token_ids[-1])
            if status.is_finished:
                break
        return self._delta(request, token_ids, status, logprobs or None, prompt_logprobs)

    def _delta(
        self,
        request: Request,
        token_ids: list[int],
        status: RequestStatus,
        logprobs: list | None,
        prompt_logprobs: list | None,
    ) -> RequestOutputDelta:
        """The delta of a single-sequence request's new tokens, which left it in ``status``
        (a finished one is released)."""
        finished = status is not RequestStatus.RUNNING
        if finished:
            self._release(request, status)
        # Known from the first token on; sent then too, for a frontend that ends the
        # request itself (a stop string) and never sees the last delta.
        first_or_last = finished or len(request.token_ids) - len(request.prompt_token_ids) == 1
        return RequestOutputDelta(
            request.request_id,
            token_ids,
            finished=finished,
            finish_reason=status.value if finished else None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens if first_or_last else None,
            queue_time_s=request.queue_time_s if first_or_last else None,
        )

    @staticmethod
    def _new_prompt_logprobs(request: Request, result: StepResult) -> list | None:
        chunk = result.prompt_logprobs.get(request.request_id)
        if chunk is None:
            return None
        skip = request.num_prompt_logprobs_reported - chunk.first_position
        entries = chunk.entries[max(skip, 0) :]
        request.num_prompt_logprobs_reported += len(entries)
        return entries or None


def _decodes_only(plan: StepPlan, result: StepResult) -> bool:
    """Whether every scheduled sequence was cached and sampled exactly one token, in
        plan order (the worker puts decodes first, in plan order), with nothing else
    (log-probs, prompt log-probs, vectors, drafts, refusals) in the result."""
    cached = plan.cached_requests
    return (
        not plan.new_requests
        and not plan.spec_token_ids
        and not result.failed_requests
        and not result.logprobs
        and not result.prompt_logprobs
        and not result.embeddings
        and not result.draft_token_ids
        and len(result.request_ids) == len(cached)
        and all(s.request_id == r for s, r in zip(cached, result.request_ids))
    )


def _failure(stage: str, error: Exception) -> str:
    return f"the scheduler failed on {stage}: {type(error).__name__}: {error}"
