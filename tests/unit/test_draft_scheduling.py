"""How the scheduler takes a draft model's guesses (speculative decoding with a draft
model): they arrive with a step's result, go after the sequence's last token in its next
step, cut to its room; and blocks are reserved for the guesses only from blocks no running
sequence needs."""

from __future__ import annotations

from helpers.scheduling import make_request, make_scheduler
from pagedserve.scheduler.messages import StepPlan, StepResult
from pagedserve.scheduler.sampling_params import SamplingParams

K = 4  # guesses per step


def draft_scheduler(num_blocks=16, **config):
    return make_scheduler(
        num_blocks, num_speculative_tokens=K, speculative_method="draft_model", **config
    )


def answer(scheduler, plan: StepPlan, drafts: dict[str, list[int]], token_id: int = 7):
    """The worker's result: every draft accepted, then ``token_id``; then the guesses."""
    request_ids, token_ids = [], []
    for item in (*plan.new_requests, *plan.cached_requests):
        request = scheduler.requests[item.request_id]
        spec = plan.spec_token_ids.get(item.request_id, [])
        end = item.num_computed_tokens + item.num_scheduled_tokens
        if end == request.num_tokens + len(spec):
            request_ids += [item.request_id] * (len(spec) + 1)
            token_ids += [*spec, token_id]
    result = StepResult(plan.step_id, request_ids, token_ids, draft_token_ids=drafts)
    return scheduler.update_from_output(plan, result)


def table_tokens(scheduler, request_id: str) -> int:
    block_manager = scheduler.block_manager
    return len(block_manager.block_tables[request_id]) * block_manager.block_size


def test_guesses_are_scheduled_after_the_last_token_with_slots_reserved_past_them():
    scheduler = draft_scheduler()
    scheduler.add_request(make_request("a", 5, max_tokens=40))
    plan = scheduler.schedule()
    # The prompt and K positions after it: the sampled token and its first guesses.
    assert len(plan.new_requests[0].block_ids) == 2  # 5 + 4 tokens of 8-token blocks
    answer(scheduler, plan, {"a": [11, 12, 13, 14]})
    plan = scheduler.schedule()
    assert plan.spec_token_ids == {"a": [11, 12, 13, 14]}
    (item,) = plan.cached_requests
    assert (item.num_computed_tokens, item.num_scheduled_tokens) == (5, 5)
    assert table_tokens(scheduler, "a") >= 10 + K
    answer(scheduler, plan, {"a": [21, 22]})
    request = scheduler.requests["a"]
    assert request.output_token_ids == [7, 11, 12, 13, 14, 7]
    assert scheduler.num_accepted_tokens_per_pos == [1, 1, 1, 1]
    plan = scheduler.schedule()
    assert plan.spec_token_ids == {"a": [21, 22]}
    answer(scheduler, plan, {})
    assert scheduler.num_accepted_tokens_per_pos == [2, 2, 1, 1]


def test_a_step_that_samples_without_guesses_drops_the_old_ones():
    scheduler = draft_scheduler()
    scheduler.add_request(make_request("a", 5, max_tokens=40))
    answer(scheduler, scheduler.schedule(), {"a": [11, 12]})
    answer(scheduler, scheduler.schedule(), {})
    assert scheduler.schedule().spec_token_ids == {}


def test_guesses_are_cut_to_the_room_left_and_reservations_to_max_tokens():
    scheduler = draft_scheduler()
    scheduler.add_request(make_request("a", 6, max_tokens=3))
    plan = scheduler.schedule()
    # Prompt 6 + max_tokens 3 = 9 tokens at most: no slot past them.
    assert len(plan.new_requests[0].block_ids) == 2
    answer(scheduler, plan, {"a": [11, 12, 13, 14]})
    # One token out, two to go: one guess and the token after it.
    assert scheduler.schedule().spec_token_ids == {"a": [11]}
    assert table_tokens(scheduler, "a") == 16


def test_reservations_never_take_a_block_a_running_sequence_needs():
    """The last free block goes to the sequence that must have it for its next token,
    not to an earlier one's guesses: nobody is preempted for a guess."""
    scheduler = draft_scheduler(num_blocks=4)
    for request_id in "ab":
        scheduler.add_request(make_request(request_id, 8, max_tokens=20))
    plan = scheduler.schedule()
    # "a" was admitted first, with a block for its guesses; then one block was left
    # for "b"'s next token.
    assert [len(new.block_ids) for new in plan.new_requests] == [2, 1]
    answer(scheduler, plan, {"a": [11, 12, 13, 14]})  # "b" had no slot to guess in
    plan = scheduler.schedule()
    assert plan.spec_token_ids == {"a": [11, 12, 13, 14]}
    # "a"'s guesses after this step would need a third block: the last one is "b"'s.
    assert [len(item.new_block_ids) for item in plan.cached_requests] == [0, 1]
    assert scheduler.num_preemptions == 0
    assert scheduler.block_manager.num_free_blocks == 0


def test_a_batch_at_disable_by_batch_size_neither_speculates_nor_guesses():
    scheduler = draft_scheduler(speculative_disable_by_batch_size=2)
    for request_id, max_tokens in (("a", 40), ("b", 2)):
        scheduler.add_request(make_request(request_id, 5, max_tokens=max_tokens))
    plan = scheduler.schedule()
    assert plan.draft_guesses  # the step started with none running
    answer(scheduler, plan, {"a": [11, 12], "b": [13]})
    plan = scheduler.schedule()  # two running: at the limit
    assert (plan.spec_token_ids, plan.draft_guesses) == ({}, False)
    assert table_tokens(scheduler, "a") == 16  # no block reserved for guesses either
    answer(scheduler, plan, {})  # "b" ends (max_tokens 2)
    assert set(scheduler.requests) == {"a"}
    answer(scheduler, scheduler.schedule(), {"a": [21, 22]})
    plan = scheduler.schedule()
    assert (plan.spec_token_ids, plan.draft_guesses) == ({"a": [21, 22]}, True)


def test_sequences_of_a_group_neither_guess_nor_reserve():
    scheduler = draft_scheduler()
    request = make_request("a", 5, max_tokens=20)
    request.sampling_params = SamplingParams(max_tokens=20, temperature=1.0, n=2, seed=1)
    scheduler.add_request(request)
    plan = scheduler.schedule()
    assert len(plan.new_requests[0].block_ids) == 1
    result = StepResult(plan.step_id, ["a", "a"], [7, 8], draft_token_ids={"a": [11, 12]})
    scheduler.update_from_output(plan, result)
    assert scheduler.schedule().spec_token_ids == {}
