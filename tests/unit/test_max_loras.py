"""``max_loras``: the most distinct LoRA adapters one batch runs. Past the cap a request
waits: first come, first served steps over it (vLLM's rule) to admit requests of the base
model or of a running adapter; the priority policy keeps rank order and may preempt
lower-priority requests to free an adapter slot. Never more than the cap in any step."""

from __future__ import annotations

import pytest

from helpers.scheduling import make_request, run_checked_step, scheduled
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.scheduler import Scheduler


def make_scheduler(num_blocks=32, policy="fcfs", **config) -> Scheduler:
    config.setdefault("max_model_len", 256)
    config.setdefault("watermark_fraction", 0.0)
    return Scheduler(
        SchedulerConfig(scheduling_policy=policy, **config), BlockManager(num_blocks, 8)
    )


def add(scheduler: Scheduler, request_id: str, lora_id: int, priority=0, max_tokens=4):
    request = make_request(request_id, 4, priority=priority, max_tokens=max_tokens)
    request.lora_id = lora_id
    scheduler.add_request(request)
    return request


def running_adapters(scheduler: Scheduler) -> set[int]:
    return {request.lora_id for request in scheduler.running if request.lora_id}


def test_fcfs_steps_over_a_request_past_the_cap_and_keeps_its_place():
    scheduler = make_scheduler(max_loras=2)
    for request_id, lora_id in [("a", 1), ("b", 2), ("c", 3), ("d", 1), ("e", 0)]:
        add(scheduler, request_id, lora_id, max_tokens=3)
    plan, _ = run_checked_step(scheduler)
    # c (a third adapter) waits; d (a running adapter) and e (the base model) go past it.
    assert set(scheduled(plan)) == {"a", "b", "d", "e"}
    assert [request.request_id for request in scheduler.waiting] == ["c"]
    add(scheduler, "f", 2)
    plan, _ = run_checked_step(scheduler)
    assert "f" in scheduled(plan) and "c" not in scheduled(plan)
    assert [request.request_id for request in scheduler.waiting] == ["c"]
    while scheduler.has_unfinished_requests():
        plan, _ = run_checked_step(scheduler)
        assert len(running_adapters(scheduler)) <= 2
    # c ran once adapter 1 (a, d) had left the batch.


def test_the_cap_bounds_every_step_while_adapters_come_and_go():
    scheduler = make_scheduler(max_loras=3, max_num_seqs=6)
    for index in range(40):
        add(scheduler, f"r{index}", index % 7, max_tokens=1 + index % 5)
    seen = set()
    for _ in range(400):
        if not scheduler.has_unfinished_requests():
            break
        run_checked_step(scheduler)
        adapters = running_adapters(scheduler)
        assert len(adapters) <= 3
        seen |= adapters
    assert not scheduler.has_unfinished_requests()
    assert seen == set(range(1, 7))


def test_no_cap_batches_every_adapter_at_once():
    scheduler = make_scheduler()
    for index in range(6):
        add(scheduler, f"r{index}", index + 1)
    run_checked_step(scheduler)
    assert running_adapters(scheduler) == set(range(1, 7))


def test_priority_preempts_a_lower_request_to_free_an_adapter_slot():
    scheduler = make_scheduler(policy="priority", max_loras=1)
    add(scheduler, "low", 1, priority=5, max_tokens=20)
    run_checked_step(scheduler)
    add(scheduler, "high", 2, priority=0, max_tokens=2)
    plan, _ = run_checked_step(scheduler)
    assert "high" in scheduled(plan) and "low" not in scheduled(plan)
    assert running_adapters(scheduler) == {2}
    while scheduler.has_unfinished_requests():
        run_checked_step(scheduler)
        assert len(running_adapters(scheduler)) <= 1


def test_priority_never_preempts_an_equal_or_better_request_for_a_slot():
    scheduler = make_scheduler(policy="priority", max_loras=1)
    add(scheduler, "first", 1, priority=1, max_tokens=6)
    run_checked_step(scheduler)
    add(scheduler, "second", 2, priority=1, max_tokens=2)
    add(scheduler, "base", 0, priority=3, max_tokens=2)
    plan, _ = run_checked_step(scheduler)
    # second waits for first; rank order holds, so the base-model request waits too.
    assert set(scheduled(plan)) == {"first"}
    assert scheduler.num_preemptions == 0


def test_a_swapped_request_past_the_cap_waits_for_a_slot():
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=256,
            watermark_fraction=0.0,
            max_loras=1,
            preemption_mode="swap",
            scheduling_policy="priority",
        ),
        BlockManager(16, 8, num_host_blocks=16),
    )
    add(scheduler, "low", 1, priority=5, max_tokens=12)
    run_checked_step(scheduler)
    add(scheduler, "high", 2, priority=0, max_tokens=6)
    run_checked_step(scheduler)  # low is swapped out to free the adapter slot
    assert [request.request_id for request in scheduler.swapped] == ["low"]
    for _ in range(4):  # high's tokens 2 to 5
        plan, _ = run_checked_step(scheduler)
        assert "low" not in scheduled(plan) and plan.swap_in == []
    assert running_adapters(scheduler) == {2}
    plan, _ = run_checked_step(scheduler)  # high's last token
    assert plan.swap_in == []
    plan, _ = run_checked_step(scheduler)
    assert plan.swap_in and "low" in scheduled(plan)
    while scheduler.has_unfinished_requests():
        run_checked_step(scheduler)
    assert scheduler.num_swap_preemptions == 1


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_a_bad_cap_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="max_loras"):
        SchedulerConfig(max_loras=value)
