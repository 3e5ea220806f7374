"""The scheduler driven by hand in unit tests: a scheduler, requests of made-up tokens, and
a step answered as a worker would answer it."""

from __future__ import annotations

from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.messages import StepPlan, StepResult
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler

EOS = 2


def make_scheduler(num_blocks=16, block_size=8, num_host_blocks=0, **config) -> Scheduler:
    """A scheduler of ``num_blocks`` device blocks (``config``: its ``SchedulerConfig``)."""
    config.setdefault("max_model_len", 256)
    config.setdefault("watermark_fraction", 0.0)
    return Scheduler(
        SchedulerConfig(**config),
        BlockManager(num_blocks, block_size, num_host_blocks=num_host_blocks),
    )


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int = 8,
    arrival: float = 0.0,
    priority: int = 0,
    **params,
) -> Request:
    """A greedy request of ``num_prompt_tokens`` made-up tokens (``params``: its other
    sampling parameters)."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(10, 10 + num_prompt_tokens)),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
        eos_token_ids=frozenset({EOS}),
        arrival_time_s=arrival,
        max_model_len=256,
        priority=priority,
    )


def scheduled(plan: StepPlan) -> dict[str, int]:
    """Tokens scheduled in the step, by request id."""
    return {
        r.request_id: r.num_scheduled_tokens for r in (*plan.new_requests, *plan.cached_requests)
    }


def run_step(scheduler: Scheduler, token_id: int = 7):
    """Schedule a step and answer it as a worker would: one token for each request
    whose known tokens are all computed after the step (a group's first sample: one per
    sequence it forks into)."""
    plan = scheduler.schedule()
    request_ids = []
    for item in (*plan.new_requests, *plan.cached_requests):
        request = scheduler.requests[item.request_id]
        if item.num_computed_tokens + item.num_scheduled_tokens == request.num_tokens:
            forks = request.group is not None and request.num_output_tokens == 0
            rows = request.sampling_params.num_sequences if forks else 1
            request_ids.extend([item.request_id] * rows)
    result = StepResult(plan.step_id, request_ids, [token_id] * len(request_ids))
    return plan, scheduler.update_from_output(plan, result)


def run_checked_step(scheduler: Scheduler, token_id: int = 7):
    """``run_step``, then the block manager's integrity check."""
    plan, deltas = run_step(scheduler, token_id)
    scheduler.block_manager.check_integrity()
    return plan, deltas
