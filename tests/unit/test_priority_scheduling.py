"""Priority scheduling (``SchedulerConfig.scheduling_policy="priority"``), driven through
the scheduler's public API with hand-made step results, as in test_scheduler.py."""

from __future__ import annotations

import pytest

from helpers.scheduling import make_request, run_checked_step, scheduled
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.config import SchedulerConfig, check_priority
from pagedserve.scheduler.request import RequestStatus
from pagedserve.scheduler.scheduler import Scheduler


def make_scheduler(num_blocks=8, block_size=8, num_host_blocks=0, **config) -> Scheduler:
    config.setdefault("max_model_len", 256)
    config.setdefault("watermark_fraction", 0.0)
    config.setdefault("scheduling_policy", "priority")
    return Scheduler(
        SchedulerConfig(**config),
        BlockManager(num_blocks, block_size, num_host_blocks=num_host_blocks),
    )


def run_to_end(scheduler: Scheduler, max_steps: int = 500) -> list[str]:
    """Step until every request ends; returns the request ids in the order they ended."""
    ended = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        _, deltas = run_checked_step(scheduler)
        ended.extend(d.request_id for d in deltas if d.finished)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks
    return ended


# --- refusals ------------------------------------------------------------------------------


def test_fcfs_refuses_a_priority_it_would_ignore():
    scheduler = make_scheduler(scheduling_policy="fcfs")
    with pytest.raises(ValueError, match=r"priority=3: this engine schedules first come"):
        scheduler.add_request(make_request("a", 4, priority=3))
    scheduler.add_request(make_request("b", 4, priority=0))  # the default is fine
    assert not scheduler.block_manager.block_tables and [
        r.request_id for r in scheduler.waiting
    ] == ["b"]


@pytest.mark.parametrize("value", [1.5, "1", True, None])
def test_priority_must_be_an_integer(value):
    with pytest.raises(ValueError, match=r"priority\[2\] must be an integer"):
        check_priority(value, "priority", "priority[2]")


def test_config_names_the_policies():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        SchedulerConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="scheduling_policy 'priority' needs allocation_policy"):
        SchedulerConfig(scheduling_policy="priority", allocation_policy="max")


# --- order ---------------------------------------------------------------------------------


def test_waiting_requests_run_by_priority_then_arrival():
    scheduler = make_scheduler(max_num_seqs=1)
    for name, priority in [("a", 5), ("b", 0), ("c", 0), ("d", -1)]:
        scheduler.add_request(make_request(name, 4, priority=priority, max_tokens=2))
    assert run_to_end(scheduler) == ["d", "b", "c", "a"]


def test_the_batch_extends_and_preempts_in_rank_order():
    """Three requests fill 3 of 4 blocks and each needs a second one: the one of the
    lowest priority is preempted, not the newest."""
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("a", 8, priority=0, max_tokens=20))
    scheduler.add_request(make_request("low", 8, priority=2, max_tokens=20))
    scheduler.add_request(make_request("c", 8, priority=0, max_tokens=20))
    run_checked_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a", "c", "low"]
    plan, _ = run_checked_step(scheduler)
    assert scheduled(plan) == {"a": 1, "c": 1}
    assert scheduler.requests["low"].status == RequestStatus.WAITING
    assert run_to_end(scheduler)[-1] == "low"


# --- preemption for a better-ranked queued request -----------------------------------------


def test_a_queued_request_preempts_lower_priority_running_ones():
    scheduler = make_scheduler(num_blocks=6)
    scheduler.add_request(make_request("low1", 12, priority=1, max_tokens=20))
    scheduler.add_request(make_request("low2", 28, priority=3, max_tokens=4))
    run_checked_step(scheduler)  # 6 of 6 blocks in use
    scheduler.add_request(make_request("high", 10, priority=0, max_tokens=3))
    plan, _ = run_checked_step(scheduler)
    # high needs 2 blocks: low2 (the lowest) goes, and high is admitted in the same step.
    assert scheduled(plan) == {"low1": 1, "high": 10}
    assert scheduler.requests["low2"].status == RequestStatus.WAITING
    assert plan.finished_request_ids == ["low2"]
    assert scheduler.num_recompute_preemptions == 1
    assert [r.request_id for r in scheduler.running] == ["high", "low1"]
    assert run_to_end(scheduler)[0] == "high"


def test_equal_priority_never_preempts():
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("a", 12, priority=1, max_tokens=4))
    scheduler.add_request(make_request("b", 12, priority=1, max_tokens=4))
    run_checked_step(scheduler)
    scheduler.add_request(make_request("c", 10, priority=1, max_tokens=3))
    plan, _ = run_checked_step(scheduler)
    assert scheduled(plan) == {"a": 1, "b": 1}
    assert scheduler.num_preemptions == 0
    assert run_to_end(scheduler) == ["a", "b", "c"]


def test_no_preemption_when_it_would_not_make_room():
    """The blocks the queued request needs are held by a request it does not outrank:
    the lower-priority one keeps running."""
    scheduler = make_scheduler(num_blocks=6)
    scheduler.add_request(make_request("peer", 30, priority=0, max_tokens=4))  # 4 blocks
    scheduler.add_request(make_request("low", 6, priority=5, max_tokens=20))  # 1 block
    run_checked_step(scheduler)  # 1 block free
    scheduler.add_request(make_request("high", 20, priority=0, max_tokens=2))  # 3 blocks
    plan, _ = run_checked_step(scheduler)
    assert scheduled(plan) == {"peer": 1, "low": 1}
    assert scheduler.num_preemptions == 0
    ended = run_to_end(scheduler)
    assert ended.index("peer") < ended.index("high")


def test_a_full_batch_makes_a_slot_for_a_higher_priority():
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=2)
    scheduler.add_request(make_request("a", 4, priority=0, max_tokens=20))
    scheduler.add_request(make_request("low", 4, priority=9, max_tokens=20))
    run_checked_step(scheduler)
    scheduler.add_request(make_request("high", 4, priority=-3, max_tokens=2))
    plan, _ = run_checked_step(scheduler)
    assert scheduled(plan) == {"a": 1, "high": 4}
    assert scheduler.requests["low"].status == RequestStatus.WAITING
    assert run_to_end(scheduler) == ["high", "a", "low"]


def test_swapped_requests_wait_behind_a_better_ranked_arrival():
    scheduler = make_scheduler(num_blocks=4, num_host_blocks=8, preemption_mode="swap")
    scheduler.add_request(make_request("low", 20, priority=4, max_tokens=12))
    run_checked_step(scheduler)  # 3 blocks
    scheduler.add_request(make_request("high", 16, priority=1, max_tokens=4))
    plan, _ = run_checked_step(scheduler)
    assert len(plan.swap_out) == 3 and scheduled(plan) == {"high": 16}
    assert scheduler.requests["low"].status == RequestStatus.SWAPPED
    # A second, better-ranked arrival is admitted although low waits in the swap pool
    # (first come, first served would resume low first).
    scheduler.add_request(make_request("mid", 4, priority=2, max_tokens=2))
    plan, _ = run_checked_step(scheduler)
    assert set(scheduled(plan)) == {"high", "mid"} and not plan.swap_in
    ended = run_to_end(scheduler)
    assert ended == ["mid", "high", "low"]
    assert scheduler.block_manager.num_free_host_blocks == 8


def test_a_parallel_sampling_group_is_preempted_whole():
    scheduler = make_scheduler(num_blocks=8, num_host_blocks=8)
    scheduler.add_request(make_request("g", 6, priority=1, max_tokens=10, n=3, seed=1))
    run_checked_step(scheduler)  # forks into 3 samples sharing one prompt block
    run_checked_step(scheduler)  # two of them copy it before writing: 3 blocks
    assert len(scheduler.running) == 3 and scheduler.block_manager.num_free_blocks == 5
    scheduler.add_request(make_request("high", 48, priority=0, max_tokens=2))  # 6 blocks
    plan, _ = run_checked_step(scheduler)
    assert scheduled(plan) == {"high": 48}
    assert {r.request_id for r in scheduler.swapped} == {"g", "g#1", "g#2"}
    assert plan.swap_out  # a group is swapped by default
    ended = run_to_end(scheduler)
    assert ended[0] == "high" and ended.count("g") == 1


def test_aborting_queued_and_running_requests_under_priority_frees_everything():
    scheduler = make_scheduler(num_blocks=4, num_host_blocks=4, preemption_mode="swap")
    scheduler.add_request(make_request("low", 16, priority=2, max_tokens=8))
    scheduler.add_request(make_request("x", 6, priority=1, max_tokens=8))
    run_checked_step(scheduler)
    scheduler.add_request(make_request("high", 20, priority=0, max_tokens=4))
    run_checked_step(scheduler)
    assert scheduler.requests["low"].status == RequestStatus.SWAPPED
    for request_id in ["low", "x", "high"]:
        scheduler.abort_request(request_id)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == 4
    assert scheduler.block_manager.num_free_host_blocks == 4
    scheduler.block_manager.check_integrity()


def test_forks_and_resumed_requests_keep_their_rank():
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=8)
    scheduler.add_request(make_request("late", 4, priority=2, max_tokens=5))
    scheduler.add_request(make_request("g", 4, priority=1, max_tokens=5, n=2, seed=3))
    run_checked_step(scheduler)
    assert [(r.request_id, r.rank) for r in scheduler.running] == [
        ("g", (1, 1)),
        ("g#1", (1, 1)),
        ("late", (2, 0)),
    ]


def test_a_group_swapped_before_its_first_sample_keeps_room_for_its_forks():
    # g (n=2) is swapped out mid-prefill, still one sequence; it forks into two at its first
    # sample, so while a runs it may not come back into a batch of two.
    scheduler = make_scheduler(
        num_blocks=16,
        num_host_blocks=16,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        preemption_mode="swap",
    )
    scheduler.add_request(make_request("g", 32, priority=1, n=2))
    plan, _ = run_checked_step(scheduler)
    assert scheduled(plan) == {"g": 8}
    scheduler.add_request(make_request("a", 8, priority=0, max_tokens=4))
    plan, _ = run_checked_step(scheduler)
    assert scheduled(plan) == {"a": 8}
    assert [r.request_id for r in scheduler.swapped] == ["g"]
    while "a" in scheduler.requests:
        assert [r.request_id for r in scheduler.running] == ["a"]
        run_checked_step(scheduler)
    while scheduler.has_unfinished_requests():
        run_checked_step(scheduler)
        assert len(scheduler.running) <= 2
