"""The priority policy's own steps (a part of ``Scheduler``).

Under ``scheduling_policy="priority"`` every queue and the batch are ordered by (priority,
arrival), lower first, instead of by arrival: the batch extends its highest-ranked
sequences first, a preemption takes the lowest-ranked running request, and swapped and
waiting requests resume and are admitted in rank order (one queue blocks the other only
when its head ranks higher). When the best-ranked queued request does not fit (blocks or
``max_num_seqs``), running requests of a strictly lower priority are preempted for it,
lowest first, if that makes it fit; requests of equal priority never preempt each other,
so they keep first come, first served."""

from __future__ import annotations

from collections import deque

from pagedserve.scheduler.group_steps import batch_slots, leading_sequences
from pagedserve.scheduler.messages import StepPlan
from pagedserve.scheduler.request import Request


class PriorityPolicy:
    """``Scheduler``'s priority scheduling (a mixin)."""

    def _resume_in_rank_order(self, plan: StepPlan, budget: int) -> int:
        """Priority policy: swap in or admit the best-ranked queued request, then the
        next, until one does not fit (none overtakes a better-ranked one)."""
        while budget > 0:
            queue = self._best_queue()
            if queue is None:
                break
            resume = self._swap_in_next if queue is self.swapped else self._admit_next
            remaining = resume(plan, budget)
            if remaining is None:
                break
            budget = remaining
        return budget

    def _best_queue(self) -> deque[Request] | None:
        """The queue (swapped or waiting) whose first request ranks best, if any."""
        if not self.swapped or not self.waiting:
            return self.swapped or self.waiting or None
        return self.swapped if self.swapped[0].rank < self.waiting[0].rank else self.waiting

    def _preempt_for_priority(self, plan: StepPlan) -> None:
        """Make room for the best-ranked queued request by preempting running requests
        of a strictly lower priority, lowest ranked first, when it does not fit now and
        preempting all of them would let it fit (otherwise they keep running)."""
        queue = self._best_queue()
        if queue is None:
            return
        sequences = leading_sequences(queue)
        head = sequences[0]
        lower = [sequence for sequence in self.running if sequence.priority > head.priority]
        if not lower:
            return
        group_size = batch_slots(sequences)
        max_num_seqs = self.config.max_num_seqs
        # Blocks for it, with the watermark kept for the running requests that stay.
        keep_watermark = len(lower) < len(self.running)
        blocks_missing = self._blocks_missing(sequences, keep_watermark)
        slots_missing = self._num_batch_slots() + group_size - max_num_seqs
        lora_missing = self._lora_slot_missing(head, self.running)
        if blocks_missing <= 0 and slots_missing <= 0 and not lora_missing:
            return
        freed = self.block_manager.num_blocks_freed_by([s.request_id for s in lower])
        staying = [sequence for sequence in self.running if sequence.priority <= head.priority]
        if (
            freed < blocks_missing
            or len(lower) < slots_missing
            or self._lora_slot_missing(head, staying)
        ):
            return  # it needs blocks, slots or an adapter slot held by requests it does not outrank
        reason = f"request {head.group_request_id} of priority {head.priority} outranks it"
        while self.running and self.running[-1].priority > head.priority:
            blocks_missing = self._blocks_missing(sequences, bool(self.running))
            if (
                blocks_missing <= 0
                and self._num_batch_slots() + group_size <= max_num_seqs
                and not self._lora_slot_missing(head, self.running)
            ):
                break
            self._preempt(self._pop_newest_running(), plan, reason)
