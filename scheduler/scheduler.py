"""Iteration-level batching: which requests run in the next forward pass, and how far."""

from __future__ import annotations

import logging
import time
from collections import deque

from pagedserve.scheduler import fault_injection
from pagedserve.scheduler.adapter_slots import AdapterSlots
from pagedserve.scheduler.block_manager import BlockManager, blocks_for_tokens
from pagedserve.scheduler.capacity import check_request_fits
from pagedserve.scheduler.config import SchedulerConfig, check_priority
from pagedserve.scheduler.group_steps import GroupSteps, batch_slots, leading_sequences
from pagedserve.scheduler.kv_positions import KvPositions
from pagedserve.scheduler.memory_accounting import MemoryAccounting
from pagedserve.scheduler.messages import (
    CachedRequestData,
    NewRequestData,
    RequestOutputDelta,
    StepPlan,
)
from pagedserve.scheduler.pooling_params import check_task
from pagedserve.scheduler.priority_policy import PriorityPolicy
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.schedule_ahead import ScheduleAhead
from pagedserve.scheduler.sequence_group import SequenceGroup
from pagedserve.scheduler.speculation import Speculation
from pagedserve.scheduler.step_outputs import StepOutputs
from pagedserve.scheduler.structured_output import StructuredOutput

logger = logging.getLogger(__name__)


class Scheduler(
    StepOutputs,
    GroupSteps,
    Speculation,
    KvPositions,
    AdapterSlots,
    PriorityPolicy,
    ScheduleAhead,
):
    """First come, first served continuous batching over a paged KV cache.

    Each step first extends the running sequences (oldest first: one token for a decode,
    the next chunk for an unfinished prefill), then admits waiting requests while the
    token budget, the sequence cap and free blocks allow. When a running sequence needs
    a block and none is free, the most recently arrived running request is preempted,
    all its sequences together: by recompute (their blocks are freed and they return to
    the front of the queue, to be prefilled again, prompt plus generated tokens) or by
    swap (their blocks are copied to the host pool and back when there is room; blocks
    they share stay shared). By default a single sequence is recomputed and a group of
    several is swapped. Preempted requests resume ahead of newer arrivals, swapped ones
    first. Finished sequences give their blocks back at once.

    Under ``scheduling_policy="priority"`` queues and batch are ordered by (priority,
    arrival) instead (``priority_policy.py``).

    A request with several sequences (``SamplingParams.num_sequences``) is a
    ``SequenceGroup``: its sequences are adjacent in every queue, admitted, preempted
    and resumed together. Forks share blocks; the first write into a shared block
    copies it (``StepPlan.copy_blocks``).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        structured_output: StructuredOutput | None = None,
    ) -> None:
        expected_window = config.sliding_window if not block_manager.contiguous else 0
        if block_manager.sliding_window != expected_window:
            # check_request_fits trusts the config's window; the block manager frees by its own.
            raise ValueError(
                f"the block manager frees blocks behind a {block_manager.sliding_window}-token "
                f"window, but the scheduler config's sliding_window is {config.sliding_window}"
            )
        self.config = config
        self.block_manager = block_manager
        self.structured_output = structured_output or StructuredOutput(None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        # Every live sequence, by its id (a request's first sequence has the request's id).
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, SequenceGroup] = {}
        self.num_recompute_preemptions = 0
        self.num_swap_preemptions = 0
        # Tokens the workers sampled: one per sequence per step that completed its known
        # tokens (beams: one per beam), kept or not; the engine's decode work. With
        # speculation, the tokens emitted (drafts accepted, plus one).
        self.num_sampled_tokens = 0
        # Speculative decoding: sequence steps that checked drafts, draft tokens scored, and
        # those the sampling agreed with (tokens per such step: 1 + accepted / drafts).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Accepted drafts by their position in their step's drafts (the first, the second,
        # ...): how deep speculation pays, what num_speculative_tokens is tuned by.
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens
        # Blocks given back because a sliding window left them behind (a windowed model).
        self.num_window_freed_blocks = 0
        self._step_id = 0
        # Sequences whose full data the workers hold; anything else travels in full.
        self._known_to_workers: set[str] = set()
        self._drop_ids_for_workers: list[str] = []
        # Copy-on-writes of the step being planned: sequence id -> (table index, src, dst).
        self._step_copies: dict[str, tuple[int, int, int]] = {}
        # Whether sequences may speculate in the step being planned (disable_by_batch_size).
        self._speculating = True
        self.accounting = MemoryAccounting()
        self._by_priority = config.scheduling_policy == "priority"
        self._num_added = 0
        # LoRA adapters to load on the workers with the next step, and adapters to drop
        # once no request uses them (LoadLoRA / UnloadLoRA).
        self._loras_to_load: list[tuple[int, str, str]] = []
        self._loras_to_unload: set[int] = set()
        # Requests that failed in the engine since the last ``take_failures``: request id
        # -> why. Each has ended (its blocks are free) with a final delta marked "error".
        self._failures: dict[str, str] = {}

    # ----------------------------------------------------------------- admission

    def check_request_fits(
        self, num_prompt_tokens: int, max_tokens: int, num_sequences: int = 1
    ) -> None:
        """Raise ``ValueError`` for a request that could never run to completion."""
        check_request_fits(
            num_prompt_tokens,
            max_tokens,
            self.config,
            self.block_manager.block_size,
            self.block_manager.num_total_blocks,
            num_sequences,
        )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.groups:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        params = request.sampling_params
        fault_injection.check("admission", params.seed)
        max_tokens = 0 if request.pooling_params is not None else params.max_tokens
        self.check_request_fits(request.num_prompt_tokens, max_tokens, params.num_sequences)
        if self.block_manager.contiguous and params.num_sequences > 1:
            raise ValueError(
                f"allocation_policy {self.config.allocation_policy!r} shares no blocks; "
                f"n={params.n}, best_of={params.best_of}, beam_width={params.beam_width} "
                "need allocation_policy 'paged'"
            )
        check_priority(request.priority, self.config.scheduling_policy)
        check_task(self.config.model_task, request.pooling_params)
        pooling = request.pooling_params
        if (
            pooling is not None
            and pooling.pooling_type != "LAST"
            and (self.config.enable_chunked_prefill or self.block_manager.prefix_cache is not None)
        ):
            raise ValueError(
                f"pooling_type {pooling.pooling_type!r} pools every prompt token: it needs an "
                "engine without chunked prefill and prefix caching (one step computes the "
                "whole prompt)"
            )
        if params.structured_outputs is not None:
            request.grammar = self.structured_output.new_matcher(params.structured_outputs)
        request.arrival_index = self._num_added
        self._num_added += 1
        self.requests[request.request_id] = request
        if params.num_sequences > 1:
            self.groups[request.request_id] = SequenceGroup.create(request)
        self._enqueue(self.waiting, [request], front=False)

    def abort_request(self, request_id: str) -> RequestOutputDelta | None:
        """End a request now; returns its final delta, or ``None`` if it is unknown."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            sequences = list(group.sequences)
        elif request_id in self.requests:
            sequences = [self.requests[request_id]]
        else:
            return None
        for sequence in sequences:
            self._release(sequence, RequestStatus.FINISHED_ABORTED)
        return RequestOutputDelta(request_id, [], finished=True, finish_reason="abort")

    def take_failures(self) -> dict[str, str]:
        """The requests that failed in the engine since the last call (request id -> why);
        each already ended with a final delta whose finish reason is "error"."""
        failures, self._failures = self._failures, {}
        return failures

    def _fail(self, request_id: str, why: str, deltas: list[RequestOutputDelta]) -> None:
        """End a request whose own data made the engine fail (a request's failure is the
        request's): its sequences leave and free their blocks, and the other requests run
        on."""
        delta = self.abort_request(request_id)
        if delta is None:
            return
        delta.finish_reason = "error"
        deltas.append(delta)
        self._failures[request_id] = why
        logger.warning("request %s failed: %s", request_id, why)

    @property
    def num_preemptions(self) -> int:
        return self.num_recompute_preemptions + self.num_swap_preemptions

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------- scheduling

    def schedule(self) -> StepPlan:
        """Decide the next step. The plan may be empty when nothing is runnable."""
        self._step_id += 1
        self._step_copies = {}
        plan = StepPlan(step_id=self._step_id)
        budget = self.config.max_num_batched_tokens
        preempted = False
        limit = self.config.speculative_disable_by_batch_size
        # A large batch keeps the device busy already: no drafts, no guesses (vLLM's
        # disable_by_batch_size, counted over the sequences running as the step starts).
        self._speculating = not limit or len(self.running) < limit
        plan.draft_guesses = self._speculating
        if self._by_priority:
            self._preempt_for_priority(plan)

        frees_behind_window = bool(self.block_manager.sliding_window)
        index = 0
        while index < len(self.running):
            request = self.running[index]
            if self._enters_new_rotation(request):
                self._recompute_in_new_rotation(request, plan)
                continue
            num_new = self._num_tokens_to_schedule(request, budget)
            if num_new == 0:
                index += 1
                continue
            if frees_behind_window:
                self._free_blocks_before_window(plan, request)
            target = request.num_computed_tokens + num_new
            drafts = self._draft_tokens(request, num_new, budget)
            num_left = len(self.running) - index
            if drafts and self._drafts_fit(request, target, len(drafts), num_left):
                num_new += len(drafts)
                target += len(drafts)
                plan.spec_token_ids[request.request_id] = drafts
            while not self.block_manager.can_append(
                request.request_id, target, request.num_computed_tokens
            ):
                victims = self._pop_newest_running()
                self._preempt(victims, plan, "no free KV block")
                preempted = True
                if request in victims:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # it was among the newest running requests and preempted itself
            self._extend(plan, request, num_new, num_left)
            budget -= num_new
            index += 1

        # After a preemption the cache is tight: admitting more would only thrash.
        if not preempted and self._by_priority:
            budget = self._resume_in_rank_order(plan, budget)
        elif not preempted:
            budget = self._swap_in(plan, budget)
            if not self.swapped:
                budget = self._admit_waiting(plan, budget)

        plan.finished_request_ids = self._drop_ids_for_workers
        self._drop_ids_for_workers = []
        self._add_token_bitmasks(plan)
        self._add_lora_updates(plan)
        return plan

    def _add_token_bitmasks(self, plan: StepPlan) -> None:
        """The grammar's allowed tokens for each constrained sequence that samples in this
        step (one whose scheduled tokens reach its last known token), unless it thinks
        throughout the step (a reasoning model's grammar waits for the thinking's end)."""
        # NOTE: one llguidance mask per constrained sequence, serially on this thread while
        # the workers wait for the plan (tools/bench_structured_output.py measures it).
        for scheduled in (*plan.new_requests, *plan.cached_requests):
            request = self.requests[scheduled.request_id]
            if request.grammar is None:
                continue
            drafts = plan.spec_token_ids.get(request.request_id)
            if not request.grammar.constrains(drafts or []):
                continue
            if drafts:  # a mask for every position it samples
                plan.token_bitmasks[request.request_id] = request.grammar.draft_bitmasks(drafts)
            elif (
                scheduled.num_computed_tokens + scheduled.num_scheduled_tokens == request.num_tokens
            ):
                plan.token_bitmasks[request.request_id] = request.grammar.allowed_token_bitmask()

    def _extend(
        self,
        plan: StepPlan,
        request: Request,
        num_new: int,
        num_left: int | None = None,
    ) -> None:
        """Give a running sequence slots for ``num_new`` more tokens and put it in the
        plan: as a delta when the workers know it, in full otherwise. ``num_left``: the
        running sequences from this one on, when it is one of them (see
        ``_reserve_draft_slots``)."""
        block_manager = self.block_manager
        computed = request.num_computed_tokens
        copy = block_manager.copy_on_write(request.request_id, computed)
        if copy is not None:
            plan.copy_blocks.append(copy)
            self._step_copies[request.request_id] = (
                computed // block_manager.block_size,
                *copy,
            )
            # Its table changed in place: the workers get it anew.
            self._forget_on_workers(request.request_id)
        new_block_ids = block_manager.append(request.request_id, computed + num_new)
        assert new_block_ids is not None
        if num_left is not None:
            new_block_ids += self._reserve_draft_slots(request, computed + num_new, num_left)
        if request.request_id in self._known_to_workers:
            plan.cached_requests.append(
                CachedRequestData(
                    request_id=request.request_id,
                    new_block_ids=new_block_ids,
                    num_computed_tokens=computed,
                    num_scheduled_tokens=num_new,
                )
            )
        else:
            self._send_in_full(plan, request, num_new)

    def _swap_in(self, plan: StepPlan, budget: int) -> int:
        """Bring swapped requests back, oldest first, while their blocks fit."""
        while self.swapped and budget > 0:
            remaining = self._swap_in_next(plan, budget)
            if remaining is None:
                break
            budget = remaining
        return budget

    def _swap_in_next(self, plan: StepPlan, budget: int) -> int | None:
        """Bring the first swapped request back if its blocks fit; returns the budget
        left, or ``None`` when it stays swapped."""
        sequences = leading_sequences(self.swapped)
        if self._num_batch_slots() + batch_slots(sequences) > self.config.max_num_seqs:
            return None
        if self._lora_slot_missing(sequences[0], self.running):
            return None
        targets, remaining = self._swap_in_targets(sequences, budget)
        if remaining == budget:
            return None
        ids = [sequence.request_id for sequence in sequences]
        keep_watermark = bool(self.running)
        if not self.block_manager.can_swap_in(ids, keep_watermark, targets):
            return None
        for _ in sequences:
            self.swapped.popleft()
        plan.swap_in.extend(self.block_manager.swap_in(ids, keep_watermark))
        for sequence, target in zip(sequences, targets):
            sequence.status = RequestStatus.RUNNING
            self._add_running(sequence)
            num_new = target - sequence.num_computed_tokens
            if num_new:
                self._extend(plan, sequence, num_new)
        return remaining

    def _swap_in_targets(self, sequences: list[Request], budget: int) -> tuple[list[int], int]:
        """The token count each swapped sequence reaches if swapped in now (the budget
        shared in order), and the budget left."""
        targets = []
        for sequence in sequences:
            num_new = self._num_tokens_to_schedule(sequence, budget)
            targets.append(sequence.num_computed_tokens + num_new)
            budget -= num_new
        return targets, budget

    def _admit_waiting(self, plan: StepPlan, budget: int) -> int:
        """Admit waiting requests, in queue order, while they fit. A request whose adapter
        would pass ``max_loras`` is stepped over (it keeps its place at the front), as
        vLLM does: the requests behind it may use the base model or a running adapter."""
        stepped_over: list[Request] = []
        while self.waiting and budget > 0:
            if self._lora_slot_missing(self.waiting[0], self.running):
                for _ in leading_sequences(self.waiting):
                    stepped_over.append(self.waiting.popleft())
                continue
            remaining = self._admit_next(plan, budget)
            if remaining is None:
                break
            budget = remaining
        self.waiting.extendleft(reversed(stepped_over))
        return budget

    def _admit_next(self, plan: StepPlan, budget: int) -> int | None:
        """Admit the first waiting request if it fits; returns the budget left, or
        ``None`` when it keeps waiting."""
        block_manager = self.block_manager
        sequences = leading_sequences(self.waiting)
        head = sequences[0]
        if self._num_batch_slots() + batch_slots(sequences) > self.config.max_num_seqs:
            return None
        if self._lora_slot_missing(head, self.running):
            return None
        if len(sequences) > 1:
            budget, admitted = self._admit_sequences(plan, sequences, budget)
            return budget if admitted else None
        cached_block_ids = []
        if head.num_computed_tokens == 0:
            cached_block_ids = self._cached_prefix(head)
        num_cached = len(cached_block_ids) * block_manager.block_size
        num_new = self._num_tokens_to_schedule(head, budget, num_cached)
        if num_new == 0:
            return None
        block_ids = block_manager.allocate(
            head.request_id,
            head.num_computed_tokens + num_cached + num_new,
            keep_watermark=bool(self.running),
            cached_block_ids=cached_block_ids,
            reserve_tokens=self.block_manager.reservation_tokens(
                head.num_prompt_tokens, head.sampling_params.max_tokens, self.config.max_model_len
            ),
        )
        if block_ids is None:
            return None
        self.waiting.popleft()
        self._note_prefix_hit(head, num_cached)
        head.status = RequestStatus.RUNNING
        self._add_running(head)
        # Slots for its first guesses too, leaving a block for every other running sequence.
        self._reserve_draft_slots(head, head.num_computed_tokens + num_new, len(self.running))
        self._send_in_full(plan, head, num_new)
        return budget - num_new

    def _blocks_missing(self, sequences: list[Request], keep_watermark: bool) -> int:
        """Free blocks a queued request (its leading ``sequences``) lacks to resume with
        a full step's budget (<= 0: it fits)."""
        block_manager = self.block_manager
        budget = self.config.max_num_batched_tokens
        head = sequences[0]
        if head.status == RequestStatus.SWAPPED:
            targets, _ = self._swap_in_targets(sequences, budget)
            ids = [sequence.request_id for sequence in sequences]
            needed = block_manager.blocks_to_swap_in(ids, targets)
        elif len(sequences) > 1:  # a group preempted by recompute: all tokens at once
            needed = sum(
                blocks_for_tokens(sequence.num_tokens, block_manager.block_size)
                for sequence in sequences
            )
        else:
            cached_block_ids = []
            if head.num_computed_tokens == 0:
                cached_block_ids = self._cached_prefix(head)
            num_cached = len(cached_block_ids) * block_manager.block_size
            # Without chunked prefill a prompt over the budget waits anyway; count it whole.
            num_new = self._num_tokens_to_schedule(head, budget, num_cached) or (
                head.num_tokens - head.num_computed_tokens - num_cached
            )
            needed = block_manager.blocks_to_allocate(
                head.num_computed_tokens + num_cached + num_new, cached_block_ids
            )
        reserve = block_manager.watermark_blocks if keep_watermark else 0
        return needed + reserve - block_manager.num_free_blocks

    def _num_batch_slots(self) -> int:
        """Sequences the batch holds or has promised: the running ones, and the samples or
        beams a running group will fork into at its first sample (admitted with room for
        them, which later admissions must leave free)."""
        pending_forks = sum(
            sequence.sampling_params.num_sequences - 1
            for sequence in self.running
            if sequence.group is not None and sequence.num_output_tokens == 0
        )
        return len(self.running) + pending_forks

    def _add_running(self, sequence: Request) -> None:
        """Put a sequence into the batch: last (arrival order of admission), or under
        the priority policy after every sequence that ranks at or above it."""
        if sequence.queue_time_s is None:
            # arrival_time_s is the frontend's time.monotonic(): one clock on one machine.
            sequence.queue_time_s = max(0.0, time.monotonic() - sequence.arrival_time_s)
        if not self._by_priority:
            self.running.append(sequence)
            return
        index = len(self.running)
        while index > 0 and self.running[index - 1].rank > sequence.rank:
            index -= 1
        self.running.insert(index, sequence)

    def _enqueue(self, queue: deque[Request], sequences: list[Request], front: bool) -> None:
        """Queue a request's sequences (adjacent): at the back for a new request, at the
        front for a preempted one; under the priority policy, after every request that
        ranks at or above it, whichever."""
        if not self._by_priority:
            if front:
                queue.extendleft(reversed(sequences))
            else:
                queue.extend(sequences)
            return
        rank = sequences[0].rank
        index = len(queue)
        while index > 0 and queue[index - 1].rank > rank:
            index -= 1
        for offset, sequence in enumerate(sequences):
            queue.insert(index + offset, sequence)

    def _admit_sequences(
        self, plan: StepPlan, sequences: list[Request], budget: int
    ) -> tuple[int, bool]:
        """Admit the sequences of a group preempted by recompute, all or none: each gets
        blocks for all its tokens now, and computes them as the token budget allows."""
        block_manager = self.block_manager
        needed = sum(
            blocks_for_tokens(sequence.num_tokens, block_manager.block_size)
            for sequence in sequences
        )
        reserve = block_manager.watermark_blocks if self.running else 0
        if needed + reserve > block_manager.num_free_blocks:
            return budget, False
        for sequence in sequences:
            self.waiting.popleft()
            cached_block_ids = self._cached_prefix(sequence)
            block_ids = block_manager.allocate(
                sequence.request_id,
                sequence.num_tokens,
                keep_watermark=False,
                cached_block_ids=cached_block_ids,
            )
            assert block_ids is not None
            num_cached = len(cached_block_ids) * block_manager.block_size
            self._note_prefix_hit(sequence, num_cached)
            sequence.status = RequestStatus.RUNNING
            self._add_running(sequence)
            num_new = self._num_tokens_to_schedule(sequence, budget)
            if num_new:
                self._send_in_full(plan, sequence, num_new)
                budget -= num_new
        return budget, True

    def _cached_prefix(self, request: Request) -> list[int]:
        """The blocks of the request's prompt found in the prefix cache. A request that wants
        prompt logprobs reads only the positions whose logprobs were already reported (none
        at first): a cached token is never computed, so the position after it would get no
        logprob (vLLM skips the cache for such requests too). A per-token pooling request
        reads none, for the same reason."""
        # Computed from its first token: its rotation is the one its length says now.
        request.rotation_epoch = self.config.rotation_epoch(request.num_tokens)
        max_cached_tokens = None
        if request.sampling_params.prompt_logprobs is not None:
            max_cached_tokens = request.num_prompt_logprobs_reported - 1
        if request.pooling_params is not None and request.pooling_params.per_token:
            max_cached_tokens = 0  # a row per prompt token: every one is computed
        return self.block_manager.find_cached_prefix(
            request.token_ids, self._prefix_key(request), max_cached_tokens
        )

    def _note_prefix_hit(self, request: Request, num_cached: int) -> None:
        prefix_cache = self.block_manager.prefix_cache
        if prefix_cache is not None and request.num_computed_tokens == 0:
            prefix_cache.record_query(request.num_tokens - 1, num_cached)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
        request.num_computed_tokens += num_cached

    def _send_in_full(self, plan: StepPlan, request: Request, num_new: int) -> None:
        """Put a sequence the workers hold no state for into the plan, in full."""
        self._known_to_workers.add(request.request_id)
        plan.new_requests.append(
            NewRequestData(
                request_id=request.request_id,
                token_ids=list(request.token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                block_ids=list(self.block_manager.block_tables[request.request_id]),
                num_computed_tokens=request.num_computed_tokens,
                num_scheduled_tokens=num_new,
                sampling_params=request.sampling_params,
                eos_token_ids=sorted(request.eos_token_ids),
                lora_id=request.lora_id,
                pooling_params=request.pooling_params,
            )
        )

    def _num_tokens_to_schedule(
        self, request: Request, budget: int, num_cached_tokens: int = 0
    ) -> int:
        remaining = request.num_tokens - request.num_computed_tokens - num_cached_tokens
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _pop_newest_running(self) -> list[Request]:
        """Take the most recently arrived running request out of the batch: its one
        sequence, or all sequences of its group (they are adjacent)."""
        group = self.running[-1].group
        if group is None:
            return [self.running.pop()]
        victims = [sequence for sequence in self.running if sequence.group is group]
        self.running = [sequence for sequence in self.running if sequence.group is not group]
        return victims

    def _preempt(
        self,
        sequences: list[Request],
        plan: StepPlan,
        reason: str,
        mode: str | None = None,
        counted: bool = True,
    ) -> None:
        """Take a request's running sequences out of the batch, all or nothing: swap
        their blocks to the host pool, or free them to recompute later (``mode``, else the
        configured one, else by the group's size). Either way it resumes ahead of newer
        requests (of its priority, under the priority policy). ``counted``: a preemption
        for the stats (not LongRoPE's switch, which no shortage of blocks caused)."""
        default_mode = "swap" if len(sequences) > 1 else "recompute"
        mode = mode or self.config.preemption_mode or default_mode
        if any(self._enters_new_rotation(sequence) for sequence in sequences):
            # Past LongRoPE's switch it is computed again from its first token anyway (a
            # swap-in would resume it with the short factors' keys).
            mode = "recompute"
        ids = {sequence.request_id for sequence in sequences}
        # Undo what this step already planned for them: their entries, and the copies
        # of shared blocks (whose destination a swap-out would otherwise copy unfilled).
        plan.new_requests = [r for r in plan.new_requests if r.request_id not in ids]
        plan.cached_requests = [r for r in plan.cached_requests if r.request_id not in ids]
        for request_id in ids:
            plan.spec_token_ids.pop(request_id, None)
            plan.window_freed_blocks.pop(request_id, None)
        for request_id in ids & self._step_copies.keys():
            index, source, destination = self._step_copies.pop(request_id)
            self.block_manager.undo_copy_on_write(request_id, index, source, destination)
            plan.copy_blocks.remove((source, destination))
        group = sequences[0].group
        if group is not None:
            group.pending_candidates.clear()
        for sequence in sequences:
            sequence.num_preemptions += 1
            self._forget_on_workers(sequence.request_id)
        request_id = group.request_id if group is not None else sequences[0].request_id
        if mode == "swap":
            pairs = self.block_manager.swap_out([sequence.request_id for sequence in sequences])
            if pairs is not None:
                plan.swap_out.extend(pairs)
                for sequence in sequences:
                    sequence.status = RequestStatus.SWAPPED
                self.num_swap_preemptions += 1
                # Victims are taken newest first: pushing each to the front keeps the
                # queue in arrival order.
                self._enqueue(self.swapped, sequences, front=True)
                logger.info(
                    "preempted request %s (%d sequences) by swap (%s): %d blocks to host",
                    request_id,
                    len(sequences),
                    reason,
                    len(pairs),
                )
                return
            reason += "; host swap pool full, falling back to recompute"
        for sequence in sequences:
            self.block_manager.free(sequence.request_id)
            sequence.status = RequestStatus.WAITING
            sequence.num_computed_tokens = 0
        if counted:
            self.num_recompute_preemptions += 1
        self._enqueue(self.waiting, sequences, front=True)
        logger.info(
            "preempted request %s (%d sequences) by recompute (%s): %d tokens to recompute",
            request_id,
            len(sequences),
            reason,
            sum(sequence.num_tokens for sequence in sequences),
        )

    def _release(self, request: Request, status: RequestStatus) -> None:
        """End one sequence: out of the batch or its queue, blocks back, state dropped on
        workers. The last sequence of a group ends the group."""
        if request.status == RequestStatus.RUNNING and request in self.running:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        request.status = status
        self.block_manager.free(request.request_id)
        self._forget_on_workers(request.request_id)
        self.accounting.finish_sequence(request.request_id, request.num_tokens)
        del self.requests[request.request_id]
        group = request.group
        if group is not None and request in group.sequences:
            group.sequences.remove(request)
            if group.beam_search is None and status != RequestStatus.FINISHED_ABORTED:
                group.finished.append(request)
            if group.is_finished:
                self.groups.pop(group.request_id, None)

    def _forget_on_workers(self, request_id: str) -> None:
        if request_id in self._known_to_workers:
            self._known_to_workers.discard(request_id)
            self._drop_ids_for_workers.append(request_id)
