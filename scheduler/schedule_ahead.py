"""Planning step N+1 while step N runs (a part of ``Scheduler``): vLLM v1's async
scheduling, SGLang's overlap scheduler.

A decoding sequence's next step needs the token step N samples, which the scheduler does
not know yet; the worker does (it appends each token it samples to its own copy of the
sequence), so the plan only says "compute one more token at position p" and the worker
reads that token from its state. What the scheduler cannot know is whether the token ends
the sequence (EOS, a stop token): if it does, step N+1 computes one token in vain, its
result is dropped (``update_from_output`` skips sequences that are no longer running) and
the sequence's blocks go back after N's results, before any later plan can reuse them
(the worker runs plans in order). An end by length is known: such a sequence is left out.

Only steady decoding runs ahead: every running sequence computed its last known token in
step N and takes one more. Anything that needs N's outcome or changes the batch waits
for it and is planned by ``schedule()`` (the engine then runs that step without overlap):
queued or swapped requests to admit, too few free blocks (preemption), a prefill chunk,
sequence groups (``n`` > 1, beams: forks and the beam step decide on N's tokens),
grammars (the bitmask follows N's token), speculation (drafts follow N's tokens), a
sliding window (blocks freed behind it), a LongRoPE sequence entering its long rotation,
pooling requests, and LoRA loads or unloads.
"""

from __future__ import annotations

from pagedserve.scheduler.messages import CachedRequestData, StepPlan
from pagedserve.scheduler.request import Request


class ScheduleAhead:
    """``Scheduler``'s plans made ahead of a step's results (a mixin)."""

    # Plans made while the step before ran (a stats counter; each scheduler counts its own).
    num_steps_scheduled_ahead = 0

    def schedule_ahead(self, in_flight: StepPlan) -> StepPlan | None:
        """The plan after ``in_flight``, whose results have not been recorded (every
        earlier plan's have), or None when it must wait for them (module docstring)."""
        if not self._may_run_ahead(in_flight):
            return None
        scheduled = {s.request_id: s for s in in_flight.cached_requests}
        scheduled.update((s.request_id, s) for s in in_flight.new_requests)
        block_manager = self.block_manager
        continuing: list[tuple[Request, int, int]] = []
        num_new_blocks = 0
        rotates = bool(self.config.long_rope_switch)
        known_to_workers = self._known_to_workers
        decode_growth = block_manager.decode_growth
        for request in self.running:
            request_id = request.request_id
            step = scheduled.get(request_id)
            if (
                step is None
                or request.group is not None
                or request.grammar is not None
                or request.pooling_params is not None
                or request_id not in known_to_workers
            ):
                return None
            num_computed = step.num_computed_tokens + step.num_scheduled_tokens
            num_tokens = len(request.token_ids)
            if num_computed != num_tokens:
                return None  # a prefill chunk: it samples nothing in the step in flight
            if num_tokens + 1 >= request.max_total_tokens:
                continue  # the token in flight is its last
            if rotates and self.config.rotation_epoch(num_tokens + 1) > request.rotation_epoch:
                return None
            num_new = decode_growth(request_id, num_computed)
            if num_new is None:
                return None
            num_new_blocks += num_new
            continuing.append((request, num_computed, num_new))
        if not continuing or num_new_blocks > block_manager.num_free_blocks:
            return None
        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, draft_guesses=False)
        cached = plan.cached_requests
        for request, num_computed, num_new in continuing:
            new_block_ids = []
            if num_new:
                new_block_ids = block_manager.append(request.request_id, num_computed + 1)
                assert new_block_ids is not None  # counted above
            cached.append(CachedRequestData(request.request_id, new_block_ids, num_computed, 1))
        plan.finished_request_ids = self._drop_ids_for_workers
        self._drop_ids_for_workers = []
        self.num_steps_scheduled_ahead += 1
        return plan

    def _may_run_ahead(self, in_flight: StepPlan) -> bool:
        """What rules running ahead out for the whole batch (module docstring)."""
        return not (
            self.waiting
            or self.swapped
            or self._loras_to_load
            or self._loras_to_unload
            or self.config.num_speculative_tokens
            or self.block_manager.sliding_window
            or in_flight.spec_token_ids
            or len(self.running) > self.config.max_num_batched_tokens
        )
