"""Iteration-level batching: which requests run in the next forward pass, and how far."""

from __future__ import annotations

import logging
from collections import deque

from pagedserve.scheduler.block_manager import BlockManager, blocks_for_tokens
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.messages import (
    CachedRequestData,
    NewRequestData,
    RequestOutputDelta,
    StepPlan,
    StepResult,
)
from pagedserve.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def check_request_fits(
    num_prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    block_size: int,
    total_blocks: int,
) -> None:
    """Raise ``ValueError`` for a request that could never run to completion: its prompt
    leaves no room to generate within ``max_model_len``, or it needs more blocks than the
    whole cache of ``total_blocks`` blocks of ``block_size`` tokens. A function of the
    limits alone, so a frontend in another process checks exactly what the scheduler
    will."""
    if num_prompt_tokens < 1:
        raise ValueError("prompt must contain at least 1 token, got 0")
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt is {num_prompt_tokens} tokens; max_model_len is {max_model_len} and "
            "must leave room for at least one generated token"
        )
    max_total_tokens = min(num_prompt_tokens + max_tokens, max_model_len)
    needed_blocks = blocks_for_tokens(max_total_tokens, block_size)
    if needed_blocks > total_blocks:
        raise ValueError(
            f"request needs up to {max_total_tokens} tokens (prompt {num_prompt_tokens} + "
            f"max_tokens {max_tokens}) = {needed_blocks} blocks of {block_size} tokens, "
            f"but the whole KV cache has {total_blocks} blocks "
            f"({total_blocks * block_size} tokens); lower max_tokens or raise kv_cache_bytes"
        )


class Scheduler:
    """First come, first served continuous batching over a paged KV cache.

    Each step first extends the running requests (oldest first: one token for a decode,
    the next chunk for an unfinished prefill), then admits waiting requests while the
    token budget, the sequence cap and free blocks allow. When a running request needs a
    block and none is free, the most recently arrived running request is preempted,
    all or nothing: by recompute (its blocks are freed and it returns to the front of
    the queue, to be prefilled again, prompt plus generated tokens) or by swap (its
    blocks are copied to the host pool and back when there is room). Preempted requests
    resume ahead of newer arrivals, swapped ones first. Finished requests give their
    blocks back at once.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.num_recompute_preemptions = 0
        self.num_swap_preemptions = 0
        self._step_id = 0
        # Requests whose full data the workers hold; anything else travels in full.
        self._known_to_workers: set[str] = set()
        self._drop_ids_for_workers: list[str] = []

    # ----------------------------------------------------------------- admission

    def check_request_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``ValueError`` for a request that could never run to completion."""
        check_request_fits(
            num_prompt_tokens,
            max_tokens,
            self.config.max_model_len,
            self.block_manager.block_size,
            self.block_manager.num_total_blocks,
        )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.check_request_fits(request.num_prompt_tokens, request.sampling_params.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> RequestOutputDelta | None:
        """End a request now; returns its final delta, or ``None`` if it is unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return RequestOutputDelta(request_id, [], finished=True, finish_reason="abort")

    @property
    def num_preemptions(self) -> int:
        return self.num_recompute_preemptions + self.num_swap_preemptions

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------- scheduling

    def schedule(self) -> StepPlan:
        """Decide the next step. The plan may be empty when nothing is runnable."""
        self._step_id += 1
        plan = StepPlan(step_id=self._step_id)
        budget = self.config.max_num_batched_tokens
        preempted = False

        index = 0
        while index < len(self.running):
            request = self.running[index]
            num_new = self._num_tokens_to_schedule(request, budget)
            if num_new == 0:
                index += 1
                continue
            target = request.num_computed_tokens + num_new
            while not self.block_manager.can_append(request.request_id, target):
                victim = self.running.pop()
                self._preempt(victim, plan)
                preempted = True
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # it was the last running request and preempted itself
            new_block_ids = self.block_manager.append(request.request_id, target)
            assert new_block_ids is not None
            plan.cached_requests.append(
                CachedRequestData(
                    request_id=request.request_id,
                    new_block_ids=new_block_ids,
                    num_computed_tokens=request.num_computed_tokens,
                    num_scheduled_tokens=num_new,
                )
            )
            budget -= num_new
            index += 1

        # After a preemption the cache is tight: admitting more would only thrash.
        if not preempted:
            budget = self._swap_in(plan, budget)
        if not preempted and not self.swapped:
            budget = self._admit_waiting(plan, budget)

        plan.finished_request_ids = self._drop_ids_for_workers
        self._drop_ids_for_workers = []
        return plan

    def _swap_in(self, plan: StepPlan, budget: int) -> int:
        """Bring swapped requests back, oldest first, while their blocks fit."""
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            num_new = self._num_tokens_to_schedule(request, budget)
            target = request.num_computed_tokens + num_new
            if num_new == 0 or not self.block_manager.can_swap_in(
                request.request_id, bool(self.running), num_tokens=target
            ):
                break
            self.swapped.popleft()
            plan.swap_in.extend(self.block_manager.swap_in(request.request_id, bool(self.running)))
            self.block_manager.append(request.request_id, target)
            self._start_running(plan, request, num_new)
            budget -= num_new
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int) -> int:
        block_manager = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached_block_ids = []
            if request.num_computed_tokens == 0:
                cached_block_ids = block_manager.find_cached_prefix(
                    request.token_ids, request.cache_namespace
                )
            num_cached = len(cached_block_ids) * block_manager.block_size
            num_new = self._num_tokens_to_schedule(request, budget, num_cached)
            if num_new == 0:
                break
            block_ids = block_manager.allocate(
                request.request_id,
                request.num_computed_tokens + num_cached + num_new,
                keep_watermark=bool(self.running),
                cached_block_ids=cached_block_ids,
            )
            if block_ids is None:
                break
            self.waiting.popleft()
            if block_manager.prefix_cache is not None and request.num_computed_tokens == 0:
                block_manager.prefix_cache.record_query(request.num_tokens - 1, num_cached)
                if request.num_preemptions == 0:
                    request.num_cached_tokens = num_cached
            request.num_computed_tokens += num_cached
            self._start_running(plan, request, num_new)
            budget -= num_new
        return budget

    def _start_running(self, plan: StepPlan, request: Request, num_new: int) -> None:
        """Move a request into the running batch and send it to workers in full."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
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
            )
        )

    def _num_tokens_to_schedule(
        self, request: Request, budget: int, num_cached_tokens: int = 0
    ) -> int:
        remaining = request.num_tokens - request.num_computed_tokens - num_cached_tokens
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Take a running request out of the batch, all or nothing: swap its blocks to
        the host pool, or free them to recompute later. Either way it resumes ahead of
        newer requests."""
        mode = self.config.preemption_mode or "recompute"
        reason = "no free KV block"
        request.num_preemptions += 1
        self._forget_on_workers(request.request_id)
        if mode == "swap":
            pairs = self.block_manager.swap_out(request.request_id)
            if pairs is not None:
                plan.swap_out.extend(pairs)
                request.status = RequestStatus.SWAPPED
                self.num_swap_preemptions += 1
                # Victims are taken newest first: pushing each to the front keeps the
                # queue in arrival order.
                self.swapped.appendleft(request)
                logger.info(
                    "preempted request %s by swap (%s): %d blocks to host",
                    request.request_id,
                    reason,
                    len(pairs),
                )
                return
            reason += "; host swap pool full, falling back to recompute"
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.num_recompute_preemptions += 1
        self.waiting.appendleft(request)
        logger.info(
            "preempted request %s by recompute (%s): %d tokens to recompute",
            request.request_id,
            reason,
            request.num_tokens,
        )

    # ------------------------------------------------------------------ results

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestOutputDelta]:
        """Advance the counters of every scheduled request and record sampled tokens."""
        sampled = {
            request_id: (token_id, result.logprobs[index] if result.logprobs else None)
            for index, (request_id, token_id) in enumerate(
                zip(result.request_ids, result.sampled_token_ids)
            )
        }
        deltas: list[RequestOutputDelta] = []
        for scheduled in (*plan.new_requests, *plan.cached_requests):
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += scheduled.num_scheduled_tokens
            self.block_manager.cache_full_blocks(
                request.request_id,
                request.token_ids,
                request.num_computed_tokens,
                request.cache_namespace,
            )
            prompt_logprobs = self._new_prompt_logprobs(request, result)
            if scheduled.request_id not in sampled:
                # A prefill chunk that did not reach the last prompt token.
                if prompt_logprobs:
                    deltas.append(
                        RequestOutputDelta(
                            request.request_id, [], False, prompt_logprobs=prompt_logprobs
                        )
                    )
                continue
            token_id, logprobs = sampled[scheduled.request_id]
            status = request.append_output_token(token_id)
            finished = status.is_finished
            if finished:
                self._finish(request, status)
            deltas.append(
                RequestOutputDelta(
                    request.request_id,
                    [token_id],
                    finished=finished,
                    finish_reason=status.value if finished else None,
                    logprobs=None if logprobs is None else [logprobs],
                    prompt_logprobs=prompt_logprobs,
                    # Known from the first token on; sent then too, for a frontend that
                    # ends the request itself (a stop string) and never sees the last delta.
                    num_cached_tokens=request.num_cached_tokens
                    if finished or request.num_output_tokens == 1
                    else None,
                )
            )
        return deltas

    @staticmethod
    def _new_prompt_logprobs(request: Request, result: StepResult) -> list | None:
        chunk = result.prompt_logprobs.get(request.request_id)
        if chunk is None:
            return None
        skip = request.num_prompt_logprobs_reported - chunk.first_position
        entries = chunk.entries[max(skip, 0) :]
        request.num_prompt_logprobs_reported += len(entries)
        return entries or None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        request.status = status
        self.block_manager.free(request.request_id)
        self._forget_on_workers(request.request_id)
        del self.requests[request.request_id]

    def _forget_on_workers(self, request_id: str) -> None:
        if request_id in self._known_to_workers:
            self._known_to_workers.discard(request_id)
            self._drop_ids_for_workers.append(request_id)
