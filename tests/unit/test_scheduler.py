"""Scheduling policy, driven through its public API with hand-made step results."""

from __future__ import annotations

import pytest

from helpers.scheduling import EOS, make_request, make_scheduler, run_step, scheduled
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.messages import StepPlan
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler


def test_prefill_then_decode_one_token_per_step():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10, max_tokens=3))
    plan, deltas = run_step(scheduler)
    assert scheduled(plan) == {"a": 10}
    assert plan.new_requests[0].block_ids == [0, 1]
    assert [(d.request_id, d.new_token_ids, d.finished) for d in deltas] == [("a", [7], False)]
    plan, _ = run_step(scheduler)
    assert scheduled(plan) == {"a": 1}
    assert plan.cached_requests[0].num_computed_tokens == 10
    plan, deltas = run_step(scheduler)
    assert deltas[0].finished and deltas[0].finish_reason == "length"
    assert scheduler.block_manager.num_free_blocks == 16
    # The worker learns in the next plan that it can drop the request.
    assert scheduler.schedule().finished_request_ids == ["a"]


def test_token_budget_chunks_long_prompts_beside_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 3))
    run_step(scheduler)  # a prefilled, now decoding
    scheduler.add_request(make_request("b", 20))
    plan, deltas = run_step(scheduler)
    assert scheduled(plan) == {"a": 1, "b": 7}
    assert [d.request_id for d in deltas] == ["a"]  # a partial chunk samples nothing
    plan, _ = run_step(scheduler)
    assert scheduled(plan) == {"a": 1, "b": 7}
    plan, deltas = run_step(scheduler)
    assert scheduled(plan) == {"a": 1, "b": 6}
    assert {d.request_id for d in deltas} == {"a", "b"}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(
        num_blocks=64, max_num_batched_tokens=256, enable_chunked_prefill=False, max_model_len=256
    )
    scheduler.add_request(make_request("a", 200))
    scheduler.add_request(make_request("b", 100))
    plan, _ = run_step(scheduler)
    assert scheduled(plan) == {"a": 200}  # b does not fit the rest of the budget whole
    plan, _ = run_step(scheduler)
    assert scheduled(plan) == {"a": 1, "b": 100}


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 4))
    plan, _ = run_step(scheduler)
    assert set(scheduled(plan)) == {"a", "b"}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_requests_wait_for_blocks_and_run_when_blocks_free():
    scheduler = make_scheduler(num_blocks=4, block_size=8)
    scheduler.add_request(make_request("a", 24, max_tokens=2))
    scheduler.add_request(make_request("b", 16, max_tokens=2))
    plan, _ = run_step(scheduler)
    assert scheduled(plan) == {"a": 24}  # b's two blocks are not free
    plan, deltas = run_step(scheduler)
    assert deltas[0].finished  # a is done and its blocks are back at once
    plan, _ = run_step(scheduler)
    assert scheduled(plan) == {"b": 16}


def test_preemption_takes_the_newest_and_resumes_it_first():
    scheduler = make_scheduler(num_blocks=4, block_size=8)
    scheduler.add_request(make_request("a", 8, max_tokens=20, arrival=1.0))
    scheduler.add_request(make_request("b", 8, max_tokens=20, arrival=2.0))
    scheduler.add_request(make_request("c", 8, max_tokens=20, arrival=3.0))
    plan, _ = run_step(scheduler)
    assert scheduled(plan) == {"a": 8, "b": 8, "c": 8}  # 3 of 4 blocks used
    # Every request now needs a second block for its ninth token; only one is free.
    plan, _ = run_step(scheduler)
    assert scheduled(plan) == {"a": 1, "b": 1}
    assert scheduler.num_preemptions == 1
    victim = scheduler.requests["c"]
    assert victim.status == RequestStatus.WAITING and victim.num_computed_tokens == 0
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    assert plan.finished_request_ids == ["c"]  # workers drop c's state
    scheduler.block_manager.check_integrity()
    # At 17 tokens a needs a third block and none is free: b is now the newest.
    for _ in range(8):
        run_step(scheduler)
    assert scheduler.requests["b"].status == RequestStatus.WAITING
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_resumed_request_recomputes_prompt_and_generated_tokens():
    scheduler = make_scheduler(num_blocks=3, block_size=8)
    scheduler.add_request(make_request("a", 8, max_tokens=12, arrival=1.0))
    scheduler.add_request(make_request("b", 8, max_tokens=4, arrival=2.0))
    run_step(scheduler)
    run_step(scheduler)  # a takes the last block; b is preempted with 1 output token
    request_b = scheduler.requests["b"]
    assert request_b.status == RequestStatus.WAITING
    assert request_b.num_output_tokens == 1
    while request_b.status == RequestStatus.WAITING:
        plan, _ = run_step(scheduler)
    resumed = next(r for r in plan.new_requests if r.request_id == "b")
    assert resumed.token_ids == request_b.token_ids[:9]
    assert resumed.num_scheduled_tokens == 9


def test_rejects_requests_that_can_never_run():
    scheduler = make_scheduler(num_blocks=4, block_size=8, max_model_len=64)
    with pytest.raises(ValueError, match="prompt is 64 tokens; max_model_len is 64"):
        scheduler.add_request(make_request("a", 64))
    with pytest.raises(ValueError, match=r"needs up to 40 tokens .* 5 blocks .* has 4 blocks"):
        scheduler.add_request(make_request("b", 30, max_tokens=10))
    with pytest.raises(ValueError, match="at least 1 token"):
        scheduler.check_request_fits(0, 4)
    assert not scheduler.has_unfinished_requests()


def test_abort_frees_blocks_of_running_and_waiting_requests():
    scheduler = make_scheduler(num_blocks=4, block_size=8, max_num_seqs=1)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 4))
    run_step(scheduler)
    delta = scheduler.abort_request("a")
    assert delta.finished and delta.finish_reason == "abort"
    assert scheduler.abort_request("b").finish_reason == "abort"
    assert scheduler.abort_request("unknown") is None
    assert scheduler.block_manager.num_free_blocks == 4
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_request_ids == ["a"]  # b never reached a worker


def test_eos_and_stop_tokens_end_a_request():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4))
    _, deltas = run_step(scheduler, token_id=EOS)
    assert deltas[0].finished and deltas[0].finish_reason == "stop"
    request = make_request("b", 4)
    request.sampling_params = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[9])
    scheduler.add_request(request)
    _, deltas = run_step(scheduler, token_id=EOS)
    assert not deltas[0].finished
    _, deltas = run_step(scheduler, token_id=9)
    assert deltas[0].finish_reason == "stop"


def test_duplicate_request_id_is_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        scheduler.add_request(make_request("a", 4))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
        ("max_tokens", -5, "max_tokens must be >= 1, got -5"),
        ("temperature", -0.5, "temperature must be >= 0"),
        ("seed", -1, "seed must be >= 0, got -1"),
    ],
)
def test_sampling_params_name_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_config_rejects_unschedulable_limits():
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer, got 0"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        SchedulerConfig(
            max_num_batched_tokens=512, max_model_len=1024, enable_chunked_prefill=False
        )


def test_swap_preemption_copies_blocks_out_and_back_in():
    scheduler = make_scheduler(
        num_blocks=4, block_size=8, num_host_blocks=4, preemption_mode="swap"
    )
    scheduler.add_request(make_request("a", 8, max_tokens=20, arrival=1.0))
    scheduler.add_request(make_request("b", 8, max_tokens=20, arrival=2.0))
    scheduler.add_request(make_request("c", 8, max_tokens=20, arrival=3.0))
    run_step(scheduler)
    plan, _ = run_step(scheduler)
    assert scheduled(plan) == {"a": 1, "b": 1}
    assert plan.swap_out == [(2, 0)]  # c's block 2 goes to host block 0
    victim = scheduler.requests["c"]
    assert victim.status == RequestStatus.SWAPPED
    assert victim.num_computed_tokens == 8  # kept: nothing to recompute
    assert scheduler.num_swap_preemptions == 1 and scheduler.num_recompute_preemptions == 0
    assert plan.finished_request_ids == ["c"]
    scheduler.block_manager.check_integrity()
    # b is swapped out next (a needs its third block), then both come back when a ends.
    while scheduler.requests.get("a"):
        plan, _ = run_step(scheduler)
    assert [r.request_id for r in scheduler.swapped] == ["b", "c"]
    # b (16 tokens cached, 2 blocks) comes back first and grows to a third block; c's
    # two blocks no longer fit beside it.
    plan, _ = run_step(scheduler)
    assert [r.request_id for r in plan.new_requests] == ["b"]
    assert len(plan.swap_in) == 2 and not plan.swap_out
    assert plan.new_requests[0].num_computed_tokens == 16
    assert len(plan.new_requests[0].block_ids) == 3
    while scheduler.has_unfinished_requests():
        plan, _ = run_step(scheduler)
        scheduler.block_manager.check_integrity()
    assert scheduler.block_manager.num_free_host_blocks == 4


def test_full_host_pool_falls_back_to_recompute():
    scheduler = make_scheduler(
        num_blocks=4, block_size=8, num_host_blocks=0, preemption_mode="swap"
    )
    scheduler.add_request(make_request("a", 8, max_tokens=20, arrival=1.0))
    scheduler.add_request(make_request("b", 8, max_tokens=20, arrival=2.0))
    scheduler.add_request(make_request("c", 8, max_tokens=20, arrival=3.0))
    run_step(scheduler)
    plan, _ = run_step(scheduler)
    assert not plan.swap_out
    assert scheduler.requests["c"].status == RequestStatus.WAITING
    assert scheduler.num_recompute_preemptions == 1


def test_abort_of_a_swapped_request_frees_host_blocks():
    scheduler = make_scheduler(
        num_blocks=2, block_size=8, num_host_blocks=4, preemption_mode="swap"
    )
    scheduler.add_request(make_request("a", 8, max_tokens=8, arrival=1.0))
    scheduler.add_request(make_request("b", 8, max_tokens=8, arrival=2.0))
    run_step(scheduler)
    run_step(scheduler)
    assert scheduler.requests["b"].status == RequestStatus.SWAPPED
    scheduler.abort_request("b")
    assert scheduler.block_manager.num_free_host_blocks == 4
    assert not scheduler.swapped
    scheduler.block_manager.check_integrity()


# --- parallel samples ending one by one (a stop string found by the frontend) -------------


def make_group(request_id: str, num_prompt_tokens: int, **params) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(10, 10 + num_prompt_tokens)),
        sampling_params=SamplingParams(**{"temperature": 1.0, "seed": 1, **params}),
        eos_token_ids=frozenset({EOS}),
        arrival_time_s=0.0,
        max_model_len=256,
    )


def test_a_stopped_sample_leaves_the_batch_and_frees_its_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_group("g", 10, n=3, max_tokens=8))
    run_step(scheduler)  # prefill; forks into g, g#1, g#2 sharing 2 blocks
    run_step(scheduler)  # each writes its own copy of the shared last block
    free_before = scheduler.block_manager.num_free_blocks
    assert scheduler.stop_sample("g", 1) is None  # the others run on
    assert scheduler.block_manager.num_free_blocks == free_before + 1  # its own copy
    scheduler.block_manager.check_integrity()
    assert scheduler.stop_sample("g", 1) is None  # already ended: nothing happens
    received: dict[int, int] = {}
    final = None
    while scheduler.has_unfinished_requests():
        plan, deltas = run_step(scheduler)
        assert set(scheduled(plan)) == {"g", "g#2"}
        for delta in deltas:
            received[delta.index] = received.get(delta.index, 0) + len(delta.new_token_ids)
            final = delta
    assert received == {0: 6, 2: 6}  # 2 of 8 tokens came before the stop
    assert final.finished and final.finish_reason == "length"
    assert scheduler.block_manager.num_free_blocks == 16
    scheduler.block_manager.check_integrity()


def test_stopping_the_last_running_sample_ends_the_request():
    scheduler = make_scheduler()
    scheduler.add_request(make_group("g", 5, n=3, max_tokens=8))
    run_step(scheduler)
    assert scheduler.stop_sample("g", 0) is None
    assert scheduler.stop_sample("g", 2) is None
    final = scheduler.stop_sample("g", 1)
    assert (final.request_id, final.index, final.finished, final.finish_reason) == (
        "g",
        1,
        True,
        "stop",
    )
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == 16
    assert scheduler.stop_sample("g", 1) is None  # unknown now


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_sample_can_be_stopped(mode):
    # 9 blocks: "b" holds 3; the group "g" grows to 7 (2 shared, a copy-on-write block and a
    # third block each) and, the newest, is preempted whole: it waits, or is swapped out.
    scheduler = make_scheduler(num_blocks=9, num_host_blocks=9, preemption_mode=mode)
    scheduler.add_request(make_request("b", 10, max_tokens=12))
    scheduler.add_request(make_group("g", 10, n=3, max_tokens=12))
    queue = scheduler.waiting if mode == "recompute" else scheduler.swapped
    for _ in range(12):
        run_step(scheduler)
        if any(seq.group is not None for seq in queue):
            break
    assert {seq.request_id for seq in queue} == {"g", "g#1", "g#2"}
    host_blocks_held = scheduler.block_manager.num_free_host_blocks
    assert scheduler.stop_sample("g", 2) is None
    assert {seq.request_id for seq in queue} == {"g", "g#1"}
    if mode == "swap":  # its own host copies are freed (the shared ones stay)
        assert scheduler.block_manager.num_free_host_blocks > host_blocks_held
    scheduler.block_manager.check_integrity()
    while scheduler.has_unfinished_requests():
        plan, _ = run_step(scheduler)
        assert "g#2" not in scheduled(plan)
    assert scheduler.block_manager.num_free_blocks == 9
    assert scheduler.block_manager.num_free_host_blocks == 9


def test_samples_ranked_at_the_end_are_not_stopped_one_by_one():
    # best_of > n: the frontend sees the samples only once ranked, when all have ended.
    scheduler = make_scheduler()
    scheduler.add_request(make_group("g", 5, n=2, best_of=3, max_tokens=8))
    run_step(scheduler)
    running = list(scheduler.running)
    assert len(running) == 3
    assert scheduler.stop_sample("g", 1) is None
    assert scheduler.running == running


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_copy_on_write_planned_for_a_group_preempted_later_in_the_step_is_undone(mode):
    # 6 blocks of 8: "b" (20 tokens) holds 3, the group "g" (10 tokens, n=3) shares 2, one is
    # free. In the first decode step g copies the shared half-full block into the free one,
    # then g#1 needs a copy too: none is free, and the newest group, g's own, is preempted.
    scheduler = make_scheduler(num_blocks=6, block_size=8, num_host_blocks=8, preemption_mode=mode)
    scheduler.add_request(make_request("b", 20, max_tokens=4, arrival=1.0))
    scheduler.add_request(make_group("g", 10, n=3, max_tokens=6))
    run_step(scheduler)  # both prefill; g forks into g, g#1, g#2
    shared = scheduler.block_manager.block_tables["g"][1]
    plan, _ = run_step(scheduler)
    assert scheduled(plan) == {"b": 1}
    # g's copy was taken back: no copy runs, and nothing points at its destination.
    assert plan.copy_blocks == []
    if mode == "swap":
        # The group's two shared blocks go to the host once, the shared one included.
        assert len(plan.swap_out) == 2 and shared in dict(plan.swap_out)
        assert {seq.request_id for seq in scheduler.swapped} == {"g", "g#1", "g#2"}
    else:
        assert {seq.request_id for seq in scheduler.waiting} == {"g", "g#1", "g#2"}
    scheduler.block_manager.check_integrity()
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
        scheduler.block_manager.check_integrity()
    assert scheduler.block_manager.num_free_blocks == 6


def test_lora_loads_ride_the_next_step_and_unloads_wait_for_their_requests():
    scheduler = make_scheduler()
    scheduler.load_lora(3, "sql", "/adapters/sql")
    assert scheduler.schedule().load_loras == []  # an empty plan carries nothing
    request = make_request("a", 4, max_tokens=3)
    request.lora_id = 3
    scheduler.add_request(request)
    scheduler.unload_lora(3)
    plan, _ = run_step(scheduler)
    assert plan.load_loras == [(3, "sql", "/adapters/sql")]
    assert plan.unload_lora_ids == []  # "a" still runs under it
    plan, _ = run_step(scheduler)
    assert plan.load_loras == [] and plan.unload_lora_ids == []
    scheduler.add_request(make_request("b", 4, max_tokens=2))
    run_step(scheduler)  # a ends
    plan, _ = run_step(scheduler)
    assert plan.unload_lora_ids == [3]
    plan, _ = run_step(scheduler)
    assert plan.unload_lora_ids == []  # once


def test_a_long_rope_sequence_past_the_switch_is_computed_again_with_its_own_prefixes():
    """LongRoPE (``long_rope_switch`` 20): a sequence that grows past the original context
    is computed again from its first token (not counted as a preemption), then rotated with
    the long factors; prefix-cache blocks of the two rotations stay apart; a swap-out at
    that point recomputes it too; drafts never cross the switch for a short sequence."""
    config = SchedulerConfig(
        max_model_len=256, watermark_fraction=0.0, long_rope_switch=20,
        num_speculative_tokens=4,
    )  # fmt: skip
    block_manager = BlockManager(16, 8, num_host_blocks=8, enable_prefix_caching=True)
    scheduler = Scheduler(config, block_manager)
    scheduler.add_request(make_request("a", 18, max_tokens=6))
    run_step(scheduler)  # the prompt: 18 tokens, 19 known
    assert scheduler.requests["a"].rotation_epoch == 0
    plan, _ = run_step(scheduler)  # position 18: 20 known
    assert scheduled(plan) == {"a": 1}
    plan, _ = run_step(scheduler)  # position 19: 21 known, past the switch
    assert scheduled(plan) == {"a": 1}
    plan, _ = run_step(scheduler)  # computed again from its first token, all 21
    request = scheduler.requests["a"]
    assert scheduled(plan) == {"a": 21} and plan.new_requests[0].num_computed_tokens == 0
    assert request.rotation_epoch == 1 and scheduler.num_recompute_preemptions == 0
    # A short prompt of the same first 18 tokens and two others hits the short rotation's
    # two full blocks, which the long sequence's recompute could not use.
    scheduler.add_request(make_request("b", 20, max_tokens=1))
    plan, _ = run_step(scheduler)
    new = {r.request_id: r.num_computed_tokens for r in plan.new_requests}
    assert new == {"b": 16}
    # Swapping a sequence out as it crosses the switch recomputes it instead.
    scheduler.add_request(make_request("c", 20, max_tokens=4))
    run_step(scheduler)  # c: 21 known, past the switch
    victim = scheduler.requests["c"]
    scheduler.running.remove(victim)
    scheduler._preempt([victim], StepPlan(step_id=0), "test", mode="swap")
    assert victim.status == RequestStatus.WAITING and victim.num_computed_tokens == 0


def test_drafts_of_a_short_long_rope_sequence_stop_at_the_switch():
    config = SchedulerConfig(
        max_model_len=256, watermark_fraction=0.0, long_rope_switch=20, num_speculative_tokens=4
    )
    scheduler = Scheduler(config, BlockManager(16, 8))
    request = make_request("a", 18, max_tokens=8)
    request.prompt_token_ids = [1, 2, 3, 4] * 4 + [1, 2]
    request.token_ids = list(request.prompt_token_ids)
    scheduler.add_request(request)
    run_step(scheduler, token_id=3)  # 19 known: ...1, 2, 3, as four tokens before
    # Prompt lookup proposes 4, 1, 2, 3; only the one at position 19 stays within it.
    assert scheduler._draft_tokens(request, 1, 100) == [4]
    request.rotation_epoch = 1  # a sequence rotated with the long factors: no such cut
    assert scheduler._draft_tokens(request, 1, 100) == [4, 1, 2, 3]
