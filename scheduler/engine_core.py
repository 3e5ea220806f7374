"""The engine loop: schedule a step, have the workers run it, record the results."""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Any, Protocol

from pagedserve.scheduler.block_manager import BlockManager, blocks_for_tokens
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.messages import RequestOutputDelta, StepPlan, StepResult
from pagedserve.scheduler.pooling_params import (
    PROMPT_ONLY_SAMPLING_PARAMS,
    PoolingParams,
)
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.step_profile import PROFILE
from pagedserve.scheduler.structured_output import GrammarVocabulary, StructuredOutput


class Executor(Protocol):
    """Runs a step plan on the workers. In-process it is the worker itself; across
    processes it is a transport with the same method."""

    def execute(self, plan: StepPlan) -> StepResult: ...


class PipelinedExecutor(Protocol):
    """An executor that takes the next plan before the last one's result is collected
    (async scheduling): plans run in the order submitted, results come back in it."""

    def submit(self, plan: StepPlan) -> None: ...

    def collect(self, plan: StepPlan) -> StepResult: ...


class InOrderExecution:
    """``submit`` / ``collect`` over the in-process worker. One that launches steps
    (``launch`` / ``follows`` / ``finish``: gpu_worker/worker.py) has each plan queued
    on its device when submitted, behind the step before it when the plan ``follows``
    that one, and finished when collected: on a GPU the host plans the next step while
    the device runs this one. Otherwise (``execute`` only) each plan runs when submitted,
    its result kept until collected. Either way the engine takes the same path as with a
    worker process and gives the same tokens."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._launches = all(hasattr(executor, name) for name in ("launch", "follows", "finish"))
        self._results: dict[int, StepResult] = {}
        # Launched and not finished, in launch order: (step id, the worker's handle).
        self._launched: list[tuple[int, Any]] = []

    def submit(self, plan: StepPlan) -> None:
        if not self._launches:
            self._results[plan.step_id] = self._executor.execute(plan)
            return
        executor: Any = self._executor
        ahead = self._launched[-1][1] if self._launched else None
        if ahead is not None and not executor.follows(plan, ahead):
            self._finish_launched()
            ahead = None
        self._launched.append((plan.step_id, executor.launch(plan, ahead)))

    def collect(self, plan: StepPlan) -> StepResult:
        while plan.step_id not in self._results:
            self._finish_one()
        return self._results.pop(plan.step_id)

    def _finish_launched(self) -> None:
        while self._launched:
            self._finish_one()

    def _finish_one(self) -> None:
        step_id, launched = self._launched.pop(0)
        self._results[step_id] = self._executor.finish(launched)


# The keys of ``EngineCore.stats()`` that count events since start (a Prometheus
# counter's semantics: rates are what an operator graphs); the rest are levels.
COUNTER_STATS = frozenset(
    {
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "num_recompute_preemptions",
        "num_swap_preemptions",
        "num_sampled_tokens",
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "num_window_freed_blocks",
        "num_steps_scheduled_ahead",
        "num_steps_launched_ahead",
    }
)


# ``stats()`` keys of the accepted drafts by position: this prefix, then the position (0: a
# step's first draft), one key per ``num_speculative_tokens`` (counters too).
ACCEPTED_PER_POSITION = "num_accepted_tokens_pos_"


class EngineCore:
    """Owns the scheduler and drives the executor, one step per call."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        executor: Executor,
        seed: int = 0,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = False,
        grammar_vocabulary: GrammarVocabulary | None = None,
        structured_output: StructuredOutput | None = None,
    ) -> None:
        """``grammar_vocabulary`` (the model's tokenizer) lets requests ask for structured
        output; without it such a request is refused. ``structured_output``, made by the
        caller, replaces it: the scheduler process makes one while its workers load, so
        its grammar tokenizer builds meanwhile."""
        watermark_blocks = int(scheduler_config.watermark_fraction * num_blocks)
        self.block_manager = BlockManager(
            num_blocks,
            block_size,
            watermark_blocks,
            num_host_blocks=num_host_blocks,
            enable_prefix_caching=enable_prefix_caching,
            allocation_policy=scheduler_config.allocation_policy,
            sliding_window=scheduler_config.sliding_window,
        )
        if scheduler_config.allocation_policy == "max":
            needed = blocks_for_tokens(scheduler_config.max_model_len, block_size)
            if needed > num_blocks:
                raise ValueError(
                    f"allocation_policy 'max' reserves max_model_len "
                    f"({scheduler_config.max_model_len} tokens = {needed} blocks) per "
                    f"request, but the KV cache has {num_blocks} blocks; lower max_model_len"
                )
        if structured_output is None:
            structured_output = StructuredOutput(grammar_vocabulary)
        elif grammar_vocabulary is not None:
            raise ValueError("give grammar_vocabulary or structured_output, not both")
        self.scheduler = Scheduler(scheduler_config, self.block_manager, structured_output)
        self.executor = executor
        # Async scheduling: the plan the workers run while the engine plans the next one.
        self._pipeline: PipelinedExecutor | None = None
        if scheduler_config.async_scheduling:
            self._pipeline = executor if hasattr(executor, "submit") else InOrderExecution(executor)
        # Async scheduling: the plans at the workers whose results are not recorded yet,
        # in order (at most two: the one awaited, and the one planned ahead of it).
        self._in_flight: list[StepPlan] = []
        # Steps a worker queued on its device before the tokens of the one before them
        # were read (StepResult.launched_ahead).
        self.num_steps_launched_ahead = 0
        # Requests that sample without a seed get one from here, so a whole run is
        # reproducible from the engine's seed and each request's draws stay its own.
        self._seed_rng = random.Random(seed)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        arrival_time_s: float | None = None,
        cache_namespace: str | None = None,
        lora_id: int = 0,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """Queue a request; raises ``ValueError`` if it could never run. ``lora_id``: the
        LoRA adapter (1, 2, ...: the workers' ``lora_modules`` in order; 0: none).
        ``priority``: lower runs first (``SchedulerConfig.scheduling_policy``).
        ``pooling_params`` makes it an embedding request: ``sampling_params`` is then
        ignored (``PROMPT_ONLY_SAMPLING_PARAMS`` stands in)."""
        if pooling_params is not None:
            sampling_params = PROMPT_ONLY_SAMPLING_PARAMS
        if not sampling_params.is_greedy and sampling_params.seed is None:
            sampling_params = replace(sampling_params, seed=self._seed_rng.getrandbits(63))
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            eos_token_ids=eos_token_ids,
            arrival_time_s=time.monotonic() if arrival_time_s is None else arrival_time_s,
            max_model_len=self.scheduler.config.max_model_len,
            cache_namespace=cache_namespace,
            lora_id=lora_id,
            priority=priority,
            pooling_params=pooling_params,
        )
        self.scheduler.add_request(request)

    def load_lora(self, lora_id: int, name: str, path: str) -> None:
        """Serve LoRA adapter ``lora_id`` (its files checked by the caller); requests may
        name it at once: the workers load it with the next step."""
        self.scheduler.load_lora(lora_id, name, path)

    def unload_lora(self, lora_id: int) -> None:
        """Drop adapter ``lora_id`` on the workers once its queued requests have ended."""
        self.scheduler.unload_lora(lora_id)

    def check_request_fits(
        self, num_prompt_tokens: int, max_tokens: int, num_sequences: int = 1
    ) -> None:
        """Raise ``ValueError`` for a request that could never run to completion."""
        self.scheduler.check_request_fits(num_prompt_tokens, max_tokens, num_sequences)

    def abort_request(self, request_id: str) -> RequestOutputDelta | None:
        return self.scheduler.abort_request(request_id)

    def stop_sample(self, request_id: str, index: int) -> RequestOutputDelta | None:
        return self.scheduler.stop_sample(request_id, index)

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running, or a step in flight whose results are due."""
        return bool(self._in_flight) or self.scheduler.has_unfinished_requests()

    def take_failures(self) -> dict[str, str]:
        """Requests that failed in the engine since the last call (request id -> why): a
        request's failure ends that request only (its final delta says "error")."""
        return self.scheduler.take_failures()

    def step(self) -> list[RequestOutputDelta]:
        """Run one iteration and return the new tokens of every request it advanced.
        With async scheduling that is the oldest step in flight, if any, and before its
        tokens are returned the plan after the next goes to the workers
        (``schedule_ahead.py``): the workers then have a step queued while the caller
        hands these tokens on."""
        started_ns = PROFILE.now()
        if not self._in_flight:
            plan = self.scheduler.schedule()
            started_ns = PROFILE.lap("schedule", started_ns)
            if plan.is_empty and self.scheduler.has_unfinished_requests():
                # Admission checks guarantee a lone request always fits, so an empty plan
                # with work pending is a scheduler bug, not a capacity state.
                raise RuntimeError(
                    f"scheduler produced an empty step with {len(self.scheduler.waiting)} "
                    f"waiting and {len(self.scheduler.running)} running requests"
                )
            if not plan.has_work_for_workers:
                return []
            # An empty plan still travels when it tells workers to drop state or swap.
            if self._pipeline is None:
                result = self.executor.execute(plan)
                started_ns = PROFILE.lap("execute", started_ns)
                deltas = self.scheduler.update_from_output(plan, result)
                PROFILE.lap("update", started_ns)
                return deltas
            self._pipeline.submit(plan)
            self._in_flight.append(plan)
            started_ns = PROFILE.lap("submit", started_ns)
            self._plan_ahead()
            started_ns = PROFILE.now()
        plan = self._in_flight.pop(0)
        result = self._pipeline.collect(plan)
        started_ns = PROFILE.lap("collect", started_ns)
        self.num_steps_launched_ahead += result.launched_ahead
        deltas = self.scheduler.update_from_output(plan, result)
        PROFILE.lap("update", started_ns)
        if self._in_flight:
            self._plan_ahead()
        return deltas

    def _plan_ahead(self) -> None:
        """Plan behind the one step in flight, every earlier step recorded, when the
        scheduler can (``Scheduler.schedule_ahead``), and send it to the workers."""
        started_ns = PROFILE.now()
        plan = self.scheduler.schedule_ahead(self._in_flight[-1])
        started_ns = PROFILE.lap("schedule_ahead", started_ns)
        if plan is not None:
            self._pipeline.submit(plan)
            self._in_flight.append(plan)
            PROFILE.lap("submit", started_ns)

    def finish_in_flight(self) -> list[RequestOutputDelta]:
        """Await and record the steps in flight, if any (before the workers stop)."""
        deltas = []
        while self._in_flight:
            plan = self._in_flight.pop(0)
            deltas += self.scheduler.update_from_output(plan, self._pipeline.collect(plan))
        return deltas

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def stats(self) -> dict[str, int | float]:
        """Counters (``COUNTER_STATS``: they only grow), levels (queues, free blocks), and
        the memory accounting of finished sequences (fractions)."""
        scheduler = self.scheduler
        prefix_cache = self.block_manager.prefix_cache
        return {
            "prefix_cache_queries": prefix_cache.num_queried_tokens if prefix_cache else 0,
            "prefix_cache_hits": prefix_cache.num_hit_tokens if prefix_cache else 0,
            "num_waiting": len(scheduler.waiting),
            "num_running": len(scheduler.running),
            "num_swapped": len(scheduler.swapped),
            "num_preemptions": scheduler.num_preemptions,
            "num_recompute_preemptions": scheduler.num_recompute_preemptions,
            "num_swap_preemptions": scheduler.num_swap_preemptions,
            "num_sampled_tokens": scheduler.num_sampled_tokens,
            "num_drafts": scheduler.num_drafts,
            "num_draft_tokens": scheduler.num_draft_tokens,
            "num_accepted_tokens": scheduler.num_accepted_tokens,
            **{
                f"{ACCEPTED_PER_POSITION}{position}": count
                for position, count in enumerate(scheduler.num_accepted_tokens_per_pos)
            },
            "num_window_freed_blocks": scheduler.num_window_freed_blocks,
            "num_steps_scheduled_ahead": scheduler.num_steps_scheduled_ahead,
            "num_steps_launched_ahead": self.num_steps_launched_ahead,
            "num_free_blocks": self.block_manager.num_free_blocks,
            "num_total_blocks": self.block_manager.num_total_blocks,
            "num_free_host_blocks": self.block_manager.num_free_host_blocks,
            "num_total_host_blocks": self.block_manager.num_total_host_blocks,
            **scheduler.accounting.summary(),
        }

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
