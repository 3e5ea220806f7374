"""Iteration-level batching: which requests run in the next forward pass, and how far."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

from pagedserve.scheduler import fault_injection, ngram_proposer
from pagedserve.scheduler.block_manager import BlockManager, blocks_for_tokens, blocks_spanned
from pagedserve.scheduler.config import SchedulerConfig, check_priority
from pagedserve.scheduler.memory_accounting import MemoryAccounting
from pagedserve.scheduler.messages import (
    CachedRequestData,
    NewRequestData,
    RequestOutputDelta,
    StepPlan,
    StepResult,
)
from pagedserve.scheduler.pooling_params import check_task
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.sequence_group import SequenceGroup
from pagedserve.scheduler.speculative_config import WORKER_DRAFTED_METHODS
from pagedserve.scheduler.structured_output import StructuredOutput

logger = logging.getLogger(__name__)


def check_request_fits(
    num_prompt_tokens: int,
    max_tokens: int,
    config: SchedulerConfig,
    block_size: int,
    total_blocks: int,
    num_sequences: int = 1,
) -> None:
    """Raise ``ValueError`` for a request that could never run to completion: its prompt
    leaves no room to generate within ``config.max_model_len``, it needs more blocks than
    the whole cache of ``total_blocks`` blocks of ``block_size`` tokens, or it runs more
    sequences (n, best_of, beams) than a batch may hold. A function of the limits alone,
    so a frontend in another process checks exactly what the scheduler will.

    A request of several sequences must fit with every sequence holding its own blocks:
    sharing is what usually happens, but after a recompute preemption nothing is shared.
    ``max_tokens=0`` is a prompt-only (pooling) request: its prompt may fill the context.

    Under a sliding window (``config.sliding_window``) a single sequence computed in chunks
    never holds more than the blocks of one step's tokens and the window before them, so it
    may be longer than the cache. A group (recomputed all at once) and a prompt that is
    not chunked still need blocks for every token.
    """
    max_model_len = config.max_model_len
    max_num_seqs = config.max_num_seqs
    if num_prompt_tokens < 1:
        raise ValueError("prompt must contain at least 1 token, got 0")
    if max_tokens == 0 and num_prompt_tokens > max_model_len:
        raise ValueError(f"prompt is {num_prompt_tokens} tokens; max_model_len is {max_model_len}")
    if max_tokens > 0 and num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt is {num_prompt_tokens} tokens; max_model_len is {max_model_len} and "
            "must leave room for at least one generated token"
        )
    if max_num_seqs is not None and num_sequences > max_num_seqs:
        raise ValueError(
            f"request runs {num_sequences} sequences (n / best_of / beam_width), but "
            f"max_num_seqs is {max_num_seqs}"
        )
    max_total_tokens = min(num_prompt_tokens + max_tokens, max_model_len)
    needed_blocks = blocks_for_tokens(max_total_tokens, block_size) * num_sequences
    if _holds_a_window(config, num_sequences):
        window_blocks = _window_blocks(config, block_size)
        if window_blocks < needed_blocks:
            if window_blocks > total_blocks:
                raise ValueError(
                    f"a step of up to {config.max_num_batched_tokens} tokens "
                    f"(max_num_batched_tokens) with the {config.sliding_window}-token "
                    f"sliding window before it spans up to {window_blocks} blocks of "
                    f"{block_size} tokens, but the whole KV cache has {total_blocks} blocks "
                    f"({total_blocks * block_size} tokens); lower max_num_batched_tokens or "
                    "raise kv_cache_bytes"
                )
            return
    if needed_blocks > total_blocks:
        per_sequence = f" x {num_sequences} sequences" if num_sequences > 1 else ""
        raise ValueError(
            f"request needs up to {max_total_tokens} tokens (prompt {num_prompt_tokens} + "
            f"max_tokens {max_tokens}){per_sequence} = {needed_blocks} blocks of "
            f"{block_size} tokens, but the whole KV cache has {total_blocks} blocks "
            f"({total_blocks * block_size} tokens); lower max_tokens or raise kv_cache_bytes"
        )


def max_sequence_tokens(
    config: SchedulerConfig, block_size: int, total_blocks: int, num_sequences: int = 1
) -> int:
    """The most tokens (prompt and output) each sequence of a request of ``num_sequences``
    can reach: ``max_model_len``, or less when the cache could not hold them (as
    ``check_request_fits`` counts: behind a sliding window, only a window's blocks)."""
    if _holds_a_window(config, num_sequences) and (
        _window_blocks(config, block_size) <= total_blocks
    ):
        return config.max_model_len
    return min(config.max_model_len, total_blocks // num_sequences * block_size)


def _holds_a_window(config: SchedulerConfig, num_sequences: int) -> bool:
    """Whether a request's blocks behind its sliding window are freed as it runs, so that it
    never holds more than ``_window_blocks``: one sequence, computed in chunks."""
    return bool(
        config.sliding_window
        and config.enable_chunked_prefill
        and config.allocation_policy == "paged"
        and num_sequences == 1
    )


def _window_blocks(config: SchedulerConfig, block_size: int) -> int:
    """The most blocks a sequence holds behind a sliding window: those spanned by the
    positions from its step's first query's window start to the step's last token."""
    return blocks_spanned(config.sliding_window - 1 + config.max_num_batched_tokens, block_size)


class Scheduler:
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

    Under ``scheduling_policy="priority"`` every queue and the batch are ordered by
    (priority, arrival), lower first, instead of by arrival: the batch extends its
    highest-ranked sequences first, a preemption takes the lowest-ranked running request,
    and swapped and waiting requests resume and are admitted in rank order (one queue
    blocks the other only when its head ranks higher). When the best-ranked queued
    request does not fit (blocks or ``max_num_seqs``), running requests of a strictly
    lower priority are preempted for it, lowest first, if that makes it fit; requests of
    equal priority never preempt each other, so they keep first come, first served.

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
            request_id, [], finished=True, finish_reason="stop", index=sequence.sample_index
        )

    def load_lora(self, lora_id: int, name: str, path: str) -> None:
        """Have the workers load adapter ``lora_id`` before the next step runs."""
        self._loras_to_load.append((lora_id, name, path))

    def unload_lora(self, lora_id: int) -> None:
        """Have the workers drop adapter ``lora_id`` once no request uses it."""
        self._loras_to_unload.add(lora_id)

    def _add_lora_updates(self, plan: StepPlan) -> None:
        """Pending adapter loads, and the unloads no live request holds back, ride with a
        step that runs (an idle engine keeps them until one does)."""
        if plan.is_empty:
            return
        plan.load_loras, self._loras_to_load = self._loras_to_load, []
        if self._loras_to_unload:
            in_use = {request.lora_id for request in self.requests.values()}
            ready = sorted(self._loras_to_unload - in_use)
            plan.unload_lora_ids = ready
            self._loras_to_unload.difference_update(ready)

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
            if self._crosses_long_rope_switch(request):
                self._recompute_with_long_rope(request, plan)
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

    def _crosses_long_rope_switch(self, request: Request) -> bool:
        """Whether a sequence rotated with LongRoPE's short factors has grown past the
        original context (``SchedulerConfig.long_rope_switch``): HF's Phi-3 then drops its
        cache and computes the whole sequence again with the long factors."""
        switch = self.config.long_rope_switch
        return bool(switch) and not request.long_rope and request.num_tokens > switch

    def _recompute_with_long_rope(self, request: Request, plan: StepPlan) -> None:
        """Take the sequence (its group's, all of them) out of the batch to compute again
        from its first token, as HF does at this point: it resumes ahead of newer requests,
        rotated with the long factors, and takes prefix hits among such sequences only."""
        group = request.group
        sequences = (
            [request]
            if group is None
            else [sequence for sequence in self.running if sequence.group is group]
        )
        ids = {sequence.request_id for sequence in sequences}
        self.running = [sequence for sequence in self.running if sequence.request_id not in ids]
        self._preempt(
            sequences, plan, "LongRoPE past the original context", mode="recompute", counted=False
        )

    def _prefix_namespace(self, request: Request) -> str | None:
        """The prefix-cache namespace of the request's K/V: its own, kept apart for a
        LongRoPE sequence rotated with the long factors (the same tokens, other keys). The
        mark goes before the first NUL, the engine's part of a namespace."""
        if not request.long_rope:
            return request.cache_namespace
        head, _, tail = (request.cache_namespace or "0\x00").partition("\x00")
        return f"{head}L\x00{tail}"

    def _free_blocks_before_window(self, plan: StepPlan, request: Request) -> None:
        """Give back the sequence's blocks that its window has left behind (a windowed model
        only), before it asks for new ones; the workers mark them in their tables."""
        block_manager = self.block_manager
        before = block_manager.num_window_freed(request.request_id)
        num_freed = block_manager.free_blocks_before_window(
            request.request_id, request.num_computed_tokens
        )
        if not num_freed:
            return
        self.num_window_freed_blocks += num_freed - before
        if request.request_id in self._known_to_workers:
            plan.window_freed_blocks[request.request_id] = num_freed

    def _draft_tokens(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Draft tokens for a decoding sequence that may speculate: within the token
        budget and the sequence's room, so every emitted token fits max_tokens."""
        config = self.config
        if (
            not config.num_speculative_tokens
            or not self._speculating
            or num_new != 1
            or request.num_computed_tokens + 1 != request.num_tokens
            or request.group is not None  # n > 1, best_of, beams: one token a step
        ):
            return []
        room = min(
            config.num_speculative_tokens,
            budget - 1,
            request.max_total_tokens - request.num_tokens - 1,
        )
        if config.long_rope_switch and not request.long_rope:
            # Within LongRoPE's original context: a draft past it would be computed with the
            # short factors where HF computes the sequence again with the long ones.
            room = min(room, config.long_rope_switch - request.num_tokens)
        if room < 1:
            return []
        grammar = request.grammar
        # Under a grammar, the tokens it forces come first (jump-forward, checked like
        # any draft); then the draft model's guesses or prompt lookup, cut where the
        # grammar would refuse a draft.
        drafts = grammar.forced_tokens()[:room] if grammar is not None else []
        if not drafts and config.speculative_method in WORKER_DRAFTED_METHODS:
            drafts = request.draft_token_ids[:room]
        elif not drafts:
            drafts = ngram_proposer.propose(
                request.token_ids, room, config.prompt_lookup_min, config.prompt_lookup_max
            )
        if grammar is not None and drafts:
            drafts = drafts[: grammar.usable_drafts(drafts)]
        return drafts

    def _drafts_fit(self, request: Request, target: int, num_drafts: int, num_left: int) -> bool:
        """Whether a sequence's drafts fit: in the slots its table already has, or in new
        blocks that still leave one for each of the ``num_left - 1`` running sequences
        after it. A guess never takes a block another sequence needs (never causes a
        preemption)."""
        block_manager = self.block_manager
        request_id = request.request_id
        needed = block_manager.num_new_blocks(request_id, target + num_drafts)
        extra = needed - block_manager.num_new_blocks(request_id, target)
        if extra == 0:
            return True
        if block_manager.needs_copy_on_write(request_id, request.num_computed_tokens):
            needed += 1
        return needed + num_left - 1 <= block_manager.num_free_blocks

    def _reserve_draft_slots(self, request: Request, target: int, num_left: int) -> list[int]:
        """Blocks for the draft model's guesses (speculative decoding with a draft model):
        after this step the workers' draft model writes K/V for the sequence's next token
        and its guesses past the ``target`` tokens scheduled, up to ``num_speculative_tokens``
        positions, wherever its table has slots (``gpu_worker/draft_model.py``). Reserved
        only from blocks that leave one for each of the ``num_left - 1`` running sequences
        after it, as ``_drafts_fit`` does: fewer slots only mean fewer guesses, and a guess
        never preempts. Returns the blocks added to the table."""
        config = self.config
        if (
            config.speculative_method not in WORKER_DRAFTED_METHODS
            or not config.num_speculative_tokens
            or not self._speculating
            or request.group is not None
            or request.pooling_params is not None
            or target < request.num_tokens  # a prefill chunk: nothing sampled after it
        ):
            return []
        block_manager = self.block_manager
        end = min(target + config.num_speculative_tokens, request.max_total_tokens)
        needed = block_manager.num_new_blocks(request.request_id, end)
        if needed == 0 or needed + num_left - 1 > block_manager.num_free_blocks:
            return []
        return block_manager.append(request.request_id, end) or []

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
        self, plan: StepPlan, request: Request, num_new: int, num_left: int | None = None
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
            self._step_copies[request.request_id] = (computed // block_manager.block_size, *copy)
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
        sequences = _leading_sequences(self.swapped)
        if self._num_batch_slots() + _batch_slots(sequences) > self.config.max_num_seqs:
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
                for _ in _leading_sequences(self.waiting):
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
        sequences = _leading_sequences(self.waiting)
        head = sequences[0]
        if self._num_batch_slots() + _batch_slots(sequences) > self.config.max_num_seqs:
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
            reserve_tokens=self._reservation_tokens(head),
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
        sequences = _leading_sequences(queue)
        head = sequences[0]
        lower = [sequence for sequence in self.running if sequence.priority > head.priority]
        if not lower:
            return
        group_size = _batch_slots(sequences)
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
        reason = f"request {_request_id(head)} of priority {head.priority} outranks it"
        while self.running and self.running[-1].priority > head.priority:
            blocks_missing = self._blocks_missing(sequences, bool(self.running))
            if (
                blocks_missing <= 0
                and self._num_batch_slots() + group_size <= max_num_seqs
                and not self._lora_slot_missing(head, self.running)
            ):
                break
            self._preempt(self._pop_newest_running(), plan, reason)

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

    def _lora_slot_missing(self, head: Request, running: Iterable[Request]) -> bool:
        """Whether ``head``'s adapter would take a batch of ``running`` past ``max_loras``
        distinct adapters (never for the base model, nor an adapter already running)."""
        cap = self.config.max_loras
        if not cap or not head.lora_id:
            return False
        adapters = {sequence.lora_id for sequence in running if sequence.lora_id}
        return head.lora_id not in adapters and len(adapters) >= cap

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

    def _reservation_tokens(self, request: Request) -> int:
        """Slots a contiguous policy reserves for the request at admission."""
        policy = self.config.allocation_policy
        if policy == "paged":
            return 0
        if policy == "max":
            return self.config.max_model_len
        max_tokens = request.sampling_params.max_tokens
        if policy == "pow2":
            max_tokens = 1 << (max_tokens - 1).bit_length()
        return min(request.num_prompt_tokens + max_tokens, self.config.max_model_len)

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
        switch = self.config.long_rope_switch
        # Computed from its first token: its rotation is the one its length says now.
        request.long_rope = bool(switch) and request.num_tokens > switch
        max_cached_tokens = None
        if request.sampling_params.prompt_logprobs is not None:
            max_cached_tokens = request.num_prompt_logprobs_reported - 1
        if request.pooling_params is not None and request.pooling_params.per_token:
            max_cached_tokens = 0  # a row per prompt token: every one is computed
        return self.block_manager.find_cached_prefix(
            request.token_ids, self._prefix_namespace(request), max_cached_tokens
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
        if any(self._crosses_long_rope_switch(sequence) for sequence in sequences):
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

    # ------------------------------------------------------------------ results

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestOutputDelta]:
        """Advance the counters of every scheduled sequence and record sampled tokens."""
        self.num_sampled_tokens += len(result.sampled_token_ids)
        rows_of: dict[str, list[int]] = {}
        for row, request_id in enumerate(result.request_ids):
            rows_of.setdefault(request_id, []).append(row)
        deltas: list[RequestOutputDelta] = []
        for sequence_id, why in result.failed_requests.items():
            sequence = self.requests.get(sequence_id)
            if sequence is not None:
                self._fail(_request_id(sequence), f"a worker refused it: {why}", deltas)
        beam_groups: dict[str, SequenceGroup] = {}
        for scheduled in (*plan.new_requests, *plan.cached_requests):
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            try:
                self._record(plan, scheduled, request, result, rows_of, deltas, beam_groups)
            except Exception as error:
                self._fail(_request_id(request), _failure("recording its step", error), deltas)
        for group in beam_groups.values():
            if group.request_id in self.groups and all(
                seq.request_id in group.pending_candidates for seq in group.sequences
            ):
                try:
                    self._beam_step(group, deltas)
                except Exception as error:
                    self._fail(group.request_id, _failure("its beam step", error), deltas)
        self._account_step()
        return deltas

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
            self._prefix_namespace(request),
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
                        _request_id(request), [], False, prompt_logprobs=prompt_logprobs
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
        for sequence in self.running:
            request_id = sequence.request_id
            # Blocks a sliding window freed hold no slot, nor the tokens that were in them.
            freed_slots = block_manager.num_window_freed(request_id) * block_size
            slots = len(tables.get(request_id, ())) * block_size - freed_slots
            table_slots += slots
            accounting.record_sequence(
                request_id, slots, sequence.num_computed_tokens - freed_slots
            )
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
        self, request: Request, rows: list[int], result: StepResult, prompt_logprobs: list | None
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
        finished = status.is_finished
        if finished:
            self._release(request, status)
        # Known from the first token on; sent then too, for a frontend that ends the
        # request itself (a stop string) and never sees the last delta.
        first_or_last = finished or request.num_output_tokens == 1
        return RequestOutputDelta(
            request.request_id,
            token_ids,
            finished=finished,
            finish_reason=status.value if finished else None,
            logprobs=logprobs or None,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens if first_or_last else None,
            queue_time_s=request.queue_time_s if first_or_last else None,
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

    @staticmethod
    def _new_prompt_logprobs(request: Request, result: StepResult) -> list | None:
        chunk = result.prompt_logprobs.get(request.request_id)
        if chunk is None:
            return None
        skip = request.num_prompt_logprobs_reported - chunk.first_position
        entries = chunk.entries[max(skip, 0) :]
        request.num_prompt_logprobs_reported += len(entries)
        return entries or None

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


def _batch_slots(sequences: list[Request]) -> int:
    """Batch slots a queued request's ``sequences`` take when they resume: a group that has
    not sampled yet (new, or preempted mid-prefill, by swap too) forks into its full size at
    its first sample, so room is kept for that (``_num_batch_slots`` counts it so)."""
    head = sequences[0]
    if head.group is not None and head.num_output_tokens == 0:
        return head.sampling_params.num_sequences
    return len(sequences)


def _leading_sequences(queue: deque[Request]) -> list[Request]:
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


def _request_id(request: Request) -> str:
    return request.request_id if request.group is None else request.group.request_id


def _failure(stage: str, error: Exception) -> str:
    return f"the scheduler failed on {stage}: {type(error).__name__}: {error}"
